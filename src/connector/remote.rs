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
