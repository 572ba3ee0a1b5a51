//! A request as the simulated engine tracks it: its tokens (prompt, then what the model
//! generated), their rolling prefix hashes, its device blocks and where it is in its life.
//!
//! Invariant: `prefix[k]` is the rolling hash of `tokens[..=k]` ([`Req::push_token`] keeps them in
//! step); the model's KV for token `k` is a function of `prefix[k]` alone.

use super::report::RequestReport;
use super::workload::{prefix_hash_step, PREFIX_HASH_SEED};

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Arrived (or put back): waits for admission.
    Waiting,
    /// Admitted; its connector load is in flight.
    Loading,
    /// In the running batch.
    Running,
    /// Finished; the connector still holds its blocks (saving).
    Held,
    /// Finished and released.
    Done,
}

/// One request of the replay.
pub struct Req {
    /// The workload's id (vLLM's request id).
    pub id: String,
    /// Its index in the workload (TensorRT-LLM's numeric request id).
    pub num_id: u64,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Rolling hash of each token prefix.
    pub prefix: Vec<u64>,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Tokens generated so far.
    pub generated: usize,
    /// Tokens whose KV is on the device (computed, loaded or found in the device cache).
    pub computed: usize,
    /// Device blocks of each KV-cache group, in token order; every group's table has one entry
    /// per block position (the null block where a sliding window keeps none).
    pub blocks: Vec<Vec<usize>>,
    /// Where it is.
    pub phase: Phase,
    /// Engine step of its arrival.
    pub arrival: u64,
    /// Simulated time of its arrival, µs.
    pub arrival_clock_us: f64,
    /// Simulated time of its first token, µs.
    pub first_token_us: Option<f64>,
    /// Tokens loaded by the current admission: (first block, blocks).
    pub loading: Option<(usize, usize)>,
    /// The engine told the connector about it since its last admission (vLLM: new vs cached
    /// request; a request not yet announced is never a preemption victim).
    pub announced: bool,
    /// Its load finished: it rejoins the batch without a new match.
    pub loaded: bool,
    /// Tokens already reported to the connector (TensorRT-LLM's `RequestData`).
    pub sent_tokens: usize,
    /// Blocks already reported to the connector.
    pub sent_blocks: usize,
    /// Its figures.
    pub report: RequestReport,
}

impl Req {
    /// Block positions in its tables (the same in every group).
    pub fn table_len(&self) -> usize {
        self.blocks.first().map_or(0, Vec::len)
    }

    /// Appends a token and its prefix hash.
    pub fn push_token(&mut self, t: u32) {
        let h = self.prefix.last().copied().unwrap_or(PREFIX_HASH_SEED);
        self.tokens.push(t);
        self.prefix.push(prefix_hash_step(h, t));
    }
}
