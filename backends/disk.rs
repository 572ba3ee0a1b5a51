//! Disk backend (placeholder)
