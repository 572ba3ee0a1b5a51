//! The `nixl` backend (feature `nixl`): block I/O through NVIDIA's NIXL transfer library.
//!
//! NIXL moves bytes between registered memory and storage through plugins. This module uses
//! **POSIX** for the disk tier: [`NixlDiskTier`] stores blocks in the same checksummed slot file
//! as the built-in [`DiskTier`] (one shared implementation of the file's creation,
//! preallocation, O_DIRECT probe, removal, slots and checksums), but its reads and writes are
//! NIXL transfers between registered host memory and the registered file. (The shared G4 tier
//! across instances is the remote store, `connector::remote`; the UCX peer read of another
//! instance's host tier, discovered through a shared directory, was removed with issue 17.)
//!
//! Each worker holds one [`NixlAgent`], with its host tiers registered
//! ([`NixlAgent::register_host_tier`]): buffers inside registered memory go to NIXL as they are;
//! any other buffer goes through a small pool of registered bounce buffers.
//!
//! # Loading
//!
//! nixl-sys is built with its `stub-api` feature: it has no link-time dependency on NIXL and
//! `dlopen`s `libnixl_capi.so` at its first call, **aborting the process** when that fails. So
//! nothing here calls nixl-sys before [`probe`] has loaded the library itself, checked that it has
//! the C API symbols nixl-sys calls, and found the plugin folder; a missing or broken installation
//! is an [`ErrorKind::Unsupported`] error naming the library, the folders searched and the
//! variables read, never an abort. Where NIXL is looked for:
//!
//! * the library: `$KVBM_NIXL_LIB_DIR/libnixl_capi.so` when [`LIB_DIR_ENV`] is set, otherwise
//!   `libnixl_capi.so` by name through the dynamic loader (`LD_LIBRARY_PATH`, then the system's
//!   cache);
//! * the plugins: `$NIXL_PLUGIN_DIR` when set (NIXL reads it), otherwise `plugins/` beside the
//!   library (NIXL's own default).
//!
//! `scripts/nixl-env.sh` fetches the PyPI wheel `nixl-cu12`, which ships both, and sets the
//! variables; see `docs/nixl.md`.
//!
//! NIXL loads a plugin when the first backend of it is created: the disk tier (POSIX) loads no
//! UCX. Before the first UCX backend, UCX's InfiniBand modules are kept out unless the user asked
//! for RDMA ([`UCX_MODULES_ENV`]; `ucx.rs`): with the wheel on a host with the system's RDMA
//! libraries they mix two copies of libnl into the process, which then crashes at exit.
//!
//! # Invariants
//!
//! * registered memory outlives its registration: the agent keeps every registered tier alive
//!   and deregisters before releasing it; a tier's bounce buffers are deregistered before they
//!   are freed;
//! * a call returns only when NIXL reports its transfer complete or failed, so no transfer
//!   touches a caller's buffer after the call returned (there is no time-out for that reason: a
//!   slow transfer is logged every [`SLOW_TRANSFER_LOG`], and UCX's peer error handling fails a
//!   transfer whose peer died);
//! * [`NixlDiskTier`] keeps the built-in disk tier's guarantees: a block never written is
//!   [`ErrorKind::NotFound`], a checksum mismatch is [`ErrorKind::Corrupt`], writers of a block
//!   are serialised against its readers.
//!
//! # Files
//!
//! * `probe.rs` — finding and loading the library and its plugins ([`probe`], [`NixlInfo`]);
//! * `agent.rs` — [`NixlAgent`]: backends, registrations, transfers, registered bounce buffers;
//! * `disk.rs` — [`NixlDiskTier`] (POSIX);
//! * `ucx.rs` — which UCX modules a UCX backend may load ([`UCX_MODULES_ENV`]);
//! * `worker.rs` — what a worker builds on NIXL ([`worker_parts`]).
//!
//! [`DiskTier`]: crate::backends::disk::DiskTier
//! [`ErrorKind::Unsupported`]: crate::ErrorKind::Unsupported
//! [`ErrorKind::NotFound`]: crate::ErrorKind::NotFound
//! [`ErrorKind::Corrupt`]: crate::ErrorKind::Corrupt

mod agent;
mod disk;
mod probe;
mod ucx;
mod worker;

pub use agent::{NixlAgent, SLOW_TRANSFER_LOG};
pub use disk::NixlDiskTier;
pub use probe::{probe, NixlBackend, NixlInfo, CAPI_LIBRARY, LIB_DIR_ENV, PLUGIN_DIR_ENV};
pub use ucx::{UCX_MODULES_ENV, UCX_MODULES_WITHOUT_RDMA, UCX_TLS_ENV};
pub use worker::{worker_parts, WorkerParts};
