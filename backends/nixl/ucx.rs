//! Which UCX modules a UCX backend loads ([`prepare_ucx`]): UCX's InfiniBand modules stay out
//! unless the user configured RDMA.
//!
//! Why: UCX loads its transports as modules when the UCX plugin creates its context. In the
//! nixl-cu12 wheel, the InfiniBand modules carry their own copies of libibverbs and libnl, except
//! `libuct_ib_efa.so`, which needs the system's `libefa.so.1`. On a host with the RDMA libraries
//! (Debian's `libibverbs1` and `ibverbs-providers`; every RDMA host has them) that brings the
//! system's libibverbs and libnl-route into the process beside the wheel's copies: two libnl-route
//! with the same symbols, whose destructors then crash the process at exit (SIGSEGV in
//! `rtnl_tc_unregister`, from `_dl_fini`), after everything else worked. `UCX_TLS` does not help:
//! the modules are loaded before transports are chosen. `UCX_MODULES` does: it decides what is
//! loaded. UCX reads it once, when its library is loaded, so it is set before the UCX plugin is
//! first loaded (NIXL loads a plugin when a backend of it is first created, not before: an agent
//! with only the POSIX backend loads no UCX at all).
//!
//! The rule ([`ucx_modules_choice`]): `UCX_MODULES` set by the user is left alone; `UCX_TLS`
//! naming an InfiniBand transport (`rc`, `ud`, `dc` and their variants, `ib`, `srd`, `gga`) is
//! the user asking for RDMA and is left alone too; otherwise `UCX_MODULES` is set to
//! [`UCX_MODULES_WITHOUT_RDMA`]. See docs/nixl.md, "RDMA hosts".

use std::ffi::OsStr;
use std::sync::Once;

/// UCX's variable for the modules it loads (comma-separated globs; `^` first negates the list).
pub const UCX_MODULES_ENV: &str = "UCX_MODULES";

/// UCX's variable for the transports it uses.
pub const UCX_TLS_ENV: &str = "UCX_TLS";

/// What [`UCX_MODULES_ENV`] is set to when the user configured no RDMA: every module but the
/// InfiniBand ones (`ib`, which loads verbs, mlx5 and EFA, and the RDMA connection manager).
/// TCP, shared memory and `cma` stay.
pub const UCX_MODULES_WITHOUT_RDMA: &str = "^ib,rdmacm";

/// What [`prepare_ucx`] does with the environment it finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum UcxModules {
    /// `UCX_MODULES` was set by the user (the value): left alone.
    UserSet(String),
    /// `UCX_TLS` names an InfiniBand transport (the value): left alone.
    RdmaAsked(String),
    /// Neither: `UCX_MODULES` is set to [`UCX_MODULES_WITHOUT_RDMA`].
    KeepRdmaOut,
}

/// Whether a `UCX_TLS` value names an InfiniBand transport. A negated list (`^tcp`) names none:
/// it only removes transports, as does the default (`all`).
pub(super) fn tls_names_rdma(tls: &str) -> bool {
    let tls = tls.trim();
    if tls.starts_with('^') {
        return false;
    }
    tls.split(',').any(|t| {
        // A transport may carry a qualifier (`rc_x:aux`).
        let name = t
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        name == "ib"
            || name == "srd"
            || ["rc", "ud", "dc", "gga"]
                .iter()
                .any(|p| name == *p || name.starts_with(&format!("{p}_")))
    })
}

/// The decision for the values of `UCX_MODULES` and `UCX_TLS` found in the environment.
pub(super) fn ucx_modules_choice(modules: Option<&OsStr>, tls: Option<&OsStr>) -> UcxModules {
    if let Some(m) = modules {
        return UcxModules::UserSet(m.to_string_lossy().into_owned());
    }
    match tls.map(|t| t.to_string_lossy()) {
        Some(t) if tls_names_rdma(&t) => UcxModules::RdmaAsked(t.into_owned()),
        _ => UcxModules::KeepRdmaOut,
    }
}

/// Called before a UCX backend is created (the first one loads UCX): applies
/// [`ucx_modules_choice`] to the environment, once per process, and logs what it did.
///
/// Setting a variable races with C code reading the environment on another thread at that
/// instant; it happens once, only in a process that asks for a UCX backend, and before UCX
/// itself runs. A UCX already loaded in the process (by another library) read its settings
/// before and is not affected.
pub(super) fn prepare_ucx() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let choice = ucx_modules_choice(
            std::env::var_os(UCX_MODULES_ENV).as_deref(),
            std::env::var_os(UCX_TLS_ENV).as_deref(),
        );
        match choice {
            UcxModules::UserSet(v) => {
                tracing::debug!(UCX_MODULES = %v, "UCX modules as the user set them");
            }
            UcxModules::RdmaAsked(v) => tracing::info!(
                UCX_TLS = %v,
                "UCX_TLS names an RDMA transport: UCX's InfiniBand modules are loaded (see \
                 docs/nixl.md, RDMA hosts)"
            ),
            UcxModules::KeepRdmaOut => {
                std::env::set_var(UCX_MODULES_ENV, UCX_MODULES_WITHOUT_RDMA);
                tracing::debug!(
                    UCX_MODULES = UCX_MODULES_WITHOUT_RDMA,
                    "UCX's InfiniBand modules kept out (no RDMA transport configured)"
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_naming_infiniband_transports() {
        for t in [
            "rc",
            "rc_x",
            "rc_v",
            "rc_mlx5",
            "ud_verbs",
            "dc_x",
            "ib",
            "srd",
            "gga",
            "tcp,rc",
            "sm, self, RC_X",
            "tcp,rc_x:aux",
        ] {
            assert!(tls_names_rdma(t), "{t}");
        }
        for t in [
            "",
            "tcp",
            "tcp,self,sm",
            "all",
            "^rc",
            "^tcp",
            "cma,posix",
            "cuda_copy",
            "udp",
        ] {
            assert!(!tls_names_rdma(t), "{t}");
        }
    }

    #[test]
    fn the_user_setting_wins_else_rdma_stays_out() {
        let s = |v: &str| Some(OsStr::new(v).to_owned());
        assert_eq!(
            ucx_modules_choice(s("*").as_deref(), s("tcp").as_deref()),
            UcxModules::UserSet("*".into())
        );
        assert_eq!(
            ucx_modules_choice(None, s("rc_x,sm").as_deref()),
            UcxModules::RdmaAsked("rc_x,sm".into())
        );
        assert_eq!(
            ucx_modules_choice(None, s("tcp,self,sm").as_deref()),
            UcxModules::KeepRdmaOut
        );
        assert_eq!(ucx_modules_choice(None, None), UcxModules::KeepRdmaOut);
    }
}
