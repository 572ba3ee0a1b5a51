//! What the simulated engine's scheduler process and its ranks say to each other, one request and
//! one answer at a time: a step (metadata, blocks to clobber, the KV computed), a verification of
//! onboarded blocks, the end of the run. [`RankDriver`] is the scheduler's side of it, whether the
//! rank is in its process or behind the engine channel.

use serde::{Deserialize, Serialize};

use kvbm_connector::error::Result;
use kvbm_connector::tier::TierKind;

/// KV the model computes for consecutive tokens of one device block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockWrite {
    /// Device block.
    pub block: usize,
    /// Slot (token index inside the block) of the first token.
    pub first_slot: usize,
    /// Prefix hash of each token written (the model's KV is a function of it).
    pub hashes: Vec<u64>,
}

/// One iteration for one rank, or a part of one: with `metadata` the rank binds it, clobbers
/// freed blocks, starts the loads and (with `forward`) runs the forward pass with its per-layer
/// hooks and `wait_for_save`; with `report` it then calls `get_finished`. vLLM sends both parts in
/// one command; TensorRT-LLM sends the metadata part (when its batch is not empty), lets the
/// scheduler finish requests, then the report part — alone in an iteration with nothing scheduled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCommand {
    /// The leader's metadata bytes; `None`: the engine built none this iteration.
    pub metadata: Option<Vec<u8>>,
    /// Whether the model runs a forward pass (after binding `metadata`).
    pub forward: bool,
    /// Whether the rank calls `get_finished` (last).
    pub report: bool,
    /// Freed device blocks to overwrite with junk once the metadata is bound.
    pub clobber: Vec<usize>,
    /// The KV computed this iteration.
    pub writes: Vec<BlockWrite>,
    /// Requests the engine reports finished (vLLM: all finished last step; TensorRT-LLM: those
    /// held for saving).
    pub finished: Vec<String>,
    /// TensorRT-LLM: requests that started loading.
    pub started_loading: Vec<String>,
}

/// One rank's answer to a [`StepCommand`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReply {
    /// Finished requests whose device blocks this rank no longer needs.
    pub released: Vec<String>,
    /// Requests whose loads finished on this rank.
    pub loaded: Vec<String>,
    /// Device blocks whose loads failed on this rank.
    pub load_errors: Vec<usize>,
}

/// Blocks to verify: (device block, prefix hash of each of its tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verify {
    /// The blocks.
    pub blocks: Vec<(usize, Vec<u64>)>,
}

/// What a rank reports at the end.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankStats {
    /// Per tier pair: (src, dst, blocks, bytes, busy seconds).
    pub paths: Vec<(TierKind, TierKind, u64, u64, f64)>,
}

/// Requests to a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankRequest {
    /// Run one iteration.
    Step(StepCommand),
    /// Compare blocks with the model's KV; answers the number of mismatches.
    Verify(Verify),
    /// Let background transfers finish and report statistics.
    Finish,
}

/// Answers of a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankResponse {
    /// To `Step`.
    Step(StepReply),
    /// To `Verify`: mismatching blocks.
    Verified(usize),
    /// To `Finish`.
    Finished(RankStats),
    /// The request failed on the rank.
    Error(String),
}

/// How the engine reaches one rank.
pub trait RankDriver: Send {
    /// Runs one iteration.
    fn step(&mut self, cmd: &StepCommand) -> Result<StepReply>;
    /// Counts blocks that differ from the model's KV.
    fn verify(&mut self, v: &Verify) -> Result<usize>;
    /// Drains and reports.
    fn finish(&mut self) -> Result<RankStats>;
}
