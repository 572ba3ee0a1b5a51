//! The connector protocol: a leader beside the engine's scheduler decides which blocks to match,
//! load and store; workers in the GPU processes execute those decisions on their tiers.
//!
//! * [`adapter`] — what the leader needs from a scheduler ([`SchedulerAdapter`]), and the
//!   [`Engine`] that bundles an adapter with its two sides' init modes;
//! * [`barrier`] — [`InitMode`] ([`Blocking`], [`NonBlocking`]) and the three-step start-up
//!   barrier (run by the leader's and the worker's constructors; its functions are crate-private);
//! * [`groups`] — KV-cache groups (sliding-window and full layers) and their attention kinds;
//! * [`leader`] — the scheduler side: matching (across KV-cache groups too), offload (each
//!   iteration's metadata and its stores), completion handling, and the remote store's lookups
//!   and write-behind;
//! * [`lifecycle`] — the request state machine;
//! * [`metadata`] — the per-iteration metadata and its operations;
//! * [`metrics`] — counters exposed in Prometheus text format (served over HTTP by
//!   [`metrics_server`], at `tcp.metrics_addr`);
//! * [`remote`] — the remote (G4) tier: the [`RemoteStore`](remote::RemoteStore) trait of a block
//!   store shared by several instances, each load's and write's view of it, the leader's lookup
//!   thread and the in-process `memory://` store; [`store_health`] — the store's states
//!   (healthy, slow, unavailable) from a window of outcomes;
//! * [`transport`] — leader/worker messages, the transport traits and the in-process transport
//!   (the network one is [`tcp`], a module of its own);
//! * [`worker`] — the GPU-process side (with two private parts: the load fence, which keeps an
//!   abandoned load's late I/O off the device, and the outbox of completions to the leader).
//!
//! The TCP transport and the metrics server used to live here; they are top-level modules now
//! ([`crate::tcp`], [`crate::metrics_server`]), and `connector::tcp` and
//! `connector::metrics_server` stay as re-exports, so every path written against them still
//! resolves.

pub mod adapter;
pub mod barrier;
mod fence;
pub mod groups;
pub mod leader;
pub mod lifecycle;
pub mod metadata;
pub mod metrics;
mod outbox;
pub mod remote;
pub mod store_health;
pub mod transport;
pub mod worker;

/// The metrics server, now [`crate::metrics_server`]; this path stays for code written against it.
pub use crate::metrics_server;
/// The TCP transport, now [`crate::tcp`]; this path stays for code written against it.
pub use crate::tcp;

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
