//! Finding and loading NIXL: [`probe`] loads `libnixl_capi.so` itself, checks that it has every
//! C API symbol nixl-sys calls and that the plugin folder holds plugins, before anything calls
//! nixl-sys (whose stubs abort the process when the library is missing). Owns the variables read
//! ([`LIB_DIR_ENV`], [`PLUGIN_DIR_ENV`]) and what was found ([`NixlInfo`]); see the
//! [backend docs](super).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nixl_sys::Agent;
use serde::{Deserialize, Serialize};

use super::agent::{agent_config, nixl_error};
use crate::error::{Error, Result};

/// File name of NIXL's C API library, which nixl-sys's stubs load.
pub const CAPI_LIBRARY: &str = "libnixl_capi.so";

/// Optional folder holding [`CAPI_LIBRARY`]; when set, the library is loaded from there (its
/// dependencies are found through its own `RPATH`, as in the wheel), not through the loader's
/// search path.
pub const LIB_DIR_ENV: &str = "KVBM_NIXL_LIB_DIR";

/// NIXL's own variable for its plugin folder.
pub const PLUGIN_DIR_ENV: &str = "NIXL_PLUGIN_DIR";

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

    /// `Ok` when `backend`'s plugin is available; otherwise an [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) error
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

/// Loads NIXL (once per process) and reports what is there; see the [backend docs](super).
///
/// Errors ([`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported), never an abort): the library cannot be loaded (the message
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
    let (handle, target, searched) = load_library()?;
    let library = check_symbols(handle, &target, searched)?;
    let (plugin_dir, plugin_dir_source) = find_plugin_dir(&library)?;
    let plugins = list_plugins(&library, &plugin_dir, &plugin_dir_source)?;
    let info = NixlInfo {
        library,
        plugin_dir,
        plugin_dir_source,
        plugins,
    };
    tracing::debug!(?info, "NIXL loaded");
    Ok(info)
}

/// Step 1, the library: loaded from [`LIB_DIR_ENV`] or by the loader's search, and kept loaded
/// for the life of the process (nixl-sys's stub then finds it by its soname without searching
/// again). Returns the handle, the path asked for and where it was searched (for errors).
fn load_library() -> Result<(*mut libc::c_void, String, String)> {
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
    Ok((handle, target, searched))
}

/// Step 2, every symbol nixl-sys will call, looked up in `handle` (from [`load_library`]).
/// Returns the file they come from (`target` when the loader cannot say).
fn check_symbols(handle: *mut libc::c_void, target: &str, searched: String) -> Result<PathBuf> {
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
    let library = loaded_path(anchor).unwrap_or_else(|| PathBuf::from(target));
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
    Ok(library)
}

/// Step 3, the plugin folder as NIXL will pick it: [`PLUGIN_DIR_ENV`], else `plugins/` beside
/// `library`; refused when it is not a folder. Returns it and where it came from.
fn find_plugin_dir(library: &Path) -> Result<(PathBuf, String)> {
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
    Ok((plugin_dir, plugin_dir_source))
}

/// Step 4, NIXL itself (safe now: the library and its symbols are there): the plugins an agent
/// finds, refused when there is none.
fn list_plugins(library: &Path, plugin_dir: &Path, plugin_dir_source: &str) -> Result<Vec<String>> {
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
        .with("plugin_dir_source", plugin_dir_source)
        .with("library", library.display())
        .with("hint", SETUP_HINT));
    }
    Ok(plugins)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

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
}
