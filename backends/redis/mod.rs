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
