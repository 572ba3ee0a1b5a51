//! What a replay is asked to do besides the workload: the engine, the model's shape, the device,
//! the batch and chunk sizes, the connector's configuration, the ranks; and the checks that turn
//! them into block dimensions.

use std::sync::Arc;

use kvbm_connector::config::Config;
use kvbm_connector::connector::groups::{AttentionKind, KvCacheGroups};
use kvbm_connector::connector::worker::TierFactory;
use kvbm_connector::error::{Error, ErrorKind, Result};
use kvbm_connector::layout::LayoutDims;

use super::framework::Framework;
use super::rank::DeviceKind;
use super::workload::{request_tokens, TraceRequest, MAX_ARRIVAL, MAX_REQUESTS};

/// Default of `--max-waiting-tokens`: 2^24 tokens, the largest request; about 200 MB of waiting
/// requests ([`WAITING_TOKEN_BYTES`] each).
pub const MAX_WAITING_TOKENS: usize = 1 << 24;

/// Bytes a token of a request costs the replay while the request is in the engine (waiting,
/// running or finishing): the token id (4) and its rolling prefix hash (8).
pub const WAITING_TOKEN_BYTES: usize = 12;

/// Shape of the simulated model's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ModelShape {
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

/// Everything a replay needs besides the workload.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Engine to imitate.
    pub framework: Framework,
    /// Tokens per block.
    pub block_size: usize,
    /// Device blocks.
    pub device_blocks: usize,
    /// Requests running at once.
    pub max_batch: usize,
    /// Prompt tokens computed per step (the chunked-prefill budget).
    pub chunk_tokens: usize,
    /// The engine's own on-device prefix reuse.
    pub device_prefix_cache: bool,
    /// Simulated compute cost per prompt token, in microseconds.
    pub prefill_us_per_token: f64,
    /// The model's KV shape.
    pub model: ModelShape,
    /// Connector configuration (tier sizes, disk directory, hash, ...).
    pub config: Config,
    /// Show a progress line on stderr.
    pub progress: bool,
    /// Tensor-parallel ranks (each a worker process when more than 1).
    pub tp: usize,
    /// Fault injection: kill this rank's process at this step (multi-process runs).
    pub kill: Option<(usize, u64)>,
    /// What backs the device cache (host memory, or a real GPU with feature `cuda`).
    pub device: DeviceKind,
    /// One request at a time: each arrives once the previous one is done (arrivals ignored).
    pub sequential: bool,
    /// Steps take their simulated time in real time (see `kvbm replay --pace`).
    pub pace: bool,
    /// The model's KV-cache groups, one attention kind each (`kvbm replay --layer-groups`, or
    /// `--sliding-window` for one sliding group): `[Full]` for a plain model. Each group has its
    /// own block table over the shared device pool (vLLM's hybrid manager, TensorRT-LLM's layer
    /// groups in one pool), and its own KV bytes.
    pub groups: Vec<AttentionKind>,
    /// The factory of the tiers (and of the shared remote store) of this replay's leader and
    /// worker, instead of the standard one (`kvbm sweep --instances`: the fleet's shared store).
    /// Single-process replays only.
    pub tiers: Option<Arc<dyn TierFactory>>,
    /// Most tokens the requests waiting for admission hold at once (`kvbm replay
    /// --max-waiting-tokens`): a request due while the waiting ones hold more stays in the
    /// workload, unread, until they drain (its TTFT still counts from its arrival). Always at
    /// least one request waits, whatever its size.
    pub max_waiting_tokens: usize,
}

fn sim_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, msg)
}

impl SimOptions {
    /// Checks the options and the model's block dimensions (of the whole model, all ranks).
    pub fn model_dims(&self) -> Result<LayoutDims> {
        if self.block_size == 0
            || self.device_blocks == 0
            || self.max_batch == 0
            || self.chunk_tokens == 0
            || self.tp == 0
        {
            return Err(sim_err(
                "block size, device blocks, max batch, chunk tokens and tp must be at least 1",
            ));
        }
        if self.max_waiting_tokens == 0 {
            return Err(sim_err("--max-waiting-tokens must be at least 1")
                .with("flag", "--max-waiting-tokens"));
        }
        // Between 1 and MAX_KV_CACHE_GROUPS groups, no window of 0 tokens (named by group).
        KvCacheGroups::new(self.groups.clone()).map_err(|e| e.with("flag", "--layer-groups"))?;
        if !(self.prefill_us_per_token.is_finite() && self.prefill_us_per_token >= 0.0) {
            return Err(sim_err("prefill_us_per_token must be a number >= 0"));
        }
        let m = self.model;
        if m.kv_heads % self.tp != 0 {
            return Err(sim_err(format!(
                "{} KV heads cannot be split evenly over {} ranks",
                m.kv_heads, self.tp
            )));
        }
        let dims = LayoutDims {
            num_layers: m.layers,
            outer_dim: 2,
            page_size: self.block_size,
            inner_dim: m.kv_heads.saturating_mul(m.head_dim),
            dtype_bytes: m.dtype_bytes,
        };
        dims.validate()?;
        Ok(dims)
    }

    /// The block dimensions of one rank's shard (KV heads split evenly).
    pub fn shard_dims(&self) -> Result<LayoutDims> {
        let d = self.model_dims()?;
        Ok(LayoutDims {
            inner_dim: d.inner_dim / self.tp,
            ..d
        })
    }

    /// Checks a workload against the limits and the device before anything is started: a device
    /// whose bytes are addressable, at most [`MAX_REQUESTS`] requests, each arriving by
    /// [`MAX_ARRIVAL`] and within
    /// [`MAX_REQUEST_TOKENS`](super::workload::MAX_REQUEST_TOKENS) and the device's blocks (all
    /// arithmetic checked). Errors name the request and the field.
    pub fn check_workload(&self, workload: &[TraceRequest]) -> Result<()> {
        if workload.len() > MAX_REQUESTS {
            return Err(sim_err(format!(
                "{} requests; at most {MAX_REQUESTS} in one replay",
                workload.len()
            )));
        }
        let bytes_per_block = self.shard_dims()?.bytes_per_block();
        let device_bytes = self.device_blocks.checked_mul(bytes_per_block);
        if device_bytes.is_none_or(|b| isize::try_from(b).is_err()) {
            return Err(sim_err(format!(
                "--device-blocks {} of {bytes_per_block} bytes exceed what one process can address",
                self.device_blocks
            ))
            .with("flag", "--device-blocks"));
        }
        for r in workload {
            self.check_request(r)?;
        }
        Ok(())
    }

    /// KV-cache groups (at least 1).
    pub fn n_groups(&self) -> usize {
        self.groups.len().max(1)
    }

    /// True when some group slides: its table holds the null block before the window.
    pub fn windowed(&self) -> bool {
        self.groups
            .iter()
            .any(|k| matches!(k, AttentionKind::SlidingWindow { .. }))
    }

    /// Blocks of group `g` before the window of `computed` tokens (vLLM's
    /// `get_num_skipped_tokens`: `computed - window + 1` tokens, whole blocks of them); 0 for a
    /// full-attention group.
    pub fn skipped_blocks(&self, g: usize, computed: usize) -> usize {
        match self.groups.get(g) {
            Some(AttentionKind::SlidingWindow { tokens }) => {
                (computed + 1).saturating_sub(*tokens) / self.block_size.max(1)
            }
            _ => 0,
        }
    }

    /// Checks one request against the limits and the device: arriving by [`MAX_ARRIVAL`],
    /// within [`MAX_REQUEST_TOKENS`](super::workload::MAX_REQUEST_TOKENS) and the device's
    /// blocks (all arithmetic checked). Errors name the request and the field.
    pub fn check_request(&self, r: &TraceRequest) -> Result<()> {
        let block_size = self.block_size.max(1);
        let capacity = self.device_blocks.saturating_mul(block_size);
        if r.arrival > MAX_ARRIVAL {
            return Err(sim_err(format!(
                "request {:?}: arrival {} is past step {MAX_ARRIVAL}",
                r.id, r.arrival
            ))
            .with("field", "arrival"));
        }
        let tokens = request_tokens(r.prompt.len(), r.max_tokens)
            .map_err(|e| sim_err(format!("request {:?}: {e}", r.id)).with("field", "max_tokens"))?;
        if tokens > capacity {
            return Err(sim_err(format!(
                "request {:?} needs {} device blocks but the device has {}; raise --device-blocks",
                r.id,
                tokens.div_ceil(block_size),
                self.device_blocks
            )));
        }
        Ok(())
    }
}
