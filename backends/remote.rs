//! The remote (G4) tier's backends: which [`RemoteStore`] a `remote.url` names, chosen by the
//! URL's scheme.
//!
//! The core knows a shared store only through the [`RemoteStore`] trait and `remote.url` only as
//! a bounded `scheme://…` string ([`validate_url`](crate::config::validate_url)); everything
//! particular to a store — its schemes, how the rest of its URL reads, which other `[remote]`
//! settings it accepts, how it connects — is a [`RemoteBackend`] here:
//!
//! * `memory://NAME` — [`MemoryRemote`]: an in-process store, shared by every instance of this
//!   process that names the same `NAME` (planning runs of `kvbm replay` and `kvbm sweep`, tests);
//!   always built;
//! * `redis://`, `rediss://`, `redis+cluster://`, `rediss+cluster://` — Redis / Valkey
//!   ([`RedisBackend`](super::redis::RedisBackend), feature `redis`).
//!
//! Adding a store (an S3-compatible one, say) is one folder under `backends/` that implements
//! [`RemoteStore`] and [`RemoteBackend`], and one line in [`backends`]; every store passes the
//! conformance suite in `tests/conformance/remote.rs`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::config::{Config, RemoteConfig};
use crate::connector::remote::{MemoryRemoteData, MemoryRemoteStore, RemoteScope, RemoteStore};
use crate::error::{Error, ErrorKind, Result};

/// One kind of shared store: the URL schemes it answers, the checks of its settings, and how it
/// connects.
pub trait RemoteBackend: Send + Sync + std::fmt::Debug {
    /// Its name, for messages (`redis`, `memory`).
    fn name(&self) -> &'static str;

    /// The URL schemes it serves, lowercase, without `://`.
    fn schemes(&self) -> &'static [&'static str];

    /// Checks `remote.url` (whose scheme is one of [`RemoteBackend::schemes`]) and the other
    /// `[remote]` settings as this store reads them; errors are
    /// [`ErrorKind::InvalidConfig`] naming the setting. Called before anything starts.
    fn check(&self, remote: &RemoteConfig) -> Result<()>;

    /// The store for `scope`. A server that is down is not an error (the store starts
    /// unavailable and reconnects in the background); settings it cannot use are.
    fn connect(&self, config: &Config, scope: &RemoteScope) -> Result<Arc<dyn RemoteStore>>;
}

/// The backends this build has, in the order a scheme is looked up.
pub fn backends() -> Vec<&'static dyn RemoteBackend> {
    vec![
        &MemoryRemote,
        #[cfg(feature = "redis")]
        &super::redis::RedisBackend,
    ]
}

/// Schemes of stores this crate has but this build was compiled without, with the feature that
/// builds them (for a clear error rather than "unknown scheme").
const FEATURE_GATED: &[(&str, &str)] = &[
    ("redis", "redis"),
    ("rediss", "redis"),
    ("redis+cluster", "redis"),
    ("rediss+cluster", "redis"),
];

/// The backend whose scheme `url` has. Errors: no `scheme://` ([`ErrorKind::InvalidConfig`]), a
/// scheme of a store this build was compiled without ([`ErrorKind::Unsupported`], naming the
/// feature), an unknown scheme (`InvalidConfig`, listing the schemes this build serves).
pub fn backend_for(url: &str) -> Result<&'static dyn RemoteBackend> {
    crate::config::validate_url(url)?;
    let scheme = url
        .trim()
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default();
    let all = backends();
    if let Some(b) = all.iter().find(|b| b.schemes().contains(&scheme.as_str())) {
        return Ok(*b);
    }
    if let Some((_, feature)) = FEATURE_GATED.iter().find(|(s, _)| *s == scheme) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "remote.url (KVBM_REMOTE_URL) is a {scheme}:// store, which needs kvbm-connector built with the `{feature}` feature"
            ),
        )
        .with("setting", "remote.url"));
    }
    let known: Vec<String> = all
        .iter()
        .flat_map(|b| b.schemes().iter().map(|s| format!("{s}://")))
        .collect();
    Err(Error::invalid_config(
        "remote.url",
        crate::config::redact_url(url),
        format!(
            "no store in this build serves `{scheme}://`; known: {}",
            known.join(", ")
        ),
    ))
}

/// Checks the `[remote]` settings against the store `remote.url` names (nothing when it is
/// unset): the tool and the Python bindings call it after loading the configuration, so a bad URL
/// is refused before an engine starts.
pub fn check(config: &Config) -> Result<()> {
    let Some(url) = config.remote.url.as_deref() else {
        return Ok(());
    };
    backend_for(url)
        .and_then(|b| b.check(&config.remote))
        .map_err(|e| {
            // Say which variable set the URL when the environment did (as the loader does).
            let from_env = std::env::var(crate::config::REMOTE_URL_ENV).is_ok_and(|v| v == url);
            if from_env {
                e.with("set_by", crate::config::REMOTE_URL_ENV)
            } else {
                e
            }
        })
}

/// The store `remote.url` names, for `scope`; `None` when it is unset.
pub fn connect(config: &Config, scope: &RemoteScope) -> Result<Option<Arc<dyn RemoteStore>>> {
    let Some(url) = config.remote.url.as_deref() else {
        return Ok(None);
    };
    let backend = backend_for(url)?;
    backend.check(&config.remote)?;
    backend.connect(config, scope).map(Some)
}

/// `memory://NAME`: an in-process [`MemoryRemoteStore`] whose values every store of this process
/// with the same `NAME` shares (as instances share a server), kept until the process ends.
/// Nothing else of `[remote]` but the timeouts applies (no TLS, no secret: the values never
/// leave the process).
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryRemote;

/// The longest `NAME` of a `memory://NAME` URL.
pub const MAX_MEMORY_NAME: usize = 256;

impl MemoryRemote {
    fn name_of(url: &str) -> Result<&str> {
        let name = url
            .trim()
            .split_once("://")
            .map_or("", |(_, rest)| rest)
            .trim_end_matches('/');
        if name.len() > MAX_MEMORY_NAME
            || name
                .chars()
                .any(|c| !(c.is_ascii_alphanumeric() || "-_.".contains(c)))
        {
            return Err(Error::invalid_config(
                "remote.url",
                url,
                format!(
                    "memory://NAME takes a name of at most {MAX_MEMORY_NAME} letters, digits, '-', '_' or '.'"
                ),
            ));
        }
        Ok(name)
    }

    /// The values of the stores named `name` in this process.
    fn data(name: &str) -> MemoryRemoteData {
        static STORES: OnceLock<Mutex<HashMap<String, MemoryRemoteData>>> = OnceLock::new();
        STORES
            .get_or_init(Default::default)
            .lock()
            .entry(name.to_string())
            .or_default()
            .clone()
    }
}

impl RemoteBackend for MemoryRemote {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn schemes(&self) -> &'static [&'static str] {
        &["memory"]
    }

    fn check(&self, remote: &RemoteConfig) -> Result<()> {
        let url = remote.url.as_deref().unwrap_or("memory://");
        Self::name_of(url)?;
        if let Some((key, _)) = remote.tls_file_settings().into_iter().next() {
            return Err(Error::invalid_config(
                key,
                url,
                "an in-process memory:// store has no TLS",
            ));
        }
        Ok(())
    }

    fn connect(&self, config: &Config, scope: &RemoteScope) -> Result<Arc<dyn RemoteStore>> {
        let url = config.remote.url.as_deref().unwrap_or("memory://");
        let data = Self::data(Self::name_of(url)?);
        Ok(Arc::new(MemoryRemoteStore::shared(
            scope.clone(),
            data,
            Arc::default(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_finds_its_store_by_scheme_or_is_refused_by_name() {
        assert_eq!(backend_for("memory://plan").unwrap().name(), "memory");
        assert_eq!(backend_for("MEMORY://plan").unwrap().name(), "memory");
        let e = backend_for("s3://bucket/prefix").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(
            e.to_string().contains("s3://") && e.to_string().contains("memory://"),
            "{e}"
        );
        let e = backend_for("memory://bad name").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        let e = backend_for("no-scheme").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        #[cfg(feature = "redis")]
        assert_eq!(backend_for("redis://h:1").unwrap().name(), "redis");
        #[cfg(not(feature = "redis"))]
        assert_eq!(
            backend_for("redis://h:1").unwrap_err().kind(),
            ErrorKind::Unsupported
        );
    }

    #[test]
    fn memory_stores_of_one_name_share_their_values() {
        use crate::identity::HashAlgorithm;
        let scope = RemoteScope::new("m", 4, 1, 8, HashAlgorithm::Sha256).unwrap();
        let mut config = Config::default();
        config.remote.url = Some("memory://shared-test".into());
        let a = connect(&config, &scope).unwrap().unwrap();
        let b = connect(&config, &scope).unwrap().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        a.put(0, &[(7, &[1u8; 8][..])], deadline).unwrap();
        assert_eq!(b.lookup_prefix(&[7], deadline).unwrap(), 1);
        config.remote.url = Some("memory://other-test".into());
        let c = connect(&config, &scope).unwrap().unwrap();
        assert_eq!(c.lookup_prefix(&[7], deadline).unwrap(), 0);
    }
}

#[cfg(all(test, feature = "redis"))]
mod redis_tests {
    use super::*;

    /// Redis's own checks, through the registry: its URL forms, and TLS files only with a TLS
    /// URL (a plain URL would silently ignore them).
    #[test]
    fn redis_urls_and_tls_files_are_checked_by_the_redis_backend() {
        let check_url = |url: &str| {
            let mut c = Config::default();
            c.remote.url = Some(url.into());
            check(&c)
        };
        for ok in [
            "redis://127.0.0.1:6379",
            "redis://localhost",
            "redis://:pw@h:1/3",
            "rediss://user:pw@cache.example.com:6380/0",
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000",
            "rediss+cluster://u:p@a:1,b:2",
        ] {
            check_url(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (bad, why) in [
            ("http://h:1", "no store in this build serves `http://`"),
            ("redis://", "host"),
            ("redis://h:0", "port"),
            ("redis://h:99999", "port"),
            ("redis://h:1,g:2", "cluster scheme"),
            ("redis://h:1/x", "database"),
            ("redis+cluster://a:1,,b:2", "host 2"),
        ] {
            let e = check_url(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}");
            assert!(e.to_string().contains(why), "{bad}: {e}");
            assert!(e.to_string().contains("remote.url"), "{bad}: {e}");
        }
        let host = "b".repeat(300);
        let e = check_url(&format!("redis://{host}:6379/0")).unwrap_err();
        assert!(e.to_string().contains("253 characters"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let mut c = Config::default();
        c.remote.url = Some("redis://h:1".into());
        c.remote.tls_ca_file = Some(ca.clone());
        let e = check(&c).unwrap_err();
        assert!(
            e.to_string().contains("remote.tls_ca_file") && e.to_string().contains("rediss://"),
            "{e}"
        );
        c.remote.url = Some("rediss://h:1".into());
        check(&c).unwrap();
        c.remote.url = Some("memory://x".into());
        assert!(check(&c).unwrap_err().to_string().contains("no TLS"));
    }
}
