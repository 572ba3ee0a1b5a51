//! What a worker builds on NIXL: one agent with the POSIX backend and the disk tier through it
//! (`disk.io = nixl`), with the host tier registered (host ↔ disk copies need no bounce buffer).

use std::sync::Arc;

use super::agent::NixlAgent;
use super::disk::NixlDiskTier;
use super::probe::NixlBackend;
use crate::backends::disk::DiskTierOptions;
use crate::config::Config;
use crate::error::Result;
use crate::layout::LayoutDims;
use crate::tier::{StorageTier, TierKind};

/// A worker's NIXL disk tier (when asked).
pub type WorkerParts = Option<Arc<dyn StorageTier>>;

/// The NIXL parts of a worker of `rank`: the disk tier through NIXL's POSIX backend (`disk`:
/// its block count and options), on one agent with the host tier registered (the tier keeps the
/// agent alive).
pub fn worker_parts(
    config: &Config,
    rank: usize,
    host: Option<&Arc<dyn StorageTier>>,
    dims: LayoutDims,
    disk: Option<(usize, DiskTierOptions)>,
) -> Result<WorkerParts> {
    let _ = (config, rank);
    let Some((n, opts)) = disk else {
        return Ok(None);
    };
    let agent = NixlAgent::new(None, &[NixlBackend::Posix])?;
    if let Some(h) = host {
        agent.register_host_tier(h.clone())?;
    }
    Ok(Some(
        Arc::new(NixlDiskTier::create(&agent, TierKind::Disk, dims, n, opts)?)
            as Arc<dyn StorageTier>,
    ))
}
