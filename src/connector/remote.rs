//! The remote (G4) tier's discovery: instances sharing a directory (`remote.dir`) publish what
//! their host tier holds and how to reach it, and onboard each other's blocks over UCX.
//!
//! Files in the directory (each written to a temporary name, then renamed):
//! * `<instance>.index.json` ([`HostIndex`]), by the leader every `remote.publish_every`
//!   iterations: the keys of its registered host blocks and where they are;
//! * `<instance>.rank<r>.export.json`, by each worker: its host tier's export, as the storage
//!   backend that provides the [`WorkerRemote`] hooks writes it (how to reach the tier, its
//!   addresses, its block headers).
//!
//! The index may be stale at any time; correctness never depends on it: every remote block is
//! read verified ([`WorkerRemote::source`]: the exporter's header must name the expected key and
//! the bytes must hash to its checksum), so a stale entry costs a load error (the engine
//! recomputes), never wrong bytes. See docs/nixl.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::RemoteConfig;
use crate::error::{Error, Result};
use crate::identity::{HashAlgorithm, SequenceHash};
use crate::tier::StorageTier;

/// What an instance's host tier holds, as its leader last published it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIndex {
    /// The publishing instance.
    pub instance: String,
    /// Its tensor-parallel size (an importer needs the same sharding).
    pub world_size: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Bytes of one block over all ranks.
    pub bytes_per_block: usize,
    /// Hash of the block keys.
    pub hash: HashAlgorithm,
    /// Width of the keys in bits ([`HostIndex::KEY_BITS`]). Indexes of older versions (64-bit
    /// keys, no such field) do not parse, and are skipped.
    pub key_bits: u32,
    /// `(key, host block)` of every registered host block.
    pub blocks: Vec<(u128, usize)>,
}

impl HostIndex {
    /// The key width this version writes and reads.
    pub const KEY_BITS: u32 = 128;
}

/// `<dir>/<instance>.index.json`.
pub fn index_path(dir: &Path, instance: &str) -> PathBuf {
    dir.join(format!("{instance}.index.json"))
}

/// `<dir>/<instance>.rank<rank>.export.json`.
pub fn export_path(dir: &Path, instance: &str, rank: usize) -> PathBuf {
    dir.join(format!("{instance}.rank{rank}.export.json"))
}

static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` atomically: a temporary name in the same folder, then `rename`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create the remote directory", e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        NEXT_TMP.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("write a remote-tier file", e).with("path", path.display())
        })
}

/// The leader's side: publishes its own index, reads the peers'.
#[derive(Debug)]
pub(crate) struct LeaderRemote {
    pub dir: PathBuf,
    pub instance: String,
    pub every: u64,
    /// Iteration of the last publish/refresh (`None`: never).
    pub last: Option<u64>,
    /// Key → (peer instance, its host block), from the peers' indexes.
    pub index: HashMap<SequenceHash, (Arc<str>, usize)>,
}

impl LeaderRemote {
    pub fn new(config: &RemoteConfig) -> Option<Self> {
        let dir = config.dir.clone()?;
        Some(Self {
            dir,
            instance: config.instance_name(),
            every: config.publish_every(),
            last: None,
            index: HashMap::new(),
        })
    }

    /// Whether it is time to publish and refresh at `iteration`.
    pub fn due(&self, iteration: u64) -> bool {
        self.last
            .is_none_or(|l| iteration.saturating_sub(l) >= self.every)
    }

    /// Writes this instance's index.
    pub fn publish(&self, index: &HostIndex) -> Result<()> {
        let bytes = serde_json::to_vec(index)
            .map_err(|e| Error::internal(format!("encode the host index: {e}")))?;
        write_atomic(&index_path(&self.dir, &self.instance), &bytes)
    }

    /// Re-reads every peer's index, keeping those `compatible` with this instance.
    pub fn refresh(&mut self, compatible: impl Fn(&HostIndex) -> bool) {
        let mut index = HashMap::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(dir = %self.dir.display(), error = %e, "cannot list the remote directory");
                self.index = index;
                return;
            }
        };
        let own = format!("{}.index.json", self.instance);
        let mut names: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with(".index.json") && !n.starts_with('.') && n != own)
            })
            .collect();
        names.sort();
        for path in names {
            let peer: HostIndex = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "skipping an unreadable peer index");
                    continue;
                }
            };
            if peer.instance == self.instance
                || peer.key_bits != HostIndex::KEY_BITS
                || !compatible(&peer)
            {
                continue;
            }
            let name: Arc<str> = Arc::from(peer.instance.as_str());
            for (key, block) in peer.blocks {
                index
                    .entry(SequenceHash(key))
                    .or_insert_with(|| (name.clone(), block));
            }
        }
        self.index = index;
    }
}

/// The worker's side of the remote (G4) tier, as a storage backend provides it: its host tier
/// exported to the peers sharing the directory, and the peers' host tiers it loads from. The
/// worker calls these hooks; a [`TierFactory`](super::worker::TierFactory) builds them (when
/// `remote.dir` is set) with the worker's other tiers.
pub trait WorkerRemote: Send + Sync + std::fmt::Debug {
    /// Writes this worker's host-tier export under the leader's instance name `instance` (once
    /// per name; nothing when the worker has no host tier).
    fn export_as(&self, instance: &str) -> Result<()>;

    /// The source tier of one load from `instance`'s host tier: `keys` are `(peer host block,
    /// expected key)`, and a block is read only if verified to hold its key (a block whose check
    /// fails is a failed block, never served).
    fn source(&self, instance: &str, keys: &[(usize, u128)]) -> Result<Arc<dyn StorageTier>>;

    /// Marks host blocks as holding nothing verifiable: called before they are written.
    fn invalidate(&self, blocks: &[usize]);

    /// Publishes that host block `b` now holds `key`, for each `(b, key)`: called once their
    /// writes completed.
    fn publish(&self, blocks: &[(usize, u128)]);
}

/// What a [`RemoteStore`]'s values belong to: two instances share blocks through a store only
/// when their scopes are equal (same model and layout, same sharding, same keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteScope {
    /// Fingerprint of everything that makes two instances' blocks interchangeable (model and
    /// layout description, page size, one rank's bytes per block, world size, key hash and
    /// width), as lowercase hex; built by [`RemoteScope::new`]. Stores put it in their keys.
    pub fingerprint: String,
    /// Tensor-parallel size: every block is stored as one value per rank.
    pub world_size: usize,
    /// Bytes of one rank's share of a block (the length of every value's payload).
    pub bytes_per_block: usize,
}

impl RemoteScope {
    /// The scope of an instance: `description` names the model and layout (anything whose
    /// change makes blocks incompatible: dtype, layers, heads, head size, block order).
    pub fn new(
        description: &str,
        page_size: usize,
        world_size: usize,
        bytes_per_block: usize,
        hash: HashAlgorithm,
    ) -> Result<Self> {
        if world_size == 0 || page_size == 0 || bytes_per_block == 0 {
            return Err(Error::invalid_argument(format!(
                "remote scope needs a non-zero world size ({world_size}), page size \
                 ({page_size}) and bytes per block ({bytes_per_block})"
            )));
        }
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [
            description.as_bytes(),
            &(page_size as u64).to_le_bytes(),
            &(world_size as u64).to_le_bytes(),
            &(bytes_per_block as u64).to_le_bytes(),
            format!("{hash:?}").as_bytes(),
            &HostIndex::KEY_BITS.to_le_bytes(),
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let digest = h.finalize();
        let fingerprint = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            fingerprint,
            world_size,
            bytes_per_block,
        })
    }
}

/// How one block of a [`RemoteStore::get`] turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteRead {
    /// Read and verified (key, length, checksum, and MAC when a secret is configured); the
    /// destination holds the block.
    Hit,
    /// Not in the store (never written, or evicted / expired): a miss, the engine recomputes.
    Missing,
    /// A value was there but failed verification (wrong key, truncated, bad checksum or MAC):
    /// never served; the reason names what was wrong.
    Invalid(String),
}

/// What a [`RemoteStore::put`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemotePut {
    /// Values written.
    pub written: usize,
    /// Values already present, not rewritten.
    pub present: usize,
}

/// Counters of a [`RemoteStore`] for metrics and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteStoreStats {
    /// Whether the store answered its last call (false while it is down / reconnecting).
    pub available: bool,
    /// Calls that failed (connection refused or lost, server error).
    pub errors: u64,
    /// Calls that missed their deadline.
    pub timeouts: u64,
    /// Successful reconnections after a failure.
    pub reconnects: u64,
    /// Values that failed verification on read.
    pub invalid: u64,
}

/// A shared block store beyond this machine (the G4 tier), as a storage backend provides it
/// (e.g. Redis / Valkey). Keys are 128-bit block keys ([`SequenceHash`]`.0`); the store scopes
/// them by its [`RemoteScope`] and by rank. Every call is bounded by `deadline`: a store that is
/// down or slow answers [`crate::ErrorKind::Timeout`] or another error, never hangs, and
/// reconnects in the background. A value is never served unless verified.
pub trait RemoteStore: Send + Sync + std::fmt::Debug {
    /// Where it is, for logs and metrics (no password or secret).
    fn describe(&self) -> String;

    /// The scope it was built for.
    fn scope(&self) -> &RemoteScope;

    /// Leader: how many of `keys`, from the first, the store holds for every one of the scope's
    /// ranks (stops at the first key missing for any rank). An error (timeout, unreachable)
    /// is for the caller to count as a miss.
    fn lookup_prefix(&self, keys: &[u128], deadline: std::time::Instant) -> Result<usize>;

    /// Worker `rank`: reads each of `keys` into the matching buffer of `dst` (each exactly
    /// [`RemoteScope::bytes_per_block`] long), one pipelined batch. One outcome per key; an error
    /// means the whole batch failed (nothing in `dst` may be used).
    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: std::time::Instant,
    ) -> Result<Vec<RemoteRead>>;

    /// Worker `rank`: stores each `(key, bytes)` (bytes exactly `bytes_per_block` long) unless
    /// already present, one pipelined batch.
    fn put(
        &self,
        rank: usize,
        blocks: &[(u128, &[u8])],
        deadline: std::time::Instant,
    ) -> Result<RemotePut>;

    /// Its counters.
    fn stats(&self) -> RemoteStoreStats;
}
