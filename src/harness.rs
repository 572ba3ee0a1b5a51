//! Single-process building blocks for an engine adapter's example, test or stand-in: what every
//! adapter needs besides its own [`SchedulerAdapter`] and engine model.
//!
//! * [`InProcess`] — one [`Leader`] and one [`Worker`] over the in-process transport, started and
//!   waited for, with [`InProcess::iteration`] making one engine iteration's calls in the order
//!   `docs/adapters.md` gives (build the metadata, bind it, start loads, the forward pass, save)
//!   and [`InProcess::finish_iteration`] its end (`get_finished`, the load errors), and [`InProcess::is_quiescent`] saying
//!   when nothing is left to do;
//! * [`DeviceBlocks`] — a stand-in engine's device cache: free blocks (zeroed when handed out)
//!   and the blocks of finished requests held until the worker releases them;
//! * [`ScratchDir`] — a private directory for a disk tier, removed on drop;
//! * [`block_image`], [`write_blocks`] and [`verify_blocks`] (and [`matching_blocks`], which
//!   blocks of two tiers hold the same bytes) — a deterministic stand-in for a model's KV (a block's
//!   bytes are a function of every token up to its end, as a real model's are), and the check that
//!   blocks on a tier hold exactly those bytes: what an onboarded block must be.
//!
//! The device tier and the [`TierFactory`] building the host and disk tiers are the caller's
//! (any [`StorageTier`] of kind device, e.g. a memory tier; the storage backends' standard
//! factory), so nothing here depends on a backend. `examples/toy_engine.rs` uses all of it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::connector::adapter::{Engine, SchedulerAdapter, SchedulerStep};
use crate::connector::barrier::NonBlocking;
use crate::connector::leader::Leader;
use crate::connector::transport::in_process;
use crate::connector::worker::{TierFactory, Worker};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::Token;
use crate::layout::KvLayout;
use crate::tier::{StorageTier, StorageTierExt};

/// How long [`InProcess::iteration`] waits for the iteration's transfers to finish.
pub const ITERATION_TIMEOUT: Duration = Duration::from_secs(30);

/// A directory of its own under the system's temporary directory (mode 0700), removed with its
/// contents on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `<tmp>/<label>-<pid>-<n>`, where `n` makes the name unused. Refuses to reuse an
    /// existing directory.
    pub fn new(label: &str) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let base = std::env::temp_dir();
        for attempt in 0..100u32 {
            let dir = base.join(format!("{label}-{}-{nanos}-{attempt}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Self(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io("create a scratch directory", e)),
            }
        }
        Err(Error::new(
            ErrorKind::AlreadyExists,
            "no unused scratch directory name in 100 tries",
        ))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stand-in engine's device cache: its tier and which of its blocks are free. Blocks handed
/// out are zeroed first, so a load that never wrote a block cannot pass for one that did; the
/// blocks of a finished request the connector still reads are held until the worker releases
/// the request.
#[derive(Debug)]
pub struct DeviceBlocks {
    tier: Arc<dyn StorageTier>,
    free: Vec<usize>,
    held: HashMap<RequestId, Vec<usize>>,
}

impl DeviceBlocks {
    /// Every block of `tier` free.
    pub fn new(tier: Arc<dyn StorageTier>) -> Self {
        let free = (0..tier.num_blocks()).rev().collect();
        Self {
            tier,
            free,
            held: HashMap::new(),
        }
    }

    /// The device tier.
    pub fn tier(&self) -> &Arc<dyn StorageTier> {
        &self.tier
    }

    /// `n` free blocks, zeroed, lowest ids first. [`ErrorKind::NoSpace`] when fewer are free
    /// (nothing is taken).
    pub fn allocate(&mut self, n: usize) -> Result<Vec<usize>> {
        let Some(rest) = self.free.len().checked_sub(n) else {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("{n} device blocks wanted, {} free", self.free.len()),
            ));
        };
        let blocks: Vec<usize> = self.free.split_off(rest).into_iter().rev().collect();
        let zero = vec![0u8; self.tier.bytes_per_block()];
        for &b in &blocks {
            self.tier.write_block_from_slice(b, &zero)?;
        }
        Ok(blocks)
    }

    /// A request finished with these blocks: free again, or, when `held` (the leader's answer
    /// to [`Leader::request_finished`]), kept until [`DeviceBlocks::release`] names `id`.
    pub fn finish(&mut self, id: &RequestId, blocks: Vec<usize>, held: bool) {
        if held {
            self.held.entry(id.clone()).or_default().extend(blocks);
        } else {
            self.free.extend(blocks);
        }
    }

    /// The worker released these requests: their held blocks are free. An id not held is
    /// [`ErrorKind::NotFound`] (the others are still freed).
    pub fn release(&mut self, released: &[RequestId]) -> Result<()> {
        let mut unknown = None;
        for id in released {
            match self.held.remove(id) {
                Some(blocks) => self.free.extend(blocks),
                None => unknown = Some(id),
            }
        }
        match unknown {
            Some(id) => Err(Error::new(
                ErrorKind::NotFound,
                format!("released request {id} holds no device blocks"),
            )),
            None => Ok(()),
        }
    }

    /// Free blocks.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Requests whose blocks are held.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }
}

/// What the worker reported in [`InProcess::finish_iteration`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reported {
    /// Held requests the worker released: their device blocks are the engine's again.
    pub released: Vec<RequestId>,
    /// Requests whose loads all finished: they may compute now.
    pub loaded: Vec<RequestId>,
    /// Device blocks whose load failed (of the requests in `loaded`): recompute, never use.
    pub load_errors: Vec<usize>,
}

/// One leader and one worker in this process, over [`in_process`]`(1)`.
pub struct InProcess<A: SchedulerAdapter> {
    /// The scheduler side.
    pub leader: Leader<A>,
    /// The one rank.
    pub worker: Worker,
}

impl<A: SchedulerAdapter> InProcess<A> {
    /// Builds the worker (registering `device`, whose layout's page size is the leader's), then
    /// the leader, and waits until both finished the start-up barrier, at most
    /// `config.init_timeout()`. The worker side must not block (it is built first, on this
    /// thread); the leader's may.
    pub fn start<E>(
        adapter: A,
        config: Config,
        device: Arc<dyn StorageTier>,
        tiers: Arc<dyn TierFactory>,
    ) -> Result<Self>
    where
        E: Engine<Adapter = A, WorkerInit = NonBlocking>,
    {
        let page_size = device.layout().dims().page_size;
        let (leader_end, worker_ends) = in_process(1);
        let worker_end = worker_ends
            .into_iter()
            .next()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "in_process(1) gave no worker end"))?;
        let mut worker = Worker::new::<E>(config.clone(), 1, worker_end, tiers)?;
        worker.register(device)?;
        let deadline = Instant::now() + config.init_timeout();
        let mut leader = Leader::new::<E>(adapter, config, page_size, leader_end)?;
        while !(leader.is_ready() && worker.is_ready()) {
            if let Some(e) = worker.init_error() {
                return Err(e);
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("start-up did not finish: {:?}", leader.status()),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(Self { leader, worker })
    }

    /// One engine iteration up to its finished requests: builds the metadata of `step` (a
    /// rejected step is an error and changes nothing), binds it, starts the loads, runs `forward`
    /// (the engine's forward pass), saves, and waits for every transfer of the iteration
    /// ([`ITERATION_TIMEOUT`]). Returns how many operations the metadata carried. The engine then
    /// finishes its requests ([`Leader::request_finished`]) and calls
    /// [`InProcess::finish_iteration`].
    pub fn iteration(
        &mut self,
        step: &SchedulerStep,
        forward: impl FnOnce() -> Result<()>,
    ) -> Result<usize> {
        let bytes = self.leader.build_connector_meta(step)?;
        self.worker.bind_metadata(&bytes)?;
        let operations = self.worker.current_operations().len();
        self.worker.start_load()?;
        forward()?;
        self.worker.save()?;
        self.worker.wait_idle(ITERATION_TIMEOUT)?;
        Ok(operations)
    }

    /// The iteration's end: tells the worker the requests the engine `finished` since the last
    /// call ([`Worker::get_finished`], every loaded request reported) and takes the load errors.
    pub fn finish_iteration(&mut self, finished: &[RequestId]) -> Reported {
        let (released, loaded) = self.worker.get_finished(finished, None);
        Reported {
            released,
            loaded,
            load_errors: self.worker.take_load_errors(),
        }
    }

    /// True when nothing is in flight and nothing is queued: completions are applied first,
    /// and work the leader queued for the next metadata (e.g. host → disk copies of blocks
    /// whose store just completed) counts as not quiescent. An idle engine keeps running empty
    /// iterations until this holds.
    pub fn is_quiescent(&mut self) -> bool {
        self.leader.process_completions();
        !self.leader.has_pending_work()
    }
}

/// The stand-in KV of token block `block` of a sequence: `bytes` bytes determined by every
/// token up to the block's end (FNV-1a over them, spread by a multiplicative sequence), so two
/// blocks differ whenever their prefixes do. `None` when `tokens` do not reach the block's end.
pub fn block_image(
    tokens: &[Token],
    block: usize,
    page_size: usize,
    bytes: usize,
) -> Option<Vec<u8>> {
    let end = block.checked_add(1)?.checked_mul(page_size)?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens.get(..end)? {
        h = (h ^ u64::from(*t)).wrapping_mul(0x0100_0000_01b3);
    }
    Some(
        (0..bytes as u64)
            .map(|i| (h.wrapping_add(i.wrapping_mul(0x9e37_79b9)) >> 11) as u8)
            .collect(),
    )
}

/// The forward pass's stand-in: writes [`block_image`]`(tokens, k, …)` into `tier`'s block
/// `blocks[k]` for every `k` from `from` on (the page size is the tier's). Errors: a block past
/// `tokens`, or the tier's.
pub fn write_blocks(
    tier: &dyn StorageTier,
    tokens: &[Token],
    blocks: &[usize],
    from: usize,
) -> Result<()> {
    let page_size = tier.layout().dims().page_size;
    for (k, &b) in blocks.iter().enumerate().skip(from) {
        tier.write_block_from_slice(b, &image(tokens, k, page_size, tier.bytes_per_block())?)?;
    }
    Ok(())
}

fn image(tokens: &[Token], k: usize, page_size: usize, bytes: usize) -> Result<Vec<u8>> {
    block_image(tokens, k, page_size, bytes).ok_or_else(|| {
        Error::invalid_argument(format!("block {k} is past the {} tokens", tokens.len()))
    })
}

/// Checks that `tier`'s block `blocks[k]` holds [`block_image`]`(tokens, k, …)` for every `k`
/// (the page size is the tier's), byte for byte. Returns how many blocks were checked; the first
/// block that differs is a [`ErrorKind::Corrupt`] error naming it.
pub fn verify_blocks(tier: &dyn StorageTier, tokens: &[Token], blocks: &[usize]) -> Result<usize> {
    let page_size = tier.layout().dims().page_size;
    for (k, &b) in blocks.iter().enumerate() {
        if tier.read_block_to_vec(b)? != image(tokens, k, page_size, tier.bytes_per_block())? {
            return Err(Error::corrupt(format!(
                "block {k} of the sequence (tier block {b}) does not hold its bytes"
            ))
            .with("block", b));
        }
    }
    Ok(blocks.len())
}

/// `(block of src, block of dst)` for every `dst` block whose bytes equal a `src` block's
/// (blocks a tier cannot read, e.g. never written, are left out; of several equal `src` blocks,
/// one is named): which blocks of one tier hold a copy of another's, found by content.
pub fn matching_blocks(src: &dyn StorageTier, dst: &dyn StorageTier) -> Vec<(usize, usize)> {
    let by_bytes: HashMap<Vec<u8>, usize> = (0..src.num_blocks())
        .filter_map(|b| Some((src.read_block_to_vec(b).ok()?, b)))
        .collect();
    (0..dst.num_blocks())
        .filter_map(|b| Some((*by_bytes.get(&dst.read_block_to_vec(b).ok()?)?, b)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, LayoutDims};
    use crate::tier::TierKind;

    #[derive(Debug)]
    struct MemTier {
        layout: Layout,
        data: parking_lot::Mutex<Vec<Vec<u8>>>,
    }

    impl StorageTier for MemTier {
        fn kind(&self) -> TierKind {
            TierKind::Device
        }
        fn layout(&self) -> &Layout {
            &self.layout
        }
        fn capability(&self) -> crate::tier::Capability {
            crate::tier::Capability {
                host_addressable: false,
                direct_io_alignment: 1,
                checksummed: false,
                max_in_flight: 1,
            }
        }
        fn read_block(&self, b: usize, dst: &mut [std::io::IoSliceMut<'_>]) -> Result<()> {
            let data = self.data.lock();
            let mut src: &[u8] = &data[b];
            for d in dst {
                let n = d.len();
                d.copy_from_slice(&src[..n]);
                src = &src[n..];
            }
            Ok(())
        }
        fn write_block(&self, b: usize, src: &[std::io::IoSlice<'_>]) -> Result<()> {
            let mut data = self.data.lock();
            data[b] = src.iter().flat_map(|s| s.iter().copied()).collect();
            Ok(())
        }
    }

    #[test]
    fn images_follow_the_whole_prefix() {
        let a: Vec<Token> = (0..12).collect();
        let mut b = a.clone();
        b[1] = 99; // changes every block from block 0 on
        assert_eq!(block_image(&a, 1, 4, 64), block_image(&a, 1, 4, 64));
        assert_ne!(block_image(&a, 2, 4, 64), block_image(&b, 2, 4, 64));
        assert_ne!(block_image(&a, 0, 4, 64), block_image(&a, 1, 4, 64));
        assert_eq!(block_image(&a, 2, 4, 64).map(|v| v.len()), Some(64));
        assert_eq!(block_image(&a, 3, 4, 64), None, "past the tokens");
        assert_eq!(block_image(&a, usize::MAX, 4, 64), None);
    }

    #[test]
    fn verification_finds_one_wrong_byte() {
        let dims = LayoutDims {
            num_layers: 1,
            outer_dim: 1,
            page_size: 4,
            inner_dim: 4,
            dtype_bytes: 2,
        };
        let layout = Layout::fully_contiguous(dims, 4).unwrap();
        let bytes = layout.bytes_per_block();
        let tier = MemTier {
            layout,
            data: parking_lot::Mutex::new(vec![vec![0; bytes]; 4]),
        };
        let tokens: Vec<Token> = (0..8).collect();
        write_blocks(&tier, &tokens, &[3, 1], 0).unwrap();
        assert_eq!(
            tier.read_block_to_vec(1).unwrap(),
            block_image(&tokens, 1, 4, bytes).unwrap()
        );
        assert_eq!(verify_blocks(&tier, &tokens, &[3, 1]).unwrap(), 2);
        // Blocks 0 and 2 are both still zero: each matches one of them.
        let m = matching_blocks(&tier, &tier);
        assert_eq!(m.len(), 4);
        assert!(m.contains(&(3, 3)) && m.contains(&(1, 1)) && !m.contains(&(1, 3)));
        // Writing from block 1 on leaves block 0 (tier block 3) as it was.
        let other: Vec<Token> = (100..108).collect();
        write_blocks(&tier, &other, &[3, 0], 1).unwrap();
        assert_eq!(verify_blocks(&tier, &tokens, &[3]).unwrap(), 1);
        assert_eq!(
            verify_blocks(&tier, &other, &[0]).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        // The blocks swapped, a block never written, one byte off: each is Corrupt.
        for blocks in [[1, 3], [3, 2]] {
            let e = verify_blocks(&tier, &tokens, &blocks).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt);
        }
        let mut bad = tier.read_block_to_vec(1).unwrap();
        bad[bytes - 1] ^= 1;
        tier.write_block_from_slice(1, &bad).unwrap();
        let e = verify_blocks(&tier, &tokens, &[3, 1]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        // More blocks than tokens: an argument error, not a pass.
        assert_eq!(
            verify_blocks(&tier, &tokens[..4], &[3, 1])
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn device_blocks_zero_hold_and_release() {
        let dims = LayoutDims {
            num_layers: 1,
            outer_dim: 1,
            page_size: 4,
            inner_dim: 4,
            dtype_bytes: 1,
        };
        let layout = Layout::fully_contiguous(dims, 3).unwrap();
        let bytes = layout.bytes_per_block();
        let tier = Arc::new(MemTier {
            layout,
            data: parking_lot::Mutex::new(vec![vec![7; bytes]; 3]),
        });
        let mut dev = DeviceBlocks::new(tier.clone());
        assert_eq!(dev.tier().num_blocks(), 3);
        let a = dev.allocate(2).unwrap();
        assert_eq!(a, [0, 1]);
        assert_eq!(tier.read_block_to_vec(1).unwrap(), vec![0; bytes], "zeroed");
        assert_eq!(
            tier.read_block_to_vec(2).unwrap(),
            vec![7; bytes],
            "untouched"
        );
        assert_eq!(dev.allocate(2).unwrap_err().kind(), ErrorKind::NoSpace);
        assert_eq!(dev.num_free(), 1, "a refused allocation takes nothing");
        let (r, s) = (RequestId::from("r"), RequestId::from("s"));
        dev.finish(&r, a, true);
        assert_eq!((dev.num_free(), dev.num_held()), (1, 1));
        let e = dev.release(&[s.clone(), r.clone()]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(
            (dev.num_free(), dev.num_held()),
            (3, 0),
            "r freed all the same"
        );
        let b = dev.allocate(1).unwrap();
        dev.finish(&s, b, false);
        assert_eq!(dev.num_free(), 3);
    }

    #[test]
    fn scratch_dirs_are_private_distinct_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let a = ScratchDir::new("kvbm-harness-test").unwrap();
        let b = ScratchDir::new("kvbm-harness-test").unwrap();
        assert_ne!(a.path(), b.path());
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists());
    }
}
