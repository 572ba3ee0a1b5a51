//! The [`RemoteStore`] conformance suite (`tests/conformance/remote.rs`) on every store this
//! crate has: the in-process `memory://` store, and Redis / Valkey standalone, as a 3-node
//! cluster and over TLS (feature `redis`; the servers of `scripts/redis-servers.sh`, which
//! scripts/test.sh starts: a missing server prints `SKIP`, and fails under `CI=true`). Each store
//! is built through the storage backends' registry from its URL, as the workers build it.
//!
//! A new store passes the same checks: one `StoreMaker` and one `remote_conformance!` line.

#[macro_use]
#[allow(dead_code, unused_macros, unused_imports)]
mod conformance;

use std::sync::Arc;

use conformance::remote::StoreMaker;
use kvbm_connector::backends::remote;
use kvbm_connector::connector::remote::{RemoteScope, RemoteStore};
use kvbm_connector::Config;

/// A store built from `url` through the registry (`backends::remote::connect`).
fn from_url(url: &str, scope: &RemoteScope, tls_dir: Option<&str>) -> Arc<dyn RemoteStore> {
    let mut config = Config::default();
    config.remote.url = Some(url.to_string());
    if let Some(dir) = tls_dir {
        config.remote.tls_ca_file = Some(std::path::Path::new(dir).join("ca.pem"));
    }
    remote::connect(&config, scope)
        .unwrap_or_else(|e| panic!("{url}: {e}"))
        .unwrap_or_else(|| panic!("{url}: no store"))
}

/// `memory://conformance`: every store of this process with that name shares one map.
struct Memory;

impl StoreMaker for Memory {
    fn make(&self, scope: &RemoteScope) -> Option<Arc<dyn RemoteStore>> {
        Some(from_url("memory://conformance", scope, None))
    }
}

remote_conformance!(memory, Memory);

/// Redis / Valkey at the URL in the variable `var` (skipped, or failed under `CI=true`, when
/// it is unset), with the test CA of `KVBM_TEST_REDIS_TLS_DIR` for a TLS URL.
#[cfg(feature = "redis")]
struct Redis {
    var: &'static str,
}

#[cfg(feature = "redis")]
mod redis_server;

#[cfg(feature = "redis")]
impl StoreMaker for Redis {
    fn make(&self, scope: &RemoteScope) -> Option<Arc<dyn RemoteStore>> {
        let url = match std::env::var(self.var) {
            Ok(u) if !u.is_empty() => u,
            _ => {
                redis_server::skip(&format!(
                    "{} is not set (run under scripts/redis-servers.sh)",
                    self.var
                ));
                return None;
            }
        };
        let tls_dir = std::env::var("KVBM_TEST_REDIS_TLS_DIR").ok();
        let tls = url.starts_with("rediss");
        Some(from_url(
            &url,
            scope,
            tls.then_some(tls_dir.as_deref()).flatten(),
        ))
    }
}

#[cfg(feature = "redis")]
remote_conformance!(
    redis_standalone,
    Redis {
        var: "KVBM_TEST_REDIS_URL"
    }
);
#[cfg(feature = "redis")]
remote_conformance!(
    redis_cluster,
    Redis {
        var: "KVBM_TEST_REDIS_CLUSTER_URL"
    }
);
#[cfg(feature = "redis")]
remote_conformance!(
    redis_tls,
    Redis {
        var: "KVBM_TEST_REDIS_TLS_URL"
    }
);
