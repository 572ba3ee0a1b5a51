//! The `[transfer]` settings: how blocks move between tiers (batching, threads, the copy method,
//! the load deadline).

use super::*;

/// The transfer engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferConfig {
    /// Batches of block copies running at once, over all transfers of one kind: a worker bounds
    /// its memory copies (device ↔ host) and its I/O copies (disk, remote) separately, so stuck
    /// I/O never holds up memory copies. Default: 4.
    pub max_concurrency: usize,
    /// Blocks per batch (one blocking task). Default: 16.
    pub batch_blocks: usize,
    /// Deadline of one load from a tier that does I/O (disk, remote), in seconds
    /// (`KVBM_LOAD_TIMEOUT_SECS`). A load still running then is reported as failed — its device
    /// blocks are load errors the engine recomputes — while the stuck I/O finishes in the
    /// background into a buffer that is dropped. Default: [`DEFAULT_LOAD_TIMEOUT_SECS`] (10 s): a
    /// healthy load of even a long prefix (gigabytes at disk bandwidth) takes well under that,
    /// while recomputing a prefill takes seconds at most — past 10 s waiting costs more than it
    /// saves, and a frozen or failing disk must not hold a request (and its batch) longer.
    pub load_timeout_secs: f64,
    /// How transfers of at least 4 MiB between two memory tiers store their bytes
    /// (`KVBM_COPY_METHOD`): `auto` (the fastest of ordinary stores and two streaming-store
    /// loops on this machine, measured once per process by the first large transfer; see
    /// [`crate::transfer::calibrate`]), `plain`, `stream` (streaming stores, one line after the
    /// other) or `stream-pages` (streaming stores to four pages in turn). Default: `auto`.
    pub copy_method: crate::transfer::CopyPolicy,
    /// Where the device tier is itself host memory (an engine on the CPU: its "device" KV cache
    /// is ordinary tensors), copies between it and another memory tier run on the engine's own
    /// thread inside the call that submits them — loads in `start_load_kv`, stores when the
    /// forward pass is done — instead of on the worker's copy threads
    /// (`KVBM_INLINE_DEVICE_COPIES`). Such a copy is a `memcpy` of the step's blocks (a few
    /// milliseconds at most); on a host whose cores are all busy a copy thread waits for a time
    /// slice first, and meanwhile a finished request keeps its device blocks and a loading one
    /// its place in the queue. No effect with a GPU, or on copies to or from disk or the remote
    /// store. Default: `true`.
    pub inline_device_copies: bool,
}

/// [`TransferConfig::load_timeout_secs`] when unset.
pub const DEFAULT_LOAD_TIMEOUT_SECS: f64 = 10.0;

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            max_concurrency: 4,
            batch_blocks: 16,
            load_timeout_secs: DEFAULT_LOAD_TIMEOUT_SECS,
            copy_method: crate::transfer::CopyPolicy::Auto,
            inline_device_copies: true,
        }
    }
}

impl TransferConfig {
    /// The load deadline ([`TransferConfig::load_timeout_secs`]).
    pub fn load_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.load_timeout_secs)
    }

    pub(super) fn validate(&self) -> Result<()> {
        if !(self.load_timeout_secs.is_finite()
            && self.load_timeout_secs > 0.0
            && self.load_timeout_secs <= 1e6)
        {
            return Err(Error::invalid_config(
                "transfer.load_timeout_secs",
                self.load_timeout_secs,
                "must be a number of seconds > 0 (at most 1e6)",
            ));
        }
        Ok(())
    }
}
