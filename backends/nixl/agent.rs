//! The NIXL agent a worker holds ([`NixlAgent`]): its backends, its registered host tiers (kept
//! alive while registered) and block header arrays, one blocking transfer call, and the small pool
//! of registered bounce buffers the tiers use for unregistered caller buffers.
//!
//! Invariants: registered memory outlives its registration (the agent keeps every registered tier
//! alive and deregisters before releasing it; a bounce buffer is deregistered before it is freed);
//! a transfer returns only when NIXL reports it complete or failed.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferStatus,
};
use parking_lot::{Condvar, Mutex, RwLock};

use super::probe::{probe, NixlBackend, NixlInfo};
use super::ucx::prepare_ucx;
use crate::backends::disk::DISK_ALIGNMENT;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::StorageTier;

/// How often a transfer still running is logged.
pub const SLOW_TRANSFER_LOG: Duration = Duration::from_secs(10);

/// The configuration of every agent this backend creates.
pub(super) fn agent_config() -> AgentConfig {
    AgentConfig {
        // Calls come from the transfer engine's blocking threads at once.
        thread_sync: ThreadSync::Rw,
        ..AgentConfig::default()
    }
}

/// A NIXL call failed: [`ErrorKind::Io`] naming what was being done.
pub(super) fn nixl_error(what: &str, e: NixlError) -> Error {
    Error::new(ErrorKind::Io, format!("NIXL failed to {what}: {e}")).with("op", what)
}

/// A memory or file range handed to NIXL for registration.
#[derive(Debug)]
pub(super) struct RawRegion {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) mem: MemType,
    pub(super) dev: u64,
}

impl MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        // Only the address is passed to NIXL (file regions use it as an offset); nothing here
        // dereferences it.
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        self.mem
    }

    fn device_id(&self) -> u64 {
        self.dev
    }
}

/// One registered host tier: its memory, kept alive by the agent.
struct HostRegistration {
    /// Deregistered (dropped) before `tier`.
    #[expect(dead_code, reason = "held for its Drop: deregistration")]
    handles: Vec<RegistrationHandle>,
    /// Address ranges `[start, end)` of the tier's allocations.
    ranges: Vec<(usize, usize)>,
    #[expect(dead_code, reason = "held to keep the registered memory alive")]
    tier: Arc<dyn StorageTier>,
}

pub(super) struct AgentShared {
    name: String,
    info: NixlInfo,
    /// Dropped first: deregisters before the agent goes and before the tiers are freed.
    hosts: RwLock<Vec<HostRegistration>>,
    backends: Vec<(NixlBackend, Backend)>,
    pub(super) agent: Agent,
}

/// One NIXL agent: what a worker holds. Cheap to clone (shared).
///
/// Created with the backends it will use; host tiers registered with
/// [`register_host_tier`](Self::register_host_tier) are registered with all of them.
#[derive(Clone)]
pub struct NixlAgent {
    pub(super) inner: Arc<AgentShared>,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.inner.name)
            .field(
                "backends",
                &self
                    .inner
                    .backends
                    .iter()
                    .map(|(b, _)| *b)
                    .collect::<Vec<_>>(),
            )
            .field("host_tiers", &self.inner.hosts.read().len())
            .finish_non_exhaustive()
    }
}

/// Distinguishes the agents of one process.
static NEXT_AGENT: AtomicU64 = AtomicU64::new(0);

impl NixlAgent {
    /// Creates an agent named `name` (default `kvbm-<pid>-<n>`; names must be unique among the
    /// agents that exchange metadata) with `backends` created.
    ///
    /// NIXL loads a backend's plugin when the first backend of it is created: an agent with only
    /// [`NixlBackend::Posix`] loads no UCX. Before the first [`NixlBackend::Ucx`] backend, UCX's
    /// InfiniBand modules are kept out of the process unless the user configured RDMA (sets
    /// [`UCX_MODULES_ENV`](super::UCX_MODULES_ENV); see docs/nixl.md, "RDMA hosts").
    ///
    /// Errors: NIXL unavailable or a backend's plugin missing (see [`probe`],
    /// [`NixlInfo::require`]); NIXL refusing the agent or a backend ([`ErrorKind::Io`]).
    pub fn new(name: Option<&str>, backends: &[NixlBackend]) -> Result<Self> {
        let info = probe()?;
        for b in backends {
            info.require(*b)?;
        }
        let name = match name {
            Some(n) => n.to_owned(),
            None => format!(
                "kvbm-{}-{}",
                std::process::id(),
                NEXT_AGENT.fetch_add(1, Ordering::Relaxed)
            ),
        };
        let agent = Agent::new_configured(&name, &agent_config())
            .map_err(|e| nixl_error("create an agent", e).with("agent", &name))?;
        let mut created = Vec::new();
        for &b in backends {
            if created.iter().any(|(x, _)| *x == b) {
                continue;
            }
            if b == NixlBackend::Ucx {
                // Before the UCX plugin is loaded (its first backend loads it): which UCX
                // modules it may load, so that no RDMA library of the system is mixed in.
                prepare_ucx();
            }
            let (_mems, params) = agent.get_plugin_params(b.plugin()).map_err(|e| {
                nixl_error("read plugin parameters", e)
                    .with("backend", b)
                    .with("agent", &name)
            })?;
            let backend = agent.create_backend(b.plugin(), &params).map_err(|e| {
                nixl_error("create a backend", e)
                    .with("backend", b)
                    .with("agent", &name)
            })?;
            created.push((b, backend));
        }
        tracing::debug!(agent = %name, ?backends, "NIXL agent created");
        Ok(Self {
            inner: Arc::new(AgentShared {
                name,
                info,
                hosts: RwLock::new(Vec::new()),
                backends: created,
                agent,
            }),
        })
    }

    /// The agent's name (what remote agents address it by).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// What [`probe`] found.
    pub fn info(&self) -> &NixlInfo {
        &self.inner.info
    }

    /// Whether the agent has `backend`.
    pub fn has_backend(&self, backend: NixlBackend) -> bool {
        self.inner.backends.iter().any(|(b, _)| *b == backend)
    }

    pub(super) fn require_backend(&self, backend: NixlBackend) -> Result<()> {
        if self.has_backend(backend) {
            Ok(())
        } else {
            Err(Error::invalid_argument(format!(
                "NIXL agent {} was created without the {backend} backend",
                self.name()
            ))
            .with("agent", self.name()))
        }
    }

    /// Optional arguments selecting `backend`.
    fn opt_args(&self, backend: NixlBackend) -> Result<OptArgs> {
        let b = self
            .inner
            .backends
            .iter()
            .find(|(x, _)| *x == backend)
            .map(|(_, b)| b)
            .ok_or_else(|| {
                Error::internal(format!("agent {} has no {backend} backend", self.name()))
            })?;
        let mut args = OptArgs::new().map_err(|e| nixl_error("create arguments", e))?;
        args.add_backend(b)
            .map_err(|e| nixl_error("select a backend", e).with("backend", backend))?;
        Ok(args)
    }

    /// Registers one range with `backend` (or every backend of the agent when `None`).
    pub(super) fn register(
        &self,
        region: &RawRegion,
        backend: Option<NixlBackend>,
    ) -> Result<RegistrationHandle> {
        let args = backend.map(|b| self.opt_args(b)).transpose()?;
        self.inner
            .agent
            .register_memory(region, args.as_ref())
            .map_err(|e| {
                nixl_error("register memory", e)
                    .with("agent", self.name())
                    .with("mem_type", format!("{:?}", region.mem))
                    .with("len", region.len)
            })
    }

    /// Registers the memory of a host-addressable tier (its allocations, whole) with every
    /// backend of the agent, and keeps the tier alive as long as the agent. Returns the tier's
    /// id.
    ///
    /// Blocks of a registered tier lent to a NIXL tier ([`StorageTier::with_block`], as the
    /// transfer engine does) are transferred with no bounce buffer.
    pub fn register_host_tier(&self, tier: Arc<dyn StorageTier>) -> Result<usize> {
        if !tier.capability().host_addressable {
            return Err(Error::invalid_argument(format!(
                "only host-addressable tiers can be registered with NIXL, not the {} tier",
                tier.kind()
            ))
            .with("tier", tier.kind()));
        }
        let layout = *tier.layout();
        let bases = allocation_bases(tier.as_ref(), &layout)?;
        let len = layout.allocation_bytes();
        let mut handles = Vec::with_capacity(bases.len());
        let mut ranges = Vec::with_capacity(bases.len());
        for &base in &bases {
            let addr = usize::try_from(base).map_err(|_| Error::internal("address overflow"))?;
            handles.push(
                self.register(
                    &RawRegion {
                        addr,
                        len,
                        mem: MemType::Dram,
                        dev: 0,
                    },
                    None,
                )
                .map_err(|e| e.with("tier", tier.kind()))?,
            );
            ranges.push((addr, addr + len));
        }
        let mut hosts = self.inner.hosts.write();
        hosts.push(HostRegistration {
            handles,
            ranges,
            tier,
        });
        Ok(hosts.len() - 1)
    }

    /// Whether every non-empty segment lies inside one registered host tier allocation.
    pub(super) fn all_registered<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        let hosts = self.inner.hosts.read();
        segments.iter().all(|s| {
            let (a, n) = (s.as_ptr() as usize, s.len());
            n == 0
                || hosts
                    .iter()
                    .flat_map(|h| h.ranges.iter())
                    .any(|&(lo, hi)| a >= lo && a + n <= hi)
        })
    }

    /// Runs one transfer of `pairs` (`(local address, remote address, len)`) between local
    /// registered DRAM and `remote_agent`'s memory of type `remote_mem` (device id `remote_dev`,
    /// the file descriptor for files), and waits for it.
    pub(super) fn transfer(
        &self,
        op: XferOp,
        backend: NixlBackend,
        remote_agent: &str,
        remote_mem: MemType,
        remote_dev: u64,
        pairs: &[(usize, usize, usize)],
    ) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let what = match op {
            XferOp::Read => "read",
            XferOp::Write => "write",
        };
        let ctx = |e: Error| {
            e.with("backend", backend)
                .with("agent", self.name())
                .with("remote_agent", remote_agent)
        };
        let mut local = XferDescList::new(MemType::Dram)
            .map_err(|e| ctx(nixl_error("create a descriptor list", e)))?;
        let mut remote = XferDescList::new(remote_mem)
            .map_err(|e| ctx(nixl_error("create a descriptor list", e)))?;
        for &(l, r, n) in pairs {
            local.add_desc(l, n, 0);
            remote.add_desc(r, n, remote_dev);
        }
        let args = self.opt_args(backend)?;
        let agent = &self.inner.agent;
        let req = agent
            .create_xfer_req(op, &local, &remote, remote_agent, Some(&args))
            .map_err(|e| ctx(nixl_error(&format!("prepare a {what}"), e)))?;
        let in_progress = agent
            .post_xfer_req(&req, Some(&args))
            .map_err(|e| ctx(nixl_error(&format!("post a {what}"), e)))?;
        if !in_progress {
            return Ok(());
        }
        let start = Instant::now();
        let mut next_log = SLOW_TRANSFER_LOG;
        let mut polls = 0u32;
        loop {
            match agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) => {}
                Err(e) => return Err(ctx(nixl_error(&format!("complete a {what}"), e))),
            }
            polls = polls.saturating_add(1);
            if polls < 64 {
                std::hint::spin_loop();
            } else if polls < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
            if start.elapsed() >= next_log {
                tracing::warn!(
                    agent = %self.name(),
                    %remote_agent,
                    %backend,
                    elapsed = ?start.elapsed(),
                    "NIXL transfer still running"
                );
                next_log += SLOW_TRANSFER_LOG;
            }
        }
    }
}

/// Base address of each allocation of a host-addressable tier, from the runs it lends for block
/// 0 (every allocation holds part of every block).
fn allocation_bases(tier: &dyn StorageTier, layout: &Layout) -> Result<Vec<u64>> {
    let mut bases: Vec<Option<u64>> = vec![None; layout.num_allocations()];
    let regions: Vec<_> = layout.regions(0)?.collect();
    tier.with_block(0, &mut |runs| {
        if runs.len() != regions.len() {
            return Err(Error::internal(format!(
                "tier lent {} runs for block 0, its layout has {}",
                runs.len(),
                regions.len()
            )));
        }
        for (run, r) in runs.iter().zip(&regions) {
            let base = (run.as_ptr() as usize)
                .checked_sub(r.offset)
                .ok_or_else(|| Error::internal("run lies before its allocation"))?;
            let slot = bases
                .get_mut(r.allocation)
                .ok_or_else(|| Error::internal("region names a missing allocation"))?;
            *slot = Some(base as u64);
        }
        Ok(())
    })?;
    bases
        .into_iter()
        .map(|b| b.ok_or_else(|| Error::internal("an allocation holds no run of block 0")))
        .collect()
}

/// Cuts two run lists describing the same number of bytes at the union of their boundaries:
/// `(local address, remote address, len)` triples, as NIXL wants descriptor lists that pair up.
pub(super) fn pair_runs(
    local: &[(usize, usize)],
    remote: &[(usize, usize)],
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::with_capacity(local.len().max(remote.len()));
    let (mut li, mut lo, mut ri, mut ro) = (0usize, 0usize, 0usize, 0usize);
    while li < local.len() && ri < remote.len() {
        let (la, ll) = local[li];
        let (ra, rl) = remote[ri];
        if ll == lo {
            li += 1;
            lo = 0;
            continue;
        }
        if rl == ro {
            ri += 1;
            ro = 0;
            continue;
        }
        let n = (ll - lo).min(rl - ro);
        out.push((la + lo, ra + ro, n));
        lo += n;
        ro += n;
    }
    out
}

pub(super) fn runs_of<T: Deref<Target = [u8]>>(segments: &[T]) -> Vec<(usize, usize)> {
    segments
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| (s.as_ptr() as usize, s.len()))
        .collect()
}

// ------------------------------------------------------------------------------------------------
// Registered bounce buffers
// ------------------------------------------------------------------------------------------------

/// A zeroed, page-aligned allocation registered with one backend of an agent.
pub(super) struct RegisteredBuf {
    /// Deregistered (dropped) before the memory is freed.
    handle: Option<RegistrationHandle>,
    ptr: NonNull<u8>,
    layout: AllocLayout,
}

// SAFETY: the buffer is owned memory handed out only through `&mut self` (one holder at a time,
// via the pool); the registration handle is Send + Sync.
unsafe impl Send for RegisteredBuf {}
// SAFETY: see above; `&self` gives only shared reads.
unsafe impl Sync for RegisteredBuf {}

impl RegisteredBuf {
    pub(super) fn new(agent: &NixlAgent, backend: NixlBackend, len: usize) -> Result<Self> {
        let layout = AllocLayout::from_size_align(len.max(1), DISK_ALIGNMENT)
            .map_err(|e| Error::invalid_argument(format!("bounce buffer of {len} bytes: {e}")))?;
        // SAFETY: non-zero size, valid alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| Error::no_space("bytes of bounce buffer", len, 0, len))?;
        let mut buf = Self {
            handle: None,
            ptr,
            layout,
        };
        buf.handle = Some(agent.register(
            &RawRegion {
                addr: ptr.as_ptr() as usize,
                len: layout.size(),
                mem: MemType::Dram,
                dev: 0,
            },
            Some(backend),
        )?);
        Ok(buf)
    }

    pub(super) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(super) fn as_slice(&self, len: usize) -> &[u8] {
        // SAFETY: the allocation is `layout.size()` bytes, initialised (zeroed); `len` is capped.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len.min(self.layout.size())) }
    }

    pub(super) fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len.min(self.layout.size())) }
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        drop(self.handle.take());
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A fixed set of registered buffers; callers wait when all are out.
pub(super) struct BouncePool {
    free: Mutex<Vec<RegisteredBuf>>,
    returned: Condvar,
    pub(super) count: usize,
}

impl BouncePool {
    pub(super) fn new(
        agent: &NixlAgent,
        backend: NixlBackend,
        count: usize,
        len: usize,
    ) -> Result<Self> {
        let free = (0..count)
            .map(|_| RegisteredBuf::new(agent, backend, len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            free: Mutex::new(free),
            returned: Condvar::new(),
            count,
        })
    }

    pub(super) fn take(&self) -> BounceGuard<'_> {
        let mut free = self.free.lock();
        loop {
            if let Some(buf) = free.pop() {
                return BounceGuard {
                    pool: self,
                    buf: Some(buf),
                };
            }
            self.returned.wait(&mut free);
        }
    }
}

pub(super) struct BounceGuard<'a> {
    pool: &'a BouncePool,
    buf: Option<RegisteredBuf>,
}

impl BounceGuard<'_> {
    pub(super) fn buf(&mut self) -> Result<&mut RegisteredBuf> {
        self.buf
            .as_mut()
            .ok_or_else(|| Error::internal("bounce buffer already returned"))
    }
}

impl Drop for BounceGuard<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.free.lock().push(buf);
            self.pool.returned.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_runs_cuts_at_both_boundaries() {
        let local = [(1000, 3), (2000, 0), (3000, 5)];
        let remote = [(10, 4), (50, 4)];
        assert_eq!(
            pair_runs(&local, &remote),
            vec![(1000, 10, 3), (3000, 13, 1), (3001, 50, 4)]
        );
    }

    #[test]
    fn pair_runs_single_file_run() {
        let local = [(100, 4096), (9000, 4096)];
        assert_eq!(
            pair_runs(&local, &[(8192, 8192)]),
            vec![(100, 8192, 4096), (9000, 12288, 4096)]
        );
    }
}
