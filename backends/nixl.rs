//! The `nixl` backend (feature `nixl`): block I/O through NVIDIA's NIXL transfer library.
//!
//! NIXL moves bytes between registered memory and storage through plugins. This module uses two:
//!
//! * **POSIX** for the disk tier: [`NixlDiskTier`] stores blocks in the same file, slot layout and
//!   per-block xxh3-64 checksums as the built-in [`DiskTier`] (it owns one, for the file's
//!   creation, preallocation, O_DIRECT probe and removal), but its reads and writes are NIXL
//!   transfers between registered host memory and the registered file;
//! * **UCX** between processes: a worker exports a host tier ([`NixlAgent::export_tier`] →
//!   [`TierExport`]: the agent's metadata, the tier's layout and allocation addresses), another
//!   worker imports it as a [`RemoteTier`] (G4, [`TierKind::Remote`]) whose reads and writes are
//!   one-sided UCX transfers into and out of the exporter's memory.
//!
//! Each worker holds one [`NixlAgent`], with its host tiers registered
//! ([`NixlAgent::register_host_tier`]): buffers inside registered memory go to NIXL as they are;
//! any other buffer goes through a small pool of registered bounce buffers.
//!
//! # Loading
//!
//! nixl-sys is built with its `stub-api` feature: it has no link-time dependency on NIXL and
//! `dlopen`s `libnixl_capi.so` at its first call, **aborting the process** when that fails. So
//! nothing here calls nixl-sys before [`probe`] has loaded the library itself, checked that it has
//! the C API symbols nixl-sys calls, and found the plugin folder; a missing or broken installation
//! is an [`ErrorKind::Unsupported`] error naming the library, the folders searched and the
//! variables read, never an abort. Where NIXL is looked for:
//!
//! * the library: `$KVBM_NIXL_LIB_DIR/libnixl_capi.so` when [`LIB_DIR_ENV`] is set, otherwise
//!   `libnixl_capi.so` by name through the dynamic loader (`LD_LIBRARY_PATH`, then the system's
//!   cache);
//! * the plugins: `$NIXL_PLUGIN_DIR` when set (NIXL reads it), otherwise `plugins/` beside the
//!   library (NIXL's own default).
//!
//! `scripts/nixl-env.sh` fetches the PyPI wheel `nixl-cu12`, which ships both, and sets the
//! variables; see `docs/nixl.md`.
//!
//! # Invariants
//!
//! * registered memory outlives its registration: the agent keeps every registered tier alive
//!   and deregisters before releasing it; a tier's bounce buffers are deregistered before they
//!   are freed;
//! * a call returns only when NIXL reports its transfer complete or failed, so no transfer
//!   touches a caller's buffer after the call returned (there is no time-out for that reason: a
//!   slow transfer is logged every [`SLOW_TRANSFER_LOG`], and UCX's peer error handling fails a
//!   transfer whose peer died);
//! * [`NixlDiskTier`] keeps the built-in disk tier's guarantees: a block never written is
//!   [`ErrorKind::NotFound`], a checksum mismatch is [`ErrorKind::Corrupt`], writers of a block
//!   are serialised against its readers;
//! * [`RemoteTier`] serialises its own readers and writers of a block; it cannot see what the
//!   exporting process does to that block meanwhile, so the exporter must not reuse a block
//!   while another worker may read it (the leader's job; see `docs/nixl.md`).

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::ffi::{CStr, CString};
use std::fs::{File, OpenOptions};
use std::io::{IoSlice, IoSliceMut};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferStatus,
};
use parking_lot::{Condvar, Mutex, RwLock};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::backends::disk::{
    hash_segments, never_written, verify_checksum, DiskTier, DiskTierOptions, DISK_ALIGNMENT,
};
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::tier::{check_io, copy_segments, total_len, Capability, StorageTier, TierKind};

/// File name of NIXL's C API library, which nixl-sys's stubs load.
pub const CAPI_LIBRARY: &str = "libnixl_capi.so";

/// Optional folder holding [`CAPI_LIBRARY`]; when set, the library is loaded from there (its
/// dependencies are found through its own `RPATH`, as in the wheel), not through the loader's
/// search path.
pub const LIB_DIR_ENV: &str = "KVBM_NIXL_LIB_DIR";

/// NIXL's own variable for its plugin folder.
pub const PLUGIN_DIR_ENV: &str = "NIXL_PLUGIN_DIR";

/// How often a transfer still running is logged.
pub const SLOW_TRANSFER_LOG: Duration = Duration::from_secs(10);

/// The C API entry points nixl-sys calls on the paths this module uses. A library that lacks one
/// would make nixl-sys's stub abort at that call, so [`probe`] checks them all up front.
const REQUIRED_SYMBOLS: &[&str] = &[
    "nixl_capi_is_stub",
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_get_available_plugins",
    "nixl_capi_string_list_size",
    "nixl_capi_string_list_get",
    "nixl_capi_destroy_string_list",
    "nixl_capi_get_plugin_params",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_destroy_params",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_create_opt_args",
    "nixl_capi_opt_args_add_backend",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_create_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
];

// ------------------------------------------------------------------------------------------------
// Probe
// ------------------------------------------------------------------------------------------------

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NixlInfo {
    /// The library file actually loaded.
    pub library: PathBuf,
    /// The plugin folder NIXL reads.
    pub plugin_dir: PathBuf,
    /// Where `plugin_dir` came from: [`PLUGIN_DIR_ENV`], or NIXL's default beside the library.
    pub plugin_dir_source: String,
    /// The plugins NIXL reports as available (e.g. `POSIX`, `UCX`).
    pub plugins: Vec<String>,
}

impl NixlInfo {
    /// Whether NIXL reports `plugin` (e.g. `"POSIX"`).
    pub fn has_plugin(&self, plugin: &str) -> bool {
        self.plugins.iter().any(|p| p == plugin)
    }

    /// `Ok` when `backend`'s plugin is available; otherwise an [`ErrorKind::Unsupported`] error
    /// naming the plugin file that was expected and where.
    pub fn require(&self, backend: NixlBackend) -> Result<()> {
        if self.has_plugin(backend.plugin()) {
            return Ok(());
        }
        let file = self
            .plugin_dir
            .join(format!("libplugin_{}.so", backend.plugin()));
        Err(Error::unsupported(format!(
            "the NIXL {} plugin is not available: {} {}",
            backend.plugin(),
            file.display(),
            if file.exists() {
                "exists but NIXL did not load it"
            } else {
                "does not exist"
            }
        ))
        .with("plugin_dir", self.plugin_dir.display())
        .with("plugin_dir_source", &self.plugin_dir_source)
        .with("available", self.plugins.join(","))
        .with("library", self.library.display()))
    }
}

/// The NIXL plugins this crate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NixlBackend {
    /// File I/O (the disk tier).
    Posix,
    /// Memory-to-memory between agents (the remote tier).
    Ucx,
}

impl NixlBackend {
    /// The plugin's name in NIXL.
    pub fn plugin(self) -> &'static str {
        match self {
            NixlBackend::Posix => "POSIX",
            NixlBackend::Ucx => "UCX",
        }
    }
}

impl std::fmt::Display for NixlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.plugin())
    }
}

/// Loads NIXL (once per process) and reports what is there; see the [module docs](self).
///
/// Errors ([`ErrorKind::Unsupported`], never an abort): the library cannot be loaded (the message
/// carries the loader's reason; the context names the library, [`LIB_DIR_ENV`] or
/// `LD_LIBRARY_PATH`), it lacks a C API symbol nixl-sys needs, or the plugin folder does not
/// exist or holds no plugin NIXL could load. The outcome is cached: the loader and NIXL read
/// their variables once per process.
pub fn probe() -> Result<NixlInfo> {
    static PROBE: OnceLock<Result<NixlInfo>> = OnceLock::new();
    PROBE.get_or_init(probe_uncached).clone()
}

fn env_or_unset(name: &str) -> String {
    std::env::var_os(name)
        .map(|v| v.to_string_lossy().into_owned())
        .unwrap_or_else(|| "(unset)".to_owned())
}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

const SETUP_HINT: &str = "run `source scripts/nixl-env.sh` (it fetches the nixl-cu12 wheel and \
                          sets LD_LIBRARY_PATH and NIXL_PLUGIN_DIR); see docs/nixl.md";

fn probe_uncached() -> Result<NixlInfo> {
    // 1. The library. Kept loaded for the life of the process: nixl-sys's stub then finds it
    //    by its soname without searching again.
    let (target, searched) = match std::env::var_os(LIB_DIR_ENV) {
        Some(dir) => {
            let p = Path::new(&dir).join(CAPI_LIBRARY);
            (
                p.to_string_lossy().into_owned(),
                format!("{LIB_DIR_ENV}={}", Path::new(&dir).display()),
            )
        }
        None => (
            CAPI_LIBRARY.to_owned(),
            format!(
                "LD_LIBRARY_PATH={} and the system library cache",
                env_or_unset("LD_LIBRARY_PATH")
            ),
        ),
    };
    let c_target = CString::new(target.clone())
        .map_err(|_| Error::unsupported("the NIXL library path contains a NUL byte"))?;
    // SAFETY: a valid NUL-terminated path; dlopen has no other preconditions.
    let handle = unsafe { libc::dlopen(c_target.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        let why = dlerror_string();
        return Err(Error::unsupported(format!(
            "NIXL is not available: {CAPI_LIBRARY} could not be loaded ({why})"
        ))
        .with("library", &target)
        .with("searched", searched)
        .with("hint", SETUP_HINT));
    }

    // 2. Every symbol nixl-sys will call.
    let mut missing = Vec::new();
    let mut anchor: *mut libc::c_void = std::ptr::null_mut();
    for name in REQUIRED_SYMBOLS {
        let c_name = CString::new(*name).map_err(|_| Error::internal("symbol name with NUL"))?;
        // SAFETY: `handle` is a live handle from dlopen; the name is NUL-terminated.
        let sym = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
        if sym.is_null() {
            missing.push(*name);
        } else if anchor.is_null() {
            anchor = sym;
        }
    }
    let library = loaded_path(anchor).unwrap_or_else(|| PathBuf::from(&target));
    if !missing.is_empty() {
        return Err(Error::unsupported(format!(
            "{} is not a usable NIXL C API library: it lacks {} of the symbols nixl-sys 1.5 \
             calls (first: {})",
            library.display(),
            missing.len(),
            missing[0]
        ))
        .with("library", library.display())
        .with("searched", searched)
        .with("hint", SETUP_HINT));
    }

    // 3. The plugin folder, as NIXL will pick it.
    let (plugin_dir, plugin_dir_source) = match std::env::var_os(PLUGIN_DIR_ENV) {
        Some(d) => (PathBuf::from(d), PLUGIN_DIR_ENV.to_owned()),
        None => (
            library
                .parent()
                .unwrap_or_else(|| Path::new("."))
                .join("plugins"),
            format!("default: plugins/ beside {CAPI_LIBRARY} ({PLUGIN_DIR_ENV} unset)"),
        ),
    };
    if !plugin_dir.is_dir() {
        return Err(Error::unsupported(format!(
            "NIXL's plugin folder {} does not exist",
            plugin_dir.display()
        ))
        .with("plugin_dir_source", &plugin_dir_source)
        .with("library", library.display())
        .with("hint", SETUP_HINT));
    }

    // 4. Ask NIXL itself (safe now: the library and its symbols are there).
    let agent = Agent::new_configured(
        &format!("kvbm-probe-{}", std::process::id()),
        &agent_config(),
    )
    .map_err(|e| {
        nixl_error("create an agent", e)
            .with("library", library.display())
            .with("plugin_dir", plugin_dir.display())
    })?;
    let list = agent
        .get_available_plugins()
        .map_err(|e| nixl_error("list plugins", e))?;
    let mut plugins = Vec::new();
    for p in list.iter() {
        plugins.push(p.map_err(|e| nixl_error("list plugins", e))?.to_owned());
    }
    drop(agent);
    if plugins.is_empty() {
        return Err(Error::unsupported(format!(
            "NIXL found no plugin in {} (expected libplugin_POSIX.so, libplugin_UCX.so)",
            plugin_dir.display()
        ))
        .with("plugin_dir_source", &plugin_dir_source)
        .with("library", library.display())
        .with("hint", SETUP_HINT));
    }
    let info = NixlInfo {
        library,
        plugin_dir,
        plugin_dir_source,
        plugins,
    };
    tracing::debug!(?info, "NIXL loaded");
    Ok(info)
}

/// The file a loaded symbol comes from.
fn loaded_path(sym: *mut libc::c_void) -> Option<PathBuf> {
    if sym.is_null() {
        return None;
    }
    // SAFETY: Dl_info is plain old data; dladdr fills it for an address inside a loaded object.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `sym` came from dlsym on a live handle.
    let ok = unsafe { libc::dladdr(sym, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set dli_fname to a NUL-terminated path owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    Some(path.canonicalize().unwrap_or(path))
}

fn agent_config() -> AgentConfig {
    AgentConfig {
        // Calls come from the transfer engine's blocking threads at once.
        thread_sync: ThreadSync::Rw,
        ..AgentConfig::default()
    }
}

/// A NIXL call failed: [`ErrorKind::Io`] naming what was being done.
fn nixl_error(what: &str, e: NixlError) -> Error {
    Error::new(ErrorKind::Io, format!("NIXL failed to {what}: {e}")).with("op", what)
}

// ------------------------------------------------------------------------------------------------
// Agent
// ------------------------------------------------------------------------------------------------

/// A memory or file range handed to NIXL for registration.
#[derive(Debug)]
struct RawRegion {
    addr: usize,
    len: usize,
    mem: MemType,
    dev: u64,
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
    bases: Vec<u64>,
    layout: Layout,
    kind: TierKind,
    #[expect(dead_code, reason = "held to keep the registered memory alive")]
    tier: Arc<dyn StorageTier>,
    /// The tier's block headers, once registered ([`NixlAgent::register_block_headers`]).
    headers: Option<Arc<BlockHeaders>>,
}

struct AgentShared {
    name: String,
    info: NixlInfo,
    /// Dropped first: deregisters before the agent goes and before the tiers are freed.
    hosts: RwLock<Vec<HostRegistration>>,
    backends: Vec<(NixlBackend, Backend)>,
    agent: Agent,
}

/// One NIXL agent: what a worker holds. Cheap to clone (shared).
///
/// Created with the backends it will use; host tiers registered with
/// [`register_host_tier`](Self::register_host_tier) are registered with all of them.
#[derive(Clone)]
pub struct NixlAgent {
    inner: Arc<AgentShared>,
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

    fn require_backend(&self, backend: NixlBackend) -> Result<()> {
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
    fn register(
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
    /// id for [`export_tier`](Self::export_tier).
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
            bases,
            layout,
            kind: tier.kind(),
            tier,
            headers: None,
        });
        Ok(hosts.len() - 1)
    }

    /// Registers (with the UCX backend) a block header array for host tier `id`: one
    /// [`BLOCK_HEADER_BYTES`] entry per block, naming the key the block holds and the xxh3-64
    /// checksum of its image. Exported with the tier ([`TierExport::headers`]), it lets an
    /// importer verify a block it reads ([`RemoteTier::read_verified`]). Registering again
    /// returns the same array.
    ///
    /// The owner keeps it true: [`BlockHeaders::invalidate`] a block **before** its bytes are
    /// overwritten, [`BlockHeaders::publish_from`] once the new bytes are complete.
    pub fn register_block_headers(&self, id: usize) -> Result<Arc<BlockHeaders>> {
        self.require_backend(NixlBackend::Ucx)?;
        let mut hosts = self.inner.hosts.write();
        let n = hosts.len();
        let h = hosts
            .get_mut(id)
            .ok_or_else(|| Error::out_of_range("host tier", id, n))?;
        if let Some(existing) = &h.headers {
            return Ok(existing.clone());
        }
        let headers = Arc::new(BlockHeaders::new(self, h.layout.num_blocks())?);
        h.headers = Some(headers.clone());
        Ok(headers)
    }

    /// Whether every non-empty segment lies inside one registered host tier allocation.
    fn all_registered<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
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

    /// What another worker needs to read and write host tier `id` of this agent over UCX.
    ///
    /// Take it after every tier is registered: it carries the agent's metadata as of now.
    pub fn export_tier(&self, id: usize) -> Result<TierExport> {
        self.require_backend(NixlBackend::Ucx)?;
        let (layout, bases, kind, headers) = {
            let hosts = self.inner.hosts.read();
            let h = hosts
                .get(id)
                .ok_or_else(|| Error::out_of_range("host tier", id, hosts.len()))?;
            (
                h.layout,
                h.bases.clone(),
                h.kind,
                h.headers.as_ref().map(|x| x.addr() as u64),
            )
        };
        let metadata =
            self.inner.agent.get_local_md().map_err(|e| {
                nixl_error("read the agent's metadata", e).with("agent", self.name())
            })?;
        Ok(TierExport {
            agent: self.name().to_owned(),
            kind,
            layout,
            allocations: bases,
            metadata,
            headers,
        })
    }

    /// Runs one transfer of `pairs` (`(local address, remote address, len)`) between local
    /// registered DRAM and `remote_agent`'s memory of type `remote_mem` (device id `remote_dev`,
    /// the file descriptor for files), and waits for it.
    fn transfer(
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
fn pair_runs(local: &[(usize, usize)], remote: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
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

fn runs_of<T: Deref<Target = [u8]>>(segments: &[T]) -> Vec<(usize, usize)> {
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
struct RegisteredBuf {
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
    fn new(agent: &NixlAgent, backend: NixlBackend, len: usize) -> Result<Self> {
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

    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn as_slice(&self, len: usize) -> &[u8] {
        // SAFETY: the allocation is `layout.size()` bytes, initialised (zeroed); `len` is capped.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len.min(self.layout.size())) }
    }

    fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
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
struct BouncePool {
    free: Mutex<Vec<RegisteredBuf>>,
    returned: Condvar,
    count: usize,
}

impl BouncePool {
    fn new(agent: &NixlAgent, backend: NixlBackend, count: usize, len: usize) -> Result<Self> {
        let free = (0..count)
            .map(|_| RegisteredBuf::new(agent, backend, len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            free: Mutex::new(free),
            returned: Condvar::new(),
            count,
        })
    }

    fn take(&self) -> BounceGuard<'_> {
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

struct BounceGuard<'a> {
    pool: &'a BouncePool,
    buf: Option<RegisteredBuf>,
}

impl BounceGuard<'_> {
    fn buf(&mut self) -> Result<&mut RegisteredBuf> {
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

// ------------------------------------------------------------------------------------------------
// Disk tier over POSIX
// ------------------------------------------------------------------------------------------------

/// A disk (G3) tier whose I/O goes through NIXL's POSIX backend; see the [module docs](self).
///
/// Same file, slot layout (`bytes_per_block` rounded up to 4096 per block), O_DIRECT choice and
/// checksums as [`DiskTier`], which it owns for the file. Buffers inside a host tier registered
/// with the agent go to NIXL as they are (with O_DIRECT: when 4096-aligned in address and
/// length); others go through one of `max_in_flight` registered bounce buffers.
pub struct NixlDiskTier {
    // Field order is drop order: the file's registration, then the bounce buffers, then the
    // descriptor NIXL used, then the built-in tier (which removes the file), then the agent.
    file_reg: Option<RegistrationHandle>,
    bounce: BouncePool,
    io_file: File,
    disk: DiskTier,
    agent: NixlAgent,
    kind: TierKind,
    slot_bytes: usize,
    checksums: Box<[RwLock<Option<u64>>]>,
}

impl std::fmt::Debug for NixlDiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlDiskTier")
            .field("agent", &self.agent.name())
            .field("disk", &self.disk)
            .finish_non_exhaustive()
    }
}

impl NixlDiskTier {
    /// Creates the tier's file like [`DiskTier::create`] (same options, same errors) and registers
    /// it with `agent`'s POSIX backend.
    ///
    /// Errors also: `agent` has no POSIX backend ([`ErrorKind::InvalidArgument`]); NIXL refusing
    /// a registration ([`ErrorKind::Io`]).
    pub fn create(
        agent: &NixlAgent,
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
    ) -> Result<Self> {
        agent.require_backend(NixlBackend::Posix)?;
        let max_in_flight = opts.max_in_flight;
        let disk = DiskTier::create(kind, dims, num_blocks, opts)?;
        let slot_bytes = disk.slot_bytes();
        let mut oo = OpenOptions::new();
        oo.read(true).write(true);
        if disk.direct_io() {
            oo.custom_flags(libc::O_DIRECT);
        }
        let io_file = oo.open(disk.path()).map_err(|e| {
            Error::io("open", e)
                .with("tier", kind)
                .with("path", disk.path().display())
        })?;
        let fd = u64::try_from(io_file.as_raw_fd())
            .map_err(|_| Error::internal("negative file descriptor"))?;
        let file_reg = agent
            .register(
                &RawRegion {
                    addr: 0,
                    len: slot_bytes * num_blocks,
                    mem: MemType::File,
                    dev: fd,
                },
                Some(NixlBackend::Posix),
            )
            .map_err(|e| e.with("tier", kind).with("path", disk.path().display()))?;
        let bounce = BouncePool::new(agent, NixlBackend::Posix, max_in_flight, slot_bytes)
            .map_err(|e| e.with("tier", kind))?;
        tracing::debug!(
            tier = %kind,
            path = %disk.path().display(),
            agent = %agent.name(),
            direct_io = disk.direct_io(),
            "NIXL disk tier created"
        );
        Ok(Self {
            file_reg: Some(file_reg),
            bounce,
            io_file,
            checksums: (0..num_blocks).map(|_| RwLock::new(None)).collect(),
            disk,
            agent: agent.clone(),
            kind,
            slot_bytes,
        })
    }

    /// The tier's file.
    pub fn path(&self) -> &Path {
        self.disk.path()
    }

    /// Whether the file is opened with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.disk.direct_io()
    }

    /// Why O_DIRECT was requested but is not in use (see [`DiskTier::direct_io_fallback_reason`]).
    pub fn direct_io_fallback_reason(&self) -> Option<&str> {
        self.disk.direct_io_fallback_reason()
    }

    /// Bytes of one block's slot in the file.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The agent doing the I/O.
    pub fn agent(&self) -> &NixlAgent {
        &self.agent
    }

    fn fd(&self) -> u64 {
        self.io_file.as_raw_fd() as u64
    }

    fn offset(&self, block: usize) -> usize {
        block * self.slot_bytes
    }

    /// Whether `segments` can go to NIXL as they are.
    fn usable_directly<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        let aligned = !self.direct_io()
            || segments.iter().all(|s| {
                s.is_empty()
                    || ((s.as_ptr() as usize) % DISK_ALIGNMENT == 0
                        && s.len() % DISK_ALIGNMENT == 0)
            });
        aligned && self.agent.all_registered(segments)
    }

    /// Bytes moved per bounced transfer: the whole slot under O_DIRECT (aligned length).
    fn bounce_len(&self) -> usize {
        if self.direct_io() {
            self.slot_bytes
        } else {
            self.bytes_per_block()
        }
    }

    fn file_io(&self, op: XferOp, block: usize, local: &[(usize, usize)]) -> Result<()> {
        let pairs = pair_runs(
            local,
            &[(self.offset(block), local.iter().map(|r| r.1).sum())],
        );
        self.agent
            .transfer(
                op,
                NixlBackend::Posix,
                self.agent.name(),
                MemType::File,
                self.fd(),
                &pairs,
            )
            .map_err(|e| {
                e.with("tier", self.kind)
                    .with("block", block)
                    .with("path", self.path().display())
            })
    }

    fn checksum_lock(&self, op: &'static str, block: usize) -> Result<&RwLock<Option<u64>>> {
        self.checksums.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.checksums.len())
                .with("tier", self.kind)
                .with("op", op)
        })
    }
}

impl StorageTier for NixlDiskTier {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: if self.direct_io() { DISK_ALIGNMENT } else { 1 },
            checksummed: true,
            max_in_flight: self.bounce.count,
        }
    }

    fn layout(&self) -> &Layout {
        self.disk.layout()
    }

    /// Reads and verifies `block`, as [`DiskTier::read_block`] does.
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let guard = self.checksum_lock("read_block", block)?.read();
        let Some(expected) = *guard else {
            return Err(never_written(self.kind, block, self.path()));
        };
        let actual = if self.usable_directly(dst) {
            self.file_io(XferOp::Read, block, &runs_of(dst))?;
            hash_segments(dst)
        } else {
            let mut guard = self.bounce.take();
            let buf = guard.buf()?;
            self.file_io(XferOp::Read, block, &[(buf.addr(), self.bounce_len())])?;
            let image = buf.as_slice(self.bytes_per_block());
            let actual = xxhash_rust::xxh3::xxh3_64(image);
            if actual == expected {
                copy_segments(&[IoSlice::new(image)], dst);
            }
            actual
        };
        verify_checksum(self.kind, block, self.path(), expected, actual)
    }

    /// Writes `block` and records its checksum; a failed write leaves it never written.
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        let mut guard = self.checksum_lock("write_block", block)?.write();
        let checksum = hash_segments(src);
        *guard = None;
        if self.usable_directly(src) {
            self.file_io(XferOp::Write, block, &runs_of(src))?;
        } else {
            let bpb = self.bytes_per_block();
            let len = self.bounce_len();
            let mut bg = self.bounce.take();
            let buf = bg.buf()?;
            {
                let slot = buf.as_mut_slice(len);
                let (image, padding) = slot.split_at_mut(bpb);
                copy_segments(src, &mut [IoSliceMut::new(image)]);
                padding.fill(0);
            }
            self.file_io(XferOp::Write, block, &[(buf.addr(), len)])?;
        }
        *guard = Some(checksum);
        Ok(())
    }
}

impl Drop for NixlDiskTier {
    fn drop(&mut self) {
        // Deregister the file while its descriptor is still open (fields drop after this).
        drop(self.file_reg.take());
    }
}

// ------------------------------------------------------------------------------------------------
// Remote tier over UCX
// ------------------------------------------------------------------------------------------------

/// What a worker publishes so that another can reach one of its host tiers over UCX.
///
/// Plain data (serde): send it any way (a file, a pipe, the leader's transport). `metadata` is
/// NIXL's opaque agent metadata (connection info and registrations).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierExport {
    /// The exporting agent's name.
    pub agent: String,
    /// The exported tier's level (normally host).
    pub kind: TierKind,
    /// Its layout.
    pub layout: Layout,
    /// Base address of each of its allocations, in the exporter's address space.
    pub allocations: Vec<u64>,
    /// NIXL metadata of the exporting agent.
    pub metadata: Vec<u8>,
    /// Address of the tier's block header array ([`BlockHeaders`]) in the exporter's address
    /// space, when it registered one; needed by [`RemoteTier::read_verified`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<u64>,
}

impl TierExport {
    /// JSON bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::internal(format!("encode tier export: {e}")))
    }

    /// From [`to_bytes`](Self::to_bytes)'s output; [`ErrorKind::Decode`] on anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Decode, format!("not a NIXL tier export: {e}")))
    }
}

/// Another worker's host tier, read and written over UCX: the G4 (`remote`) tier.
///
/// Blocks are the exporter's; this side serialises its own readers and writers of a block.
/// Buffers inside a host tier registered with the local agent are used as they are; others go
/// through registered bounce buffers.
pub struct RemoteTier {
    bounce: BouncePool,
    agent: NixlAgent,
    remote: String,
    layout: Layout,
    allocations: Vec<usize>,
    headers: Option<usize>,
    locks: Box<[RwLock<()>]>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("agent", &self.agent.name())
            .field("remote", &self.remote)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// Default number of bounce buffers (and calls served well in parallel) of a [`RemoteTier`].
pub const REMOTE_MAX_IN_FLIGHT: usize = 4;

impl RemoteTier {
    /// Loads `export`'s metadata into `agent` (which needs the UCX backend) and returns the
    /// remote tier; `max_in_flight` bounce buffers of one block are registered.
    ///
    /// Errors: `agent` lacks UCX or `max_in_flight` is 0 ([`ErrorKind::InvalidArgument`]); an
    /// export whose allocations do not match its layout ([`ErrorKind::Decode`]); NIXL refusing
    /// the metadata ([`ErrorKind::Io`]).
    pub fn connect(agent: &NixlAgent, export: &TierExport, max_in_flight: usize) -> Result<Self> {
        agent.require_backend(NixlBackend::Ucx)?;
        if max_in_flight == 0 {
            return Err(Error::invalid_argument("max_in_flight must be non-zero"));
        }
        let layout = export.layout;
        if export.allocations.len() != layout.num_allocations() {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "tier export lists {} allocations, its layout has {}",
                    export.allocations.len(),
                    layout.num_allocations()
                ),
            )
            .with("remote_agent", &export.agent));
        }
        let allocations = export
            .allocations
            .iter()
            .map(|&a| {
                usize::try_from(a).map_err(|_| {
                    Error::new(ErrorKind::Decode, "allocation address overflows usize")
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let remote = agent
            .inner
            .agent
            .load_remote_md(&export.metadata)
            .map_err(|e| {
                nixl_error("load a remote agent's metadata", e)
                    .with("agent", agent.name())
                    .with("remote_agent", &export.agent)
            })?;
        if remote != export.agent {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "tier export names agent {} but its metadata is agent {remote}",
                    export.agent
                ),
            ));
        }
        let headers = export
            .headers
            .map(|a| {
                usize::try_from(a)
                    .map_err(|_| Error::new(ErrorKind::Decode, "header address overflows usize"))
            })
            .transpose()?;
        let bounce = BouncePool::new(
            agent,
            NixlBackend::Ucx,
            max_in_flight,
            layout.bytes_per_block().max(BLOCK_HEADER_BYTES),
        )?;
        Ok(Self {
            bounce,
            agent: agent.clone(),
            remote,
            locks: (0..layout.num_blocks()).map(|_| RwLock::new(())).collect(),
            layout,
            allocations,
            headers,
        })
    }

    /// Whether the export carried block headers ([`read_verified`](Self::read_verified) works).
    pub fn has_headers(&self) -> bool {
        self.headers.is_some()
    }

    /// Reads block `block` only if it is verified to hold `key`: reads the exporter's header
    /// entry for the block (one-sided), then the block's bytes into a bounce buffer, and copies
    /// them to `dst` only when the header is valid (sealed, not invalidated), names `key`, and
    /// the bytes' xxh3-64 equals the header's checksum. Returns the checksum.
    ///
    /// Why this is enough while the exporter may evict and rewrite the block at any time: the
    /// exporter invalidates the header before it writes the block and publishes (key, checksum)
    /// only after the write, so a valid header for `key` means some complete image of `key`
    /// had that checksum; bytes read afterwards that hash to it are that image (a torn or newer
    /// image hashes differently, up to xxh3-64 collisions). A header torn by a concurrent
    /// update fails its seal.
    ///
    /// Errors: no headers in the export ([`ErrorKind::Unsupported`]); header invalid or naming
    /// another key ([`ErrorKind::NotFound`]); checksum mismatch ([`ErrorKind::Corrupt`]);
    /// transfer failures ([`ErrorKind::Io`]); `dst` of the wrong length.
    pub fn read_verified(&self, block: usize, key: u64, dst: &mut [IoSliceMut<'_>]) -> Result<u64> {
        check_io(
            TierKind::Remote,
            "read_verified",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let hdr = self.headers.ok_or_else(|| {
            Error::unsupported(format!(
                "the export of {} carries no block headers: its blocks cannot be verified",
                self.remote
            ))
            .with("remote_agent", &self.remote)
        })?;
        let ctx = |e: Error| {
            e.with("tier", TierKind::Remote)
                .with("block", block)
                .with("remote_agent", &self.remote)
                .with("key", format!("{key:#018x}"))
        };
        let _guard = self.lock("read_verified", block)?.read();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        self.agent
            .transfer(
                XferOp::Read,
                NixlBackend::Ucx,
                &self.remote,
                MemType::Dram,
                0,
                &[(
                    buf.addr(),
                    hdr + block * BLOCK_HEADER_BYTES,
                    BLOCK_HEADER_BYTES,
                )],
            )
            .map_err(ctx)?;
        let (found, checksum) =
            decode_header(buf.as_slice(BLOCK_HEADER_BYTES)).ok_or_else(|| {
                ctx(Error::new(
                    ErrorKind::NotFound,
                    "remote block header is invalid (never published, or being rewritten)",
                ))
            })?;
        if found != key {
            return Err(ctx(Error::new(
                ErrorKind::NotFound,
                format!("remote block holds key {found:#018x}, not the expected one"),
            )));
        }
        let bpb = self.bytes_per_block();
        self.io(XferOp::Read, block, &[(buf.addr(), bpb)])?;
        let got = hash_segments(&[buf.as_slice(bpb)]);
        if got != checksum {
            return Err(ctx(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "remote block bytes hash to {got:#018x}, its header says {checksum:#018x} \
                     (rewritten during the read?)"
                ),
            )));
        }
        copy_segments(&[IoSlice::new(buf.as_slice(bpb))], dst);
        Ok(checksum)
    }

    /// The exporting agent's name.
    pub fn remote_agent(&self) -> &str {
        &self.remote
    }

    fn remote_runs(&self, block: usize) -> Result<Vec<(usize, usize)>> {
        self.layout
            .regions(block)?
            .map(|r| {
                self.allocations
                    .get(r.allocation)
                    .map(|base| (base + r.offset, r.len))
                    .ok_or_else(|| Error::internal("region names a missing allocation"))
            })
            .collect()
    }

    fn io(&self, op: XferOp, block: usize, local: &[(usize, usize)]) -> Result<()> {
        let pairs = pair_runs(local, &self.remote_runs(block)?);
        self.agent
            .transfer(op, NixlBackend::Ucx, &self.remote, MemType::Dram, 0, &pairs)
            .map_err(|e| e.with("tier", TierKind::Remote).with("block", block))
    }

    fn lock(&self, op: &'static str, block: usize) -> Result<&RwLock<()>> {
        self.locks.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.locks.len())
                .with("tier", TierKind::Remote)
                .with("op", op)
        })
    }
}

impl StorageTier for RemoteTier {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: 1,
            checksummed: false,
            max_in_flight: self.bounce.count,
        }
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            TierKind::Remote,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let _guard = self.lock("read_block", block)?.read();
        if self.agent.all_registered(dst) {
            return self.io(XferOp::Read, block, &runs_of(dst));
        }
        let bpb = self.bytes_per_block();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        self.io(XferOp::Read, block, &[(buf.addr(), bpb)])?;
        copy_segments(&[IoSlice::new(buf.as_slice(bpb))], dst);
        Ok(())
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            TierKind::Remote,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        let _guard = self.lock("write_block", block)?.write();
        if self.agent.all_registered(src) {
            return self.io(XferOp::Write, block, &runs_of(src));
        }
        let bpb = self.bytes_per_block();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        copy_segments(src, &mut [IoSliceMut::new(buf.as_mut_slice(bpb))]);
        self.io(XferOp::Write, block, &[(buf.addr(), bpb)])
    }
}

// ------------------------------------------------------------------------------------------------
// Block headers: what makes a remote block verifiable
// ------------------------------------------------------------------------------------------------

/// Bytes of one block header entry: `[key, checksum, sequence, seal]`, four little-endian u64.
pub const BLOCK_HEADER_BYTES: usize = 32;

/// The seal of a header entry: a hash of its three fields, never 0 (0 marks "being written").
fn seal(key: u64, checksum: u64, seq: u64) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvbm-block-header");
    h.update(&key.to_le_bytes());
    h.update(&checksum.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.digest() | 1
}

/// Decodes one header entry read from an exporter: `(key, checksum)` when it is valid (a
/// non-zero key and a matching seal), `None` when invalidated, being written or torn.
pub fn decode_header(bytes: &[u8]) -> Option<(u64, u64)> {
    if bytes.len() < BLOCK_HEADER_BYTES {
        return None;
    }
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let (key, checksum, seq, sealed) = (w(0), w(1), w(2), w(3));
    (key != 0 && sealed == seal(key, checksum, seq)).then_some((key, checksum))
}

/// One header entry per block of an exported host tier, in memory registered with UCX, so that
/// importers can check what a block holds before they trust its bytes. See
/// [`NixlAgent::register_block_headers`] and [`RemoteTier::read_verified`].
pub struct BlockHeaders {
    /// Deregistered (dropped) before `words` is freed (fields drop in order).
    _handle: RegistrationHandle,
    /// Four words per block: key, checksum, sequence, seal.
    words: Box<[AtomicU64]>,
    seq: AtomicU64,
}

impl std::fmt::Debug for BlockHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHeaders")
            .field("num_blocks", &self.num_blocks())
            .finish_non_exhaustive()
    }
}

impl BlockHeaders {
    fn new(agent: &NixlAgent, num_blocks: usize) -> Result<Self> {
        let words: Box<[AtomicU64]> = (0..num_blocks * 4).map(|_| AtomicU64::new(0)).collect();
        let handle = agent.register(
            &RawRegion {
                addr: words.as_ptr() as usize,
                len: (num_blocks * BLOCK_HEADER_BYTES).max(1),
                mem: MemType::Dram,
                dev: 0,
            },
            Some(NixlBackend::Ucx),
        )?;
        Ok(Self {
            _handle: handle,
            words,
            seq: AtomicU64::new(0),
        })
    }

    fn addr(&self) -> usize {
        self.words.as_ptr() as usize
    }

    /// Blocks covered.
    pub fn num_blocks(&self) -> usize {
        self.words.len() / 4
    }

    fn entry(&self, block: usize) -> Result<&[AtomicU64]> {
        self.words
            .get(block * 4..block * 4 + 4)
            .ok_or_else(|| Error::out_of_range("block header", block, self.num_blocks()))
    }

    /// Marks `block` as holding nothing verifiable. Call it **before** overwriting the block.
    pub fn invalidate(&self, block: usize) -> Result<()> {
        let e = self.entry(block)?;
        e[3].store(0, Ordering::SeqCst);
        e[0].store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Publishes that `block` holds `key` (non-zero) with image checksum `checksum`.
    pub fn publish(&self, block: usize, key: u64, checksum: u64) -> Result<()> {
        if key == 0 {
            return Err(Error::invalid_argument(
                "key 0 marks an invalid block header",
            ));
        }
        let e = self.entry(block)?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        e[3].store(0, Ordering::SeqCst);
        e[0].store(key, Ordering::SeqCst);
        e[1].store(checksum, Ordering::SeqCst);
        e[2].store(seq, Ordering::SeqCst);
        e[3].store(seal(key, checksum, seq), Ordering::SeqCst);
        Ok(())
    }

    /// Hashes `block` of `tier` (the registered tier these headers describe; no write to the
    /// block may run meanwhile) and publishes it as holding `key`. Returns the checksum.
    pub fn publish_from(&self, tier: &dyn StorageTier, block: usize, key: u64) -> Result<u64> {
        let mut checksum = 0;
        tier.with_block(block, &mut |runs| {
            checksum = hash_segments(runs);
            Ok(())
        })?;
        self.publish(block, key, checksum)?;
        Ok(checksum)
    }

    /// `(key, checksum)` of `block` when valid.
    pub fn get(&self, block: usize) -> Option<(u64, u64)> {
        let e = self.entry(block).ok()?;
        let mut b = [0u8; BLOCK_HEADER_BYTES];
        for (i, w) in e.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.load(Ordering::SeqCst).to_le_bytes());
        }
        decode_header(&b)
    }
}

/// A [`RemoteTier`] whose reads are verified against the keys the reader expects: what a worker
/// loads from (transfer engine source) for one remote load. `read_block` of a block with no
/// expected key, or whose check fails, is an error (the block fails, never served); writes are
/// refused.
#[derive(Debug)]
pub struct VerifiedRemote {
    tier: Arc<RemoteTier>,
    keys: std::collections::HashMap<usize, u64>,
}

impl VerifiedRemote {
    /// `keys`: `(remote block, expected key)`.
    pub fn new(tier: Arc<RemoteTier>, keys: impl IntoIterator<Item = (usize, u64)>) -> Self {
        Self {
            tier,
            keys: keys.into_iter().collect(),
        }
    }
}

impl StorageTier for VerifiedRemote {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    fn capability(&self) -> Capability {
        Capability {
            checksummed: true,
            ..self.tier.capability()
        }
    }

    fn layout(&self) -> &Layout {
        self.tier.layout()
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        let key = *self.keys.get(&block).ok_or_else(|| {
            Error::new(ErrorKind::NotFound, "no expected key for this remote block")
                .with("tier", TierKind::Remote)
                .with("block", block)
        })?;
        self.tier.read_verified(block, key, dst).map(|_| ())
    }

    fn write_block(&self, block: usize, _src: &[IoSlice<'_>]) -> Result<()> {
        Err(Error::unsupported("verified remote reads are read-only")
            .with("tier", TierKind::Remote)
            .with("block", block))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_seal_detects_invalid_and_torn_entries() {
        let enc = |k: u64, c: u64, s: u64, x: u64| {
            [k, c, s, x]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        assert_eq!(decode_header(&enc(7, 9, 1, seal(7, 9, 1))), Some((7, 9)));
        assert_eq!(decode_header(&enc(0, 9, 1, seal(0, 9, 1))), None);
        assert_eq!(decode_header(&enc(7, 9, 1, 0)), None);
        // Key of one version, checksum of another.
        assert_eq!(decode_header(&enc(7, 10, 1, seal(7, 9, 1))), None);
        assert_eq!(decode_header(&enc(7, 9, 2, seal(7, 9, 1))), None);
        assert_eq!(decode_header(&[0u8; 8]), None);
    }

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

    #[test]
    fn info_require_names_the_plugin_file() {
        let info = NixlInfo {
            library: PathBuf::from("/x/libnixl_capi.so"),
            plugin_dir: PathBuf::from("/nowhere/plugins"),
            plugin_dir_source: PLUGIN_DIR_ENV.to_owned(),
            plugins: vec!["UCX".to_owned()],
        };
        assert!(info.require(NixlBackend::Ucx).is_ok());
        let err = info.require(NixlBackend::Posix).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        assert!(
            err.to_string()
                .contains("/nowhere/plugins/libplugin_POSIX.so"),
            "{err}"
        );
        assert_eq!(err.context_value("available"), Some("UCX"));
    }

    #[test]
    fn export_round_trips_and_garbage_is_decode() {
        let e = TierExport {
            agent: "a".into(),
            kind: TierKind::Host,
            layout: Layout::fully_contiguous(
                LayoutDims {
                    num_layers: 1,
                    outer_dim: 2,
                    page_size: 4,
                    inner_dim: 8,
                    dtype_bytes: 2,
                },
                3,
            )
            .unwrap(),
            allocations: vec![4096],
            metadata: vec![1, 2, 3],
            headers: None,
        };
        assert_eq!(TierExport::from_bytes(&e.to_bytes().unwrap()).unwrap(), e);
        assert_eq!(
            TierExport::from_bytes(b"nope").unwrap_err().kind(),
            ErrorKind::Decode
        );
    }
}
