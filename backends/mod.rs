//! Storage backends: where block bytes live.
//!
//! * [`memory`] — page-aligned host RAM (always built);
//! * [`disk`] — one preallocated file per tier, O_DIRECT where possible (always built);
//! * `nixl` — disk I/O through NIXL's POSIX plugin and remote host tiers over UCX (feature `nixl`);
//! * [`remote`] — the remote (G4) tier's backends, chosen by `remote.url`'s scheme: an in-process
//!   `memory://` store (always built) and `redis` (below);
//! * `redis` — the remote (G4) tier on Redis / Valkey, standalone or cluster (feature `redis`);
//! * [`faults`] — a wrapper tier that fails, stalls or corrupts on a schedule (tests, the replay);
//! * [`standard`] — the [`TierFactory`](crate::connector::worker::TierFactory) that builds a
//!   worker's tiers from the configuration with the backends above ([`StandardTiers`]).
//!
//! The core (`src/`) names none of these: it defines the traits ([`StorageTier`](crate::StorageTier),
//! the tier factory, the remote-tier hooks) and the backends implement them.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod disk;
pub mod faults;
pub mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod persist;
#[cfg(feature = "redis")]
pub mod redis;
pub mod remote;
pub mod shutdown;
mod slot_file;
pub mod standard;

pub use standard::StandardTiers;
