//! Storage backends: where block bytes live.
//!
//! * [`memory`] — page-aligned host RAM (always built);
//! * [`disk`] — one preallocated file per tier, O_DIRECT where possible (always built);
//! * `nixl` — disk I/O through NIXL's POSIX plugin and remote host tiers over UCX (feature `nixl`).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod disk;
pub mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
