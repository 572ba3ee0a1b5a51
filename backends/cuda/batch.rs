//! Batched copies between a [`CudaDeviceTier`] and any other tier, and the tier's
//! [`BatchCopy`] hook, through which the transfer engine sends it whole batches.
//!
//! * The other side host addressable (pinned tier, memory tier): copies go straight between the
//!   device and the host tier's own memory, lent by nesting its `with_block`/`with_block_mut` for
//!   every block of the batch, one planned batch of copies and one event wait.
//! * The other side not host addressable (disk): through a pinned bounce buffer (pooled, at most
//!   [`MAX_BOUNCE_BYTES`]; a batch is cut to fit), one block per slot, so a disk block that fails
//!   its checksum fails alone.
//! * Another device tier on the other side: the hook declines, and the engine copies block by
//!   block through `read_block`/`write_block`.
//!
//! ## Soundness
//!
//! A batch takes its device blocks' locks in ascending order, then the host side's (also
//! ascending, through the host tier's own `with_block`/`with_block_mut`), and holds all of them
//! until its event completed. Device locks always come before host locks, and the per-block paths
//! never hold a device lock while taking another lock, so no cycle exists. A destination block
//! twice in one batch is refused.

use std::io::{IoSlice, IoSliceMut};

use super::device::{lookup, CudaDeviceTier};
use super::plan::{block_pieces, plan_copies, CopyOp, Direction};
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::tier::{BatchCopy, StorageTier, TierKind};

/// Largest number of blocks handled as one batch of copies (and one bounce buffer).
pub const MAX_BATCH_BLOCKS: usize = 256;

/// Largest pinned bounce buffer (a batch through one is cut to fit, at least one block).
pub const MAX_BOUNCE_BYTES: usize = 64 << 20;

impl CudaDeviceTier {
    /// Copies device blocks into `dst` (`(device block, dst block)` pairs); one result per pair.
    /// A host-addressable `dst` is written in place; any other through a pinned bounce buffer.
    pub fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Vec<Result<()>> {
        self.batched(dst, pairs, Direction::DeviceToHost)
    }

    /// Copies blocks of `src` into device blocks (`(src block, device block)` pairs); one result
    /// per pair. A host-addressable `src` is read in place; any other through a pinned bounce.
    pub fn copy_from(&self, src: &dyn StorageTier, pairs: &[(usize, usize)]) -> Vec<Result<()>> {
        self.batched(src, pairs, Direction::HostToDevice)
    }

    fn batched(
        &self,
        other: &dyn StorageTier,
        pairs: &[(usize, usize)],
        dir: Direction,
    ) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = vec![Ok(()); pairs.len()];
        if self.layout().dims() != other.layout().dims() {
            let e = Error::invalid_layout(format!(
                "cannot copy between device blocks {:?} and {} blocks {:?}: dimensions differ",
                self.layout().dims(),
                other.kind(),
                other.layout().dims()
            ));
            out.iter_mut().for_each(|r| *r = Err(e.clone()));
            return out;
        }
        // (index into pairs, device block, other block)
        let mut valid = Vec::with_capacity(pairs.len());
        for (i, &(a, b)) in pairs.iter().enumerate() {
            let (dev, oth) = match dir {
                Direction::DeviceToHost => (a, b),
                Direction::HostToDevice => (b, a),
            };
            if dev >= self.num_blocks() {
                out[i] = Err(Error::out_of_range("block", dev, self.num_blocks())
                    .with("tier", TierKind::Device));
            } else if oth >= other.num_blocks() {
                out[i] = Err(Error::out_of_range("block", oth, other.num_blocks())
                    .with("tier", other.kind()));
            } else {
                valid.push((i, dev, oth));
            }
        }
        let direct = other.capability().host_addressable;
        let per_batch = if direct {
            MAX_BATCH_BLOCKS
        } else {
            (MAX_BOUNCE_BYTES / self.bytes_per_block()).clamp(1, MAX_BATCH_BLOCKS)
        };
        for chunk in valid.chunks(per_batch) {
            if direct {
                if let Err(e) = self.direct(other, chunk, dir) {
                    for &(i, _, _) in chunk {
                        out[i] = Err(e.clone());
                    }
                }
            } else {
                self.bounced(other, chunk, dir, &mut out);
            }
        }
        out
    }

    /// Device ↔ a host-addressable tier's own memory, one planned batch.
    fn direct(
        &self,
        other: &dyn StorageTier,
        chunk: &[(usize, usize, usize)],
        dir: Direction,
    ) -> Result<()> {
        let write_device = dir == Direction::HostToDevice;
        let mut dev: Vec<usize> = chunk.iter().map(|c| c.1).collect();
        let mut oth: Vec<usize> = chunk.iter().map(|c| c.2).collect();
        dev.sort_unstable();
        oth.sort_unstable();
        let (nd, no) = (dev.len(), oth.len());
        dev.dedup();
        oth.dedup();
        if (write_device && dev.len() != nd) || (!write_device && oth.len() != no) {
            return Err(Error::invalid_argument(
                "a destination block appears twice in one batch",
            ));
        }
        let _dev_guards = DeviceGuards::take(self, &dev, write_device)?;
        let mut acc = Vec::with_capacity(oth.len());
        with_host_runs(other, &oth, !write_device, &mut acc, &mut |runs| {
            let pieces = chunk
                .iter()
                .map(|&(_, d, o)| {
                    let k = oth
                        .binary_search(&o)
                        .map_err(|_| Error::internal("host block not locked"))?;
                    Ok(block_pieces(&self.runs(d)?, &runs[k]))
                })
                .collect::<Result<Vec<_>>>()?;
            let ops = plan_copies(&pieces, self.device().max_pitch());
            let stream = if write_device {
                &self.load
            } else {
                &self.store
            };
            self.run(stream, dir, &ops)
        })
    }

    /// Device ↔ a tier that is not host addressable, through a pinned bounce buffer (slot `k` for
    /// the chunk's `k`-th pair). Per-pair results.
    fn bounced(
        &self,
        other: &dyn StorageTier,
        chunk: &[(usize, usize, usize)],
        dir: Direction,
        out: &mut [Result<()>],
    ) {
        let bpb = self.bytes_per_block();
        let mut buf = match self.take_bounce(chunk.len() * bpb) {
            Ok(b) => b,
            Err(e) => {
                for &(i, _, _) in chunk {
                    out[i] = Err(e.clone());
                }
                return;
            }
        };
        let base = buf.as_ptr() as usize;
        let plan = |slots: &[(usize, usize)]| -> Result<Vec<CopyOp>> {
            let pieces = slots
                .iter()
                .map(|&(k, d)| Ok(block_pieces(&self.runs(d)?, &[(base + k * bpb, bpb)])))
                .collect::<Result<Vec<_>>>()?;
            Ok(plan_copies(&pieces, self.device().max_pitch()))
        };
        match dir {
            Direction::DeviceToHost => {
                let slots: Vec<(usize, usize)> =
                    chunk.iter().enumerate().map(|(k, c)| (k, c.1)).collect();
                let mut dev: Vec<usize> = chunk.iter().map(|c| c.1).collect();
                dev.sort_unstable();
                dev.dedup();
                let read = DeviceGuards::take(self, &dev, false)
                    .and_then(|_g| self.run(&self.store, dir, &plan(&slots)?));
                for (k, &(i, _, o)) in chunk.iter().enumerate() {
                    out[i] = match &read {
                        Err(e) => Err(e.clone()),
                        Ok(()) => {
                            other.write_block(o, &[IoSlice::new(&buf.as_slice()[k * bpb..][..bpb])])
                        }
                    };
                }
            }
            Direction::HostToDevice => {
                let mut slots = Vec::with_capacity(chunk.len());
                for (k, &(i, d, o)) in chunk.iter().enumerate() {
                    let slot = &mut buf.as_mut_slice()[k * bpb..][..bpb];
                    match other.read_block(o, &mut [IoSliceMut::new(slot)]) {
                        Ok(()) => slots.push((k, d)),
                        Err(e) => out[i] = Err(e),
                    }
                }
                if !slots.is_empty() {
                    let mut dev: Vec<usize> = slots.iter().map(|s| s.1).collect();
                    dev.sort_unstable();
                    let n = dev.len();
                    dev.dedup();
                    let written = if dev.len() != n {
                        Err(Error::invalid_argument(
                            "a destination block appears twice in one batch",
                        ))
                    } else {
                        DeviceGuards::take(self, &dev, true)
                            .and_then(|_g| self.run(&self.load, dir, &plan(&slots)?))
                    };
                    if let Err(e) = written {
                        for &(k, _) in &slots {
                            out[chunk[k].0] = Err(e.clone());
                        }
                    }
                }
            }
        }
        self.put_bounce(buf);
    }
}

/// The transfer engine's way in: the whole batch as planned copies and one event wait, when the
/// other side is not a device tier too (device ↔ device stays on the engine's per-block path).
impl BatchCopy for CudaDeviceTier {
    fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Option<Vec<Result<()>>> {
        lookup(dst)
            .is_none()
            .then(|| self.batched(dst, pairs, Direction::DeviceToHost))
    }

    fn copy_from(
        &self,
        src: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        lookup(src)
            .is_none()
            .then(|| self.batched(src, pairs, Direction::HostToDevice))
    }
}

/// Locks on a sorted, deduplicated set of device blocks, released on drop.
enum DeviceGuards<'a> {
    Read(#[allow(dead_code)] Vec<parking_lot::RwLockReadGuard<'a, ()>>),
    Write(#[allow(dead_code)] Vec<parking_lot::RwLockWriteGuard<'a, ()>>),
}

impl<'a> DeviceGuards<'a> {
    fn take(tier: &'a CudaDeviceTier, sorted: &[usize], write: bool) -> Result<Self> {
        if write {
            sorted
                .iter()
                .map(|&b| tier.lock_for(b).map(|l| l.write()))
                .collect::<Result<Vec<_>>>()
                .map(DeviceGuards::Write)
        } else {
            sorted
                .iter()
                .map(|&b| tier.lock_for(b).map(|l| l.read()))
                .collect::<Result<Vec<_>>>()
                .map(DeviceGuards::Read)
        }
    }
}

/// One host block's runs as `(address, len)`, canonical order.
type HostRuns = Vec<(usize, usize)>;

/// Lends the runs of every block in `blocks` (ascending, distinct) of a host-addressable tier to
/// `f` at once, as `(address, len)` lists in `blocks` order, nesting the tier's own
/// `with_block`/`with_block_mut` so each block's lock is held until `f` returns.
fn with_host_runs(
    tier: &dyn StorageTier,
    blocks: &[usize],
    write: bool,
    acc: &mut Vec<HostRuns>,
    f: &mut dyn FnMut(&[HostRuns]) -> Result<()>,
) -> Result<()> {
    let Some((&b, rest)) = blocks.split_first() else {
        return f(acc);
    };
    if write {
        tier.with_block_mut(b, &mut |segs| {
            acc.push(
                segs.iter_mut()
                    .map(|s| (s.as_mut_ptr() as usize, s.len()))
                    .collect(),
            );
            let r = with_host_runs(tier, rest, write, acc, f);
            acc.pop();
            r
        })
    } else {
        tier.with_block(b, &mut |segs| {
            acc.push(
                segs.iter()
                    .map(|s| (s.as_ptr() as usize, s.len()))
                    .collect(),
            );
            let r = with_host_runs(tier, rest, write, acc, f);
            acc.pop();
            r
        })
    }
}
