//! The connector protocol: a leader beside the engine's scheduler decides which blocks to match,
//! load and store; workers in the GPU processes execute those decisions on their tiers.
//!
//! * [`adapter`] — what the leader needs from a scheduler ([`SchedulerAdapter`]), and the
//!   [`Engine`] that bundles an adapter with its two sides' init modes;
//! * [`barrier`] — [`InitMode`] ([`Blocking`], [`NonBlocking`]) and the two-step start-up
//!   barrier (run by the leader's and the worker's constructors; its functions are crate-private);
//! * [`groups`] — KV-cache groups (sliding-window and full layers) and their attention kinds;
//! * [`leader`] — the scheduler side (matching, offload, completion handling);
//! * [`lifecycle`] — the request state machine;
//! * [`metadata`] — the per-iteration metadata and its operations;
//! * [`metrics`] — counters exposed in Prometheus text format; [`metrics_server`] serves them
//!   over HTTP (`tcp.metrics_addr`);
//! * [`remote`] — the remote (G4) tier: the [`RemoteStore`](remote::RemoteStore) trait of a block
//!   store shared by several instances, and each load's and write's view of it; [`store_health`]
//!   — the store's states (healthy, slow, unavailable) from a window of outcomes;
//! * [`tcp`] — the network transport: leader and workers in separate processes (its frames are
//!   crate-private; its settings are [`TcpConfig`](crate::config::TcpConfig));
//! * [`transport`] — leader/worker messages and the in-process transport;
//! * [`worker`] — the GPU-process side (with two private parts: the load fence, which keeps an
//!   abandoned load's late I/O off the device, and the outbox of completions to the leader).

pub mod adapter;
pub mod barrier;
mod fence;
pub mod groups;
pub mod leader;
pub mod lifecycle;
pub mod metadata;
pub mod metrics;
pub mod metrics_server;
mod outbox;
pub mod remote;
pub mod store_health;
pub mod tcp;
pub mod transport;
pub mod worker;

pub use adapter::{Engine, SchedulerAdapter};
pub use barrier::{Blocking, InitMode, NonBlocking};

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// An engine's request id. TensorRT-LLM uses integers, vLLM strings; both map to this.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for RequestId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        RequestId(Arc::from(s))
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        RequestId(Arc::from(s))
    }
}

impl From<u64> for RequestId {
    fn from(v: u64) -> Self {
        RequestId(Arc::from(v.to_string()))
    }
}
