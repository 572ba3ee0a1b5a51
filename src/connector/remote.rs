//! The remote (G4) tier's discovery: instances sharing a directory (`remote.dir`) publish what
//! their host tier holds and how to reach it, and onboard each other's blocks over UCX.
//!
//! Files in the directory (each written to a temporary name, then renamed):
//! * `<instance>.index.json` ([`HostIndex`]), by the leader every `remote.publish_every`
//!   iterations: the keys of its registered host blocks and where they are;
//! * `<instance>.rank<r>.export.json`, by each worker: its host tier's
//!   `TierExport` (`backends::nixl`, feature `nixl`: NIXL agent metadata, addresses, block
//!   headers).
//!
//! The index may be stale at any time; correctness never depends on it: every remote block is
//! read verified (`backends::nixl::VerifiedRemote`: the exporter's header must name the expected
//! key and the bytes must hash to its checksum), so a stale entry costs a load error (the engine
//! recomputes), never wrong bytes. See docs/nixl.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::RemoteConfig;
use crate::error::{Error, Result};
use crate::identity::{HashAlgorithm, SequenceHash};

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
    /// `(key, host block)` of every registered host block.
    pub blocks: Vec<(u64, usize)>,
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
            if peer.instance == self.instance || !compatible(&peer) {
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

#[cfg(feature = "nixl")]
pub use with_nixl::WorkerRemote;
#[cfg(not(feature = "nixl"))]
pub use without_nixl::WorkerRemote;

#[cfg(not(feature = "nixl"))]
mod without_nixl {
    /// The worker's remote tier: needs the `nixl` feature (never constructed without it).
    #[derive(Debug)]
    pub enum WorkerRemote {}
}

#[cfg(feature = "nixl")]
mod with_nixl {
    use super::*;
    use crate::backends::nixl::{
        BlockHeaders, NixlAgent, RemoteTier, TierExport, VerifiedRemote, REMOTE_MAX_IN_FLIGHT,
    };
    use crate::error::ErrorKind;
    use crate::tier::StorageTier;
    use parking_lot::Mutex;

    /// A host tier, its block headers and its export (JSON).
    type ExportedHost = (Arc<dyn StorageTier>, Arc<BlockHeaders>, Vec<u8>);

    struct Peer {
        stamp: Option<(std::time::SystemTime, u64)>,
        bytes: Vec<u8>,
        tier: Arc<RemoteTier>,
    }

    /// The worker's side of the remote tier: its host tier exported with block headers, and the
    /// peers' host tiers it connected to.
    pub struct WorkerRemote {
        dir: PathBuf,
        rank: usize,
        agent: NixlAgent,
        /// This worker's host tier, its headers and its export (when it has a host tier).
        host: Option<ExportedHost>,
        exported_as: Mutex<Option<String>>,
        peers: Mutex<HashMap<String, Peer>>,
    }

    impl std::fmt::Debug for WorkerRemote {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("WorkerRemote")
                .field("dir", &self.dir)
                .field("rank", &self.rank)
                .field("agent", &self.agent.name())
                .finish_non_exhaustive()
        }
    }

    impl WorkerRemote {
        /// `agent` (with UCX) has `host` registered as tier `host_id`; registers its headers.
        pub fn new(
            dir: PathBuf,
            rank: usize,
            agent: NixlAgent,
            host: Option<(Arc<dyn StorageTier>, usize)>,
        ) -> Result<Self> {
            let host = match host {
                Some((tier, id)) => {
                    let headers = agent.register_block_headers(id)?;
                    let export = agent.export_tier(id)?.to_bytes()?;
                    Some((tier, headers, export))
                }
                None => None,
            };
            Ok(Self {
                dir,
                rank,
                agent,
                host,
                exported_as: Mutex::new(None),
                peers: Mutex::new(HashMap::new()),
            })
        }

        /// Writes this worker's export under `instance` (once per name).
        pub fn export_as(&self, instance: &str) -> Result<()> {
            let Some((_, _, export)) = &self.host else {
                return Ok(());
            };
            let mut done = self.exported_as.lock();
            if done.as_deref() == Some(instance) {
                return Ok(());
            }
            write_atomic(&export_path(&self.dir, instance, self.rank), export)?;
            *done = Some(instance.to_owned());
            Ok(())
        }

        /// Marks host blocks as holding nothing verifiable: call before writing them.
        pub fn invalidate(&self, blocks: impl IntoIterator<Item = usize>) {
            if let Some((_, headers, _)) = &self.host {
                for b in blocks {
                    if let Err(e) = headers.invalidate(b) {
                        tracing::warn!(block = b, error = %e, "cannot invalidate a block header");
                    }
                }
            }
        }

        /// Publishes that host block `b` now holds `key` (after its write completed).
        pub fn publish(&self, blocks: impl IntoIterator<Item = (usize, u64)>) {
            if let Some((tier, headers, _)) = &self.host {
                for (b, key) in blocks {
                    if let Err(e) = headers.publish_from(tier.as_ref(), b, key) {
                        tracing::debug!(block = b, error = %e, "block header not published");
                    }
                }
            }
        }

        /// The source tier of one remote load from `instance`: its host tier, each block read
        /// only if it holds the expected key.
        pub fn source(
            &self,
            instance: &str,
            keys: impl IntoIterator<Item = (usize, u64)>,
        ) -> Result<Arc<dyn StorageTier>> {
            let tier = self.peer(instance)?;
            Ok(Arc::new(VerifiedRemote::new(tier, keys)))
        }

        fn peer(&self, instance: &str) -> Result<Arc<RemoteTier>> {
            let path = export_path(&self.dir, instance, self.rank);
            let stamp = std::fs::metadata(&path)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())));
            let mut peers = self.peers.lock();
            if let Some(p) = peers.get(instance) {
                if stamp.is_some() && p.stamp == stamp {
                    return Ok(p.tier.clone());
                }
            }
            let bytes = std::fs::read(&path).map_err(|e| {
                Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "no tier export of instance {instance} for rank {}: {e}",
                        self.rank
                    ),
                )
                .with("path", path.display())
            })?;
            if let Some(p) = peers.get_mut(instance) {
                if p.bytes == bytes {
                    p.stamp = stamp;
                    return Ok(p.tier.clone());
                }
            }
            let export = TierExport::from_bytes(&bytes)?;
            let tier = Arc::new(RemoteTier::connect(
                &self.agent,
                &export,
                REMOTE_MAX_IN_FLIGHT,
            )?);
            if !tier.has_headers() {
                return Err(Error::unsupported(format!(
                    "instance {instance} exports its host tier without block headers"
                )));
            }
            peers.insert(
                instance.to_owned(),
                Peer {
                    stamp,
                    bytes,
                    tier: tier.clone(),
                },
            );
            Ok(tier)
        }
    }
}
