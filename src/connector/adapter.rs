//! What the leader needs from a scheduler each iteration, and how each engine says it.
//!
//! Engines describe an iteration differently: vLLM says how many tokens each request will compute
//! this step (`num_scheduled_tokens`); the TensorRT-LLM version the project targets says only up to
//! which position each request *has been* computed (`computed_position`). A [`SchedulerAdapter`]
//! turns either into the one number the leader offloads by: how many of the request's tokens have
//! their KV on the device, final, once this iteration's forward pass has run. The leader offloads
//! every block that is full and lies below that count, each exactly once.

use serde::{Deserialize, Serialize};

use crate::connector::barrier::InitMode;
use crate::connector::metadata::ConnectorMetadata;
use crate::connector::transport::Completion;
use crate::connector::RequestId;
use crate::error::{Error, Result};
use crate::identity::Token;

/// One request the engine scheduled this iteration, in engine-neutral terms.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledRequest {
    /// The request.
    pub request_id: RequestId,
    /// Tokens of the request newly reported by the engine (may be empty).
    pub new_tokens: Vec<Token>,
    /// Index in the request of `new_tokens[0]`. When given, tokens the leader already knows are
    /// skipped and a gap (tokens the leader never saw) stops keying, so keys can never shift; when
    /// `None`, `new_tokens` are taken to follow the tokens the leader knows.
    pub first_token_index: Option<usize>,
    /// Device blocks appended to the request's block list.
    pub new_block_ids: Vec<usize>,
    /// True when `new_block_ids` *replaces* the block list (vLLM: resumed from preemption).
    pub replace_block_ids: bool,
    /// Tokens with KV already on the device before this iteration.
    pub num_computed_tokens: usize,
    /// Tokens the engine computes in this iteration (vLLM).
    pub num_scheduled_tokens: Option<usize>,
    /// Position up to which the request's KV is computed (TensorRT-LLM).
    pub computed_position: Option<usize>,
}

impl Default for RequestId {
    fn default() -> Self {
        RequestId::from("")
    }
}

/// One engine iteration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerStep {
    /// Requests scheduled to compute this iteration.
    pub requests: Vec<ScheduledRequest>,
    /// Requests the engine preempted (their device blocks are freed).
    pub preempted: Vec<RequestId>,
}

/// Turns an engine's view of an iteration into what the leader offloads by.
///
/// Implemented for the two engines here; a third engine implements it in its own crate (see
/// `examples/` and `docs/adapters.md`).
pub trait SchedulerAdapter: Send + 'static {
    /// A short name for logs and errors.
    fn name(&self) -> &'static str;

    /// Tokens of `request` whose KV is final on the device once this iteration's forward pass has
    /// run. Blocks wholly below this count may be offloaded.
    fn computed_after(&self, request: &ScheduledRequest) -> Result<usize>;

    /// Whether the stores an iteration's metadata submits read blocks computed in earlier
    /// iterations, after a forward pass in which the request moved on (offload by computed
    /// position). An engine frees a block that left a sliding window and may hand it to another
    /// request in that same iteration, so the leader then stores a windowed block only if it is
    /// still inside the window wherever the request can get to in that iteration. The default:
    /// no (the stores read what this iteration computed, before the engine frees anything).
    fn stores_trail_compute(&self) -> bool {
        false
    }

    /// Hook run on every metadata before it is encoded: an adapter may append operations of its
    /// own kinds. The default adds nothing.
    fn extend_metadata(&mut self, metadata: &mut ConnectorMetadata) -> Result<()> {
        let _ = metadata;
        Ok(())
    }

    /// Called once per rank for each completion of an operation whose id is custom
    /// ([`OperationId::custom`](crate::connector::metadata::OperationId::custom)). The default
    /// ignores it.
    fn on_custom_completion(&mut self, rank: usize, completion: &Completion) -> Result<()> {
        let _ = (rank, completion);
        Ok(())
    }
}

/// An engine as the connector sees it: the [`SchedulerAdapter`] its leader uses and how each of
/// its sides runs the start-up barrier.
///
/// Implemented once per engine (the vLLM and TensorRT-LLM adapters in `frameworks/`, the toy
/// engine in `examples/`). [`Leader::new`](crate::connector::leader::Leader::new) and
/// [`Worker::new`](crate::connector::worker::Worker::new) take the engine as a type parameter,
/// so the init modes are wired by the compiler from the engine's definition: no caller picks
/// them, and no caller can pick a pair that deadlocks its engine's start-up order.
///
/// ```no_run
/// use kvbm_connector::connector::adapter::ScheduledTokens;
/// use kvbm_connector::connector::transport::in_process;
/// use kvbm_connector::{Blocking, Config, Engine, Leader, NonBlocking};
///
/// struct MyEngine;
/// impl Engine for MyEngine {
///     type Adapter = ScheduledTokens;
///     type LeaderInit = Blocking;
///     type WorkerInit = NonBlocking;
/// }
/// let (lt, _workers) = in_process(1);
/// let _ = Leader::new::<MyEngine>(ScheduledTokens, Config::default(), 16, lt);
/// ```
///
/// A leader is built with its engine's adapter and no other:
///
/// ```compile_fail
/// use kvbm_connector::connector::adapter::{ComputedPosition, ScheduledTokens};
/// use kvbm_connector::connector::transport::in_process;
/// use kvbm_connector::{Blocking, Config, Engine, Leader, NonBlocking};
///
/// struct MyEngine;
/// impl Engine for MyEngine {
///     type Adapter = ScheduledTokens;
///     type LeaderInit = Blocking;
///     type WorkerInit = NonBlocking;
/// }
/// let (lt, _workers) = in_process(1);
/// let _ = Leader::new::<MyEngine>(ComputedPosition, Config::default(), 16, lt);
/// ```
pub trait Engine: 'static {
    /// The leader's adapter.
    type Adapter: SchedulerAdapter;
    /// How the leader runs the barrier ([`Blocking`](crate::connector::barrier::Blocking) when
    /// the engine builds its scheduler after the workers registered their caches).
    type LeaderInit: InitMode;
    /// How each worker runs the barrier.
    type WorkerInit: InitMode;
    /// Whether the engine accepts "not known yet, ask again later" from a match (vLLM: a
    /// `None` count from `get_num_new_matched_tokens`); the leader then never waits for a remote
    /// lookup ([`MatchResult::pending`](crate::connector::leader::MatchResult::pending)).
    /// Default: false (a remote lookup is bounded by `remote.lookup_timeout_ms`).
    const DEFERRED_MATCH: bool = false;
    /// The block id the engine puts in a request's block list where it keeps no block (vLLM's
    /// null block, id 0: the blocks a sliding-window layer no longer needs, and the positions
    /// before a sliding-window hit). The leader never loads into it, never stores from it, and
    /// never reports it failed; its tokens count as matched (the engine needs no data there).
    /// Default: none (every listed block is real).
    const PLACEHOLDER_BLOCK: Option<usize> = None;
}

/// vLLM: offload by scheduled tokens (`num_computed_tokens + num_scheduled_tokens`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ScheduledTokens;

impl SchedulerAdapter for ScheduledTokens {
    fn name(&self) -> &'static str {
        "scheduled-tokens"
    }

    fn computed_after(&self, r: &ScheduledRequest) -> Result<usize> {
        let scheduled = r.num_scheduled_tokens.ok_or_else(|| {
            Error::invalid_argument(format!(
                "request {} has no num_scheduled_tokens, which offload by scheduled tokens needs",
                r.request_id
            ))
            .with("request", &r.request_id)
        })?;
        r.num_computed_tokens.checked_add(scheduled).ok_or_else(|| {
            Error::invalid_argument("num_computed_tokens + num_scheduled_tokens overflows")
                .with("request", &r.request_id)
        })
    }
}

/// TensorRT-LLM: offload by computed position (blocks computed in earlier iterations; the blocks
/// of the final iteration are flushed when the request finishes).
#[derive(Debug, Clone, Copy, Default)]
pub struct ComputedPosition;

impl SchedulerAdapter for ComputedPosition {
    fn name(&self) -> &'static str {
        "computed-position"
    }

    fn stores_trail_compute(&self) -> bool {
        true
    }

    fn computed_after(&self, r: &ScheduledRequest) -> Result<usize> {
        r.computed_position.ok_or_else(|| {
            Error::invalid_argument(format!(
                "request {} has no computed_position, which offload by computed position needs",
                r.request_id
            ))
            .with("request", &r.request_id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_read_their_field() {
        let r = ScheduledRequest {
            request_id: "r".into(),
            num_computed_tokens: 16,
            num_scheduled_tokens: Some(20),
            computed_position: Some(31),
            ..Default::default()
        };
        assert_eq!(ScheduledTokens.computed_after(&r).unwrap(), 36);
        assert_eq!(ComputedPosition.computed_after(&r).unwrap(), 31);
        let bare = ScheduledRequest {
            request_id: "r".into(),
            ..Default::default()
        };
        assert!(ScheduledTokens.computed_after(&bare).is_err());
        assert!(ComputedPosition.computed_after(&bare).is_err());
    }
}
