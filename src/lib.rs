//! # kvbm-connector
//!
//! A framework-agnostic KV-cache block manager: it offloads full KV blocks from an inference
//! engine's GPU memory to host memory and disk, and onboards them back when a later request
//! shares a prefix, so the engine skips recomputing it.
//!
//! The core (this `src/` tree) knows nothing of any engine:
//!
//! * [`identity`] — token blocks and the chained sequence hash that keys them;
//! * [`layout`] — the [`KvLayout`] trait: where a block's bytes sit (fully contiguous / layer separate);
//! * [`tier`] — the [`StorageTier`] trait (G1 device, G2 host, G3 disk, G4 remote);
//! * [`pool`] — per-tier block pools: free, in use, registered (reusable), LRU eviction, prefix match;
//! * [`transfer`] — async block copies between tiers with layout conversion and checksums;
//! * [`config`] — one configuration struct from a TOML file and environment variables;
//! * [`connector`] — the protocol: leader (scheduler side), worker (GPU side), request lifecycle,
//!   per-iteration metadata, start-up barrier, the transport traits, metrics;
//! * [`tcp`] — the network transport: leader and workers in separate processes (the wire
//!   protocol, the rendezvous on one machine);
//! * [`metrics_server`] — the counters over HTTP (`GET /metrics`);
//! * [`error`] — the one error type;
//! * [`harness`] — one leader and one worker in one process, a scratch directory, stand-in KV
//!   and its byte-for-byte check: what an adapter's example or test needs besides the adapter.
//!
//! Storage lives in [`backends`] (memory and disk always built); engine adapters in `frameworks`
//! (behind features). The `kvbm` tool (`tool/`) is a separate binary built on this public API
//! alone; the Python bindings are a private module of this crate (behind `python`), because
//! maturin builds the library itself as the extension module.
//!
//! ## Where to start
//!
//! An integrator uses the root re-exports: an [`Engine`] (one per inference engine: its
//! [`SchedulerAdapter`] and its two sides' [`InitMode`]s), a [`Leader`] beside the scheduler, a
//! [`Worker`] per GPU process, [`RequestId`], [`Config`], [`Error`]. An adapter author for a new
//! engine imports [`prelude`]. `docs/adapters.md` walks through both.
//!
//! ## Features
//!
//! | feature  | what it adds | extra dependencies |
//! |----------|--------------|--------------------|
//! | *(none)* | core, `memory` and `disk` backends | none beyond the lean core |
//! | `trtllm` | TensorRT-LLM adapter (`frameworks::trtllm`) | — |
//! | `vllm`   | vLLM adapter (`frameworks::vllm`) | — |
//! | `cuda`   | GPU device and pinned-host tiers | cudarc (loaded at run time) |
//! | `nixl`   | NIXL transfer backend (POSIX disk, UCX remote) | nixl-sys (loaded at run time) |
//! | `redis`  | remote (G4) tier on Redis / Valkey, standalone or cluster (`backends::redis`) | redis, rustls, hmac |
//! | `python` | the Python extension module (`kvbm_connector`; enables `redis`) | pyo3 |
//! | `cli` (default) | the `kvbm` binary (`tool/`, built on this public API; enables `trtllm`, `vllm`, `redis`) | clap |
//!
//! ```toml
//! [dependencies]
//! # the lean core plus the vLLM adapter, without the CLI
//! kvbm-connector = { version = "0.1", default-features = false, features = ["vllm"] }
//! ```
//!
//! `cuda` (GPU device and pinned host tiers, `backends::cuda`) and `nixl` (NIXL POSIX disk and UCX
//! remote tiers, `backends::nixl`) load their native libraries at run time: both build without
//! them, and a missing library is an error at run time, never an abort. `python` builds the
//! Python extension module (with maturin). See `docs/cuda.md`, `docs/nixl.md`, `docs/python.md`.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod config;
pub mod connector;
pub mod error;
pub mod harness;
pub mod identity;
pub mod layout;
#[cfg(any(feature = "cli", feature = "python"))]
pub mod log;
mod memcopy;
pub mod metrics_server;
pub mod page_store;
pub mod pool;
pub mod tcp;
pub mod tier;
pub mod transfer;

#[path = "../backends/mod.rs"]
pub mod backends;

#[cfg(any(feature = "trtllm", feature = "vllm"))]
#[path = "../frameworks/mod.rs"]
pub mod frameworks;

#[cfg(feature = "python")]
pub mod python;

pub use config::Config;
pub use connector::adapter::{Engine, SchedulerAdapter};
pub use connector::barrier::{Blocking, InitMode, NonBlocking};
pub use connector::leader::Leader;
pub use connector::worker::Worker;
pub use connector::RequestId;
pub use error::{Error, ErrorKind, Result};
pub use identity::{BlockHasher, HashAlgorithm, Salt, SequenceHash, Token, TokenSequence};
pub use layout::{KvLayout, Layout, LayoutDims, LayoutKind};
pub use tier::{Capability, StorageTier, StorageTierExt, TierKind};

/// What an adapter author for a new engine needs, in one import (`use kvbm_connector::prelude::*;`):
/// the engine definition, the leader's and worker's calls and their arguments, custom operation
/// kinds, the device cache as a tier, and the in-process transport. `docs/adapters.md` and
/// `examples/toy_engine.rs` use exactly these.
pub mod prelude {
    pub use crate::backends::memory::MemoryTier;
    pub use crate::backends::StandardTiers;
    pub use crate::connector::adapter::{ScheduledRequest, SchedulerStep};
    pub use crate::connector::leader::RequestInfo;
    pub use crate::connector::metadata::{
        BlockTransfer, ConnectorMetadata, Direction, Operation, OperationId,
    };
    pub use crate::connector::transport::{in_process, Completion};
    pub use crate::layout::BlockOrder;
    pub use crate::{
        Blocking, Config, Engine, Error, ErrorKind, InitMode, Layout, LayoutDims, Leader,
        NonBlocking, RequestId, Result, SchedulerAdapter, StorageTier, StorageTierExt, TierKind,
        Token, Worker,
    };
}

#[cfg(test)]
mod send_sync {
    fn is_send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_sync() {
        is_send_sync::<crate::Error>();
        is_send_sync::<crate::backends::memory::MemoryTier>();
        is_send_sync::<std::sync::Arc<dyn crate::StorageTier>>();
        is_send_sync::<crate::Worker>();
        is_send_sync::<crate::Config>();
        is_send_sync::<crate::RequestId>();
    }

    fn is_send<T: Send>() {}

    #[test]
    fn the_leader_is_send() {
        // A leader lives beside the scheduler and may move to its thread.
        is_send::<crate::Leader<crate::connector::adapter::ScheduledTokens>>();
    }
}
