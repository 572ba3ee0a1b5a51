//! The remote (G4) tier on Redis / Valkey (feature `redis`): a [`RemoteStore`] shared by every
//! instance that reaches the same server or cluster.
//!
//! * [`RedisUrl`] parses `remote.url` (`redis://`, `rediss://`, `redis+cluster://`,
//!   `rediss+cluster://`);
//! * [`RedisStore`] stores one value per block and rank under
//!   `kvbm:{<scope fingerprint>:<block key>}:<rank>`, each value a verified header (and an
//!   HMAC-SHA256 with a deployment secret) before the payload; see [`value`].
//!
//! Cluster routing uses hash tags: the braces put every rank's share of one block in one slot, so
//! a lookup asks one `EXISTS` per block (all ranks at once) on the node owning it, while blocks
//! spread over all slots and nodes. Per-key routing would cost one command per rank and block.
//!
//! See docs/deployment.md (sizing, eviction, security and the trust model).
//!
//! [`RemoteStore`]: crate::connector::remote::RemoteStore

mod store;
mod url;
pub mod value;

pub use store::{RedisOptions, RedisStore};
pub use url::{redact, RedisUrl, DEFAULT_PORT};

use std::sync::Arc;

use crate::config::{Config, RemoteConfig};
use crate::connector::remote::{RemoteScope, RemoteStore};
use crate::error::{Error, Result};

/// Redis / Valkey as a [`RemoteBackend`](super::remote::RemoteBackend): `redis://`,
/// `rediss://` (TLS), `redis+cluster://` and `rediss+cluster://` URLs ([`RedisUrl`]); the TLS
/// files (`remote.tls_*_file`) with a TLS URL only; the deployment secret, `remote.ttl_secs` and
/// `remote.io_timeout_ms` (the connection deadline).
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisBackend;

/// The URL schemes Redis / Valkey serves.
pub const SCHEMES: &[&str] = &["redis", "rediss", "redis+cluster", "rediss+cluster"];

impl super::remote::RemoteBackend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn schemes(&self) -> &'static [&'static str] {
        SCHEMES
    }

    fn check(&self, remote: &RemoteConfig) -> Result<()> {
        let Some(url) = remote.url.as_deref() else {
            return Ok(());
        };
        let parsed = RedisUrl::parse(url)?;
        // With a plain URL the TLS files would be silently ignored.
        if !parsed.tls {
            if let Some((key, path)) = remote.tls_file_settings().into_iter().next() {
                return Err(Error::invalid_config(
                    key,
                    path.display(),
                    "TLS files need a TLS remote.url (rediss:// or rediss+cluster://)",
                ));
            }
        }
        Ok(())
    }

    fn connect(&self, config: &Config, scope: &RemoteScope) -> Result<Arc<dyn RemoteStore>> {
        let url = config.remote.url.as_deref().unwrap_or_default();
        let options = RedisOptions {
            secret: config.remote.secret()?,
            ttl: config.remote.ttl(),
            connect_timeout: config.remote.io_timeout(),
            tls: config.remote.tls_files()?,
        };
        let store = RedisStore::connect(&RedisUrl::parse(url)?, scope.clone(), options)?;
        Ok(Arc::new(store))
    }
}
