//! Storage backends: where block bytes live.
//!
//! * [`memory`] — page-aligned host RAM (always built);
//! * [`disk`] — one preallocated file per tier, O_DIRECT where possible (always built).

pub mod disk;
pub mod memory;
