//! The standard [`TierFactory`]: how a worker's host, disk and remote tiers are built from the
//! configuration when nothing else is asked for (what the engine adapters, the tool and the
//! bindings hand to the worker).
//!
//! * host (G2): pinned memory on the device tier's GPU when the device tier is a CUDA tier
//!   (feature `cuda`; device ↔ host copies are then DMA), page-aligned [`MemoryTier`] otherwise;
//! * disk (G3): the built-in [`DiskTier`] (`disk.io = builtin`) or the NIXL disk tier
//!   (`disk.io = nixl`, feature `nixl`);
//! * remote (G4): the shared store `remote.url` names ([`TierFactory::remote_store`]).
//!
//! A setting this build cannot serve (`disk.io = nixl` without the `nixl` feature, `remote.url`
//! without a store backend) is an [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported)
//! error at start-up naming the variable that set it.

use std::sync::Arc;

use super::disk::{DiskTier, DiskTierOptions};
use super::memory::MemoryTier;
use crate::config::{Config, DiskIo};
use crate::connector::remote::{RemoteScope, RemoteStore};
use crate::connector::transport::TierCounts;
use crate::connector::worker::{TierFactory, WorkerTiers};
use crate::error::Result;
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::page_store::{PageStore, PageStoreOptions, PageStoreTiers};
use crate::tier::{StorageTier, TierKind};

/// The standard [`TierFactory`]; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StandardTiers;

impl StandardTiers {
    /// The standard factory, as the worker takes it.
    pub fn shared() -> Arc<dyn TierFactory> {
        Arc::new(Self)
    }
}

impl TierFactory for StandardTiers {
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> Result<WorkerTiers> {
        let dims = *device.layout().dims();
        let host: Option<Arc<dyn StorageTier>> = if counts.num_host_blocks > 0 {
            let layout = Layout::fully_contiguous(dims, counts.num_host_blocks)?;
            Some(host_tier(device.as_ref(), layout)?)
        } else {
            None
        };
        let opts = DiskTierOptions {
            dir: config.disk.dir.clone(),
            direct_io: config.disk.direct_io,
            persist: config.disk.persist,
            max_in_flight: config.disk.max_in_flight,
            ..DiskTierOptions::new("")
        };
        let nixl_disk = counts.num_disk_blocks > 0 && config.disk.io == DiskIo::Nixl;
        let mut disk = if nixl_disk {
            nixl_disk_tier(
                config,
                rank,
                host.as_ref(),
                dims,
                counts.num_disk_blocks,
                opts.clone(),
            )?
        } else {
            None
        };
        let mut disk_index = Vec::new();
        if disk.is_none() && counts.num_disk_blocks > 0 {
            if config.disk.persist {
                // Reopened with what it held (same namespace, rank, block shape and count),
                // unless the deployment's cache was reset since it was saved.
                let identity = worker_disk_identity(config, rank, &dims)?;
                let opts = DiskTierOptions {
                    reset_marker: reset_marker_path(config),
                    ..opts
                };
                let (tier, index) = DiskTier::open_persistent(
                    TierKind::Disk,
                    dims,
                    counts.num_disk_blocks,
                    opts,
                    &identity,
                )?;
                disk_index = index;
                disk = Some(Arc::new(tier));
            } else {
                disk = Some(Arc::new(DiskTier::create(
                    TierKind::Disk,
                    dims,
                    counts.num_disk_blocks,
                    opts,
                )?));
            }
        }
        Ok(WorkerTiers {
            device,
            host,
            disk,
            counts,
            remote: None,
            disk_index,
        })
    }

    /// The shared store `remote.url` names, by its scheme ([`super::remote`]): `memory://`, or
    /// Redis / Valkey (feature `redis`). A server that is down is not an error here (the store
    /// starts unavailable and reconnects in the background); a bad URL, a scheme this build
    /// cannot serve or refused credentials are.
    fn remote_store(
        &self,
        config: &Config,
        scope: &RemoteScope,
    ) -> Result<Option<Arc<dyn RemoteStore>>> {
        super::remote::connect(config, scope)
    }
}

/// What a worker's persisted disk file holds (`disk.persist`): the deployment's namespace
/// (`remote.namespace`, which must then be set: it names the model, so a restarted engine
/// serving another model with the same block shape never reads these blocks), the key hash,
/// the rank and the block shape.
///
/// Errors: `disk.persist` without `remote.namespace` (invalid config, naming both).
pub fn worker_disk_identity(config: &Config, rank: usize, dims: &LayoutDims) -> Result<String> {
    let Some(deployment) = deployment_identity(config) else {
        return Err(crate::error::Error::invalid_config(
            "remote.namespace",
            "unset",
            "disk.persist (KVBM_DISK_PERSIST) needs a namespace naming the model \
             (KVBM_REMOTE_NAMESPACE), so a restarted engine never reads another model's blocks",
        ));
    };
    Ok(format!(
        "{deployment};rank={rank};layers={};outer={};page={};inner={};dtype={}",
        dims.num_layers, dims.outer_dim, dims.page_size, dims.inner_dim, dims.dtype_bytes
    ))
}

/// The reset marker of a deployment's persisted worker disk tiers (`disk.persist` with the
/// built-in disk I/O and `remote.namespace`): `<disk.dir>/kvbm-resets-<hash of the namespace
/// and key hash>`, counting the cache resets ([`record_cache_reset`]) every rank's tier honours
/// (see `DiskTierOptions::reset_marker`). `None` when the tiers are not reopened.
pub fn reset_marker_path(config: &Config) -> Option<std::path::PathBuf> {
    if !config.disk.reopens() {
        return None;
    }
    let h = xxhash_rust::xxh3::xxh3_64(deployment_identity(config)?.as_bytes());
    Some(config.disk.dir.join(format!("kvbm-resets-{h:016x}")))
}

/// What every rank's persisted disk file of a deployment shares in its identity: the
/// namespace (`None` when unset) and the key hash.
fn deployment_identity(config: &Config) -> Option<String> {
    let ns = config
        .remote
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())?;
    Some(format!(
        "kvbm-worker-disk-v1;ns={ns:?};hash={:?}",
        config.hash
    ))
}

/// Records a cache reset (vLLM's `reset_cache`) in the reset marker at `marker`
/// ([`reset_marker_path`]), durably, before it returns: a worker that reopens its tier after this
/// never serves what it held before, and a running worker forgets it at its next index save.
/// Returns the new reset count.
///
/// Errors: the marker's directory cannot be used, or the marker cannot be read or written
/// ([`ErrorKind::Io`](crate::ErrorKind::Io) or [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt),
/// naming its path).
pub fn record_cache_reset(marker: &std::path::Path) -> Result<u64> {
    if let Some(dir) = marker.parent() {
        crate::backends::slot_file::prepare_dir(dir)?;
    }
    super::persist::bump_reset_marker(marker)
}

/// A [`PageStore`] of `page_bytes`-byte pages named within `namespace`, over the tiers the
/// configuration sizes (in pages: `host.cache_gb` / `host.cache_blocks`, `disk.*`, with the
/// same default as an engine's connector) and the shared store `remote.url` names, whose scope
/// is the namespace and `remote.namespace`. What SGLang's storage backend is built on.
///
/// Errors: a size that cannot be allocated or a disk directory that cannot be used (as for
/// the worker's tiers); a bad remote URL; every tier sized 0 and no remote store.
pub fn page_store(config: &Config, namespace: &str, page_bytes: usize) -> Result<PageStore> {
    let dims = LayoutDims {
        num_layers: 1,
        outer_dim: 1,
        page_size: 1,
        inner_dim: page_bytes,
        dtype_bytes: 1,
    };
    dims.validate()?;
    let (host_pages, disk_pages) = config.block_counts(page_bytes)?;
    let host: Option<Arc<dyn StorageTier>> = if host_pages > 0 {
        Some(Arc::new(MemoryTier::host(Layout::fully_contiguous(
            dims, host_pages,
        )?)?))
    } else {
        None
    };
    let mut disk_index = Vec::new();
    let disk: Option<Arc<dyn StorageTier>> = if disk_pages > 0 {
        let opts = DiskTierOptions {
            dir: config.disk.dir.clone(),
            direct_io: config.disk.direct_io,
            persist: config.disk.persist,
            max_in_flight: config.disk.max_in_flight,
            ..DiskTierOptions::new("")
        };
        if config.disk.persist {
            // The pages outlive the process: reopened when the namespace, the page size and
            // the page count match (else refused, naming what differs).
            let (tier, index) =
                DiskTier::open_persistent(TierKind::Disk, dims, disk_pages, opts, namespace)?;
            disk_index = index;
            Some(Arc::new(tier))
        } else {
            Some(Arc::new(DiskTier::create(
                TierKind::Disk,
                dims,
                disk_pages,
                opts,
            )?))
        }
    } else {
        None
    };
    let description = format!(
        "kvbm-page-v1;ns={:?};pages={namespace:?}",
        config.remote.namespace.as_deref().unwrap_or("")
    );
    let scope = RemoteScope::new(&description, 1, 1, page_bytes, config.hash)?;
    let remote = super::remote::connect(config, &scope)?;
    PageStore::new(
        namespace,
        page_bytes,
        PageStoreTiers {
            host,
            disk,
            remote,
            disk_index,
        },
        PageStoreOptions {
            eviction: config.eviction,
            lookup_timeout: config.remote.lookup_timeout(),
            io_timeout: config.remote.io_timeout(),
            slow: config.remote.slow(),
            backoff: config.remote.backoff(),
            disk_min_frequency: config.disk.min_frequency,
            remote_min_frequency: config.remote.min_frequency(),
            io_threads: config.transfer.max_concurrency,
        },
    )
}

/// The host (G2) tier: pinned memory on the device tier's GPU when the device tier is a CUDA
/// tier (so device ↔ host copies are DMA), plain aligned memory otherwise.
fn host_tier(device: &dyn StorageTier, layout: Layout) -> Result<Arc<dyn StorageTier>> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = super::cuda::device_of(device) {
        return Ok(Arc::new(super::cuda::PinnedHostTier::host(&gpu, layout)?));
    }
    let _ = device;
    Ok(Arc::new(MemoryTier::host(layout)?))
}

/// The NIXL disk tier (see `nixl::worker_parts`); without the `nixl` feature, an
/// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) error naming the setting that asked
/// for NIXL.
fn nixl_disk_tier(
    config: &Config,
    rank: usize,
    host: Option<&Arc<dyn StorageTier>>,
    dims: LayoutDims,
    blocks: usize,
    opts: DiskTierOptions,
) -> Result<Option<Arc<dyn StorageTier>>> {
    #[cfg(feature = "nixl")]
    return super::nixl::worker_parts(config, rank, host, dims, Some((blocks, opts)));
    #[cfg(not(feature = "nixl"))]
    {
        let _ = (config, rank, host, dims, blocks, opts);
        Err(crate::error::Error::unsupported(
            "disk.io = nixl (KVBM_DISK_IO) needs kvbm-connector built with the `nixl` feature",
        ))
    }
}

#[cfg(all(test, not(feature = "nixl")))]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::layout::BlockOrder;

    #[test]
    fn nixl_disk_without_nixl_is_unsupported_at_start() {
        let dims = LayoutDims {
            num_layers: 1,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        };
        let device: Arc<dyn StorageTier> = Arc::new(
            MemoryTier::new(
                TierKind::Device,
                Layout::layer_separate(dims, 4, BlockOrder::OuterMajor).unwrap(),
            )
            .unwrap(),
        );
        let mut config = Config::default();
        config.disk.io = DiskIo::Nixl;
        let counts = TierCounts {
            num_host_blocks: 2,
            num_disk_blocks: 2,
            num_device_blocks: 4,
        };
        let e = StandardTiers.build(&config, 0, device, counts).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("KVBM_DISK_IO"), "{e}");
    }
}
