//! The names of the engines the replay imitates: the `--framework` flag, the report's
//! `framework`, the flag passed to `kvbm worker`. What each engine does is in `engines`
//! (`engines::engine_of`); this module depends on nothing of the tool, so every other module can
//! name an engine.

/// Which engine to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::Display, clap::ValueEnum, serde::Serialize)]
#[strum(serialize_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    /// TensorRT-LLM.
    Trtllm,
    /// vLLM.
    Vllm,
}
