//! What a worker builds on NIXL: one agent with the backends its configuration needs, the disk
//! tier through POSIX (`disk.io = nixl`) and its side of the remote (G4) tier through UCX
//! (`remote.dir` set): [`NixlWorkerRemote`], the core's [`WorkerRemote`] hooks, which export this
//! worker's host tier with block headers into the shared directory and connect to the peers' host
//! tiers it loads from.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use super::agent::NixlAgent;
use super::disk::NixlDiskTier;
use super::headers::BlockHeaders;
use super::probe::NixlBackend;
use super::remote::{RemoteTier, TierExport, VerifiedRemote, REMOTE_MAX_IN_FLIGHT};
use crate::backends::disk::DiskTierOptions;
use crate::config::Config;
use crate::connector::remote::{export_path, write_atomic, WorkerRemote};
use crate::error::{Error, ErrorKind, Result};
use crate::layout::LayoutDims;
use crate::tier::{StorageTier, TierKind};

/// A worker's NIXL tiers: the disk tier (when asked) and the remote-tier hooks (when
/// `remote.dir` is set).
pub type WorkerParts = (Option<Arc<dyn StorageTier>>, Option<Arc<dyn WorkerRemote>>);

/// The NIXL parts of a worker of `rank`: the disk tier through NIXL's POSIX backend (`disk`:
/// its block count and options) and the remote tier (`config.remote.dir` set), on one agent with
/// the host tier registered (the tiers keep the agent alive).
pub fn worker_parts(
    config: &Config,
    rank: usize,
    host: Option<&Arc<dyn StorageTier>>,
    dims: LayoutDims,
    disk: Option<(usize, DiskTierOptions)>,
) -> Result<WorkerParts> {
    let mut backends = Vec::new();
    if disk.is_some() {
        backends.push(NixlBackend::Posix);
    }
    if config.remote.enabled() {
        backends.push(NixlBackend::Ucx);
    }
    let agent = NixlAgent::new(None, &backends)?;
    let host_id = match host {
        Some(h) => Some((h.clone(), agent.register_host_tier(h.clone())?)),
        None => None,
    };
    let disk = match disk {
        Some((n, opts)) => {
            Some(
                Arc::new(NixlDiskTier::create(&agent, TierKind::Disk, dims, n, opts)?)
                    as Arc<dyn StorageTier>,
            )
        }
        None => None,
    };
    let remote = match &config.remote.dir {
        Some(dir) => Some(
            Arc::new(NixlWorkerRemote::new(dir.clone(), rank, agent, host_id)?)
                as Arc<dyn WorkerRemote>,
        ),
        None => None,
    };
    Ok((disk, remote))
}

/// A host tier, its block headers and its export (JSON).
type ExportedHost = (Arc<dyn StorageTier>, Arc<BlockHeaders>, Vec<u8>);

struct Peer {
    stamp: Option<(std::time::SystemTime, u64)>,
    bytes: Vec<u8>,
    tier: Arc<RemoteTier>,
}

/// The worker's side of the remote tier: its host tier exported with block headers, and the
/// peers' host tiers it connected to.
pub struct NixlWorkerRemote {
    dir: PathBuf,
    rank: usize,
    agent: NixlAgent,
    /// This worker's host tier, its headers and its export (when it has a host tier).
    host: Option<ExportedHost>,
    exported_as: Mutex<Option<String>>,
    peers: Mutex<HashMap<String, Peer>>,
}

impl std::fmt::Debug for NixlWorkerRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlWorkerRemote")
            .field("dir", &self.dir)
            .field("rank", &self.rank)
            .field("agent", &self.agent.name())
            .finish_non_exhaustive()
    }
}

impl NixlWorkerRemote {
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

impl WorkerRemote for NixlWorkerRemote {
    /// Writes this worker's export under `instance` (once per name).
    fn export_as(&self, instance: &str) -> Result<()> {
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
    fn invalidate(&self, blocks: &[usize]) {
        if let Some((_, headers, _)) = &self.host {
            for &b in blocks {
                if let Err(e) = headers.invalidate(b) {
                    tracing::warn!(block = b, error = %e, "cannot invalidate a block header");
                }
            }
        }
    }

    /// Publishes that host block `b` now holds `key` (after its write completed).
    fn publish(&self, blocks: &[(usize, u128)]) {
        if let Some((tier, headers, _)) = &self.host {
            for &(b, key) in blocks {
                if let Err(e) = headers.publish_from(tier.as_ref(), b, key) {
                    tracing::debug!(block = b, error = %e, "block header not published");
                }
            }
        }
    }

    /// The source tier of one remote load from `instance`: its host tier, each block read
    /// only if it holds the expected key.
    fn source(&self, instance: &str, keys: &[(usize, u128)]) -> Result<Arc<dyn StorageTier>> {
        let tier = self.peer(instance)?;
        Ok(Arc::new(VerifiedRemote::new(tier, keys.iter().copied())))
    }
}
