//! The remote (G4) tier: a shared block store beyond this machine that every instance of a
//! deployment looks up, reads and writes (which store, from `remote.url`'s scheme, is the
//! storage backends' choice: Redis / Valkey, or an in-process store).
//!
//! The core knows the store only through the [`RemoteStore`] trait (a storage backend provides
//! it through [`TierFactory::remote_store`](super::worker::TierFactory::remote_store)); every call
//! is bounded by a deadline, and a value is never served unless verified. Around it the core
//! builds:
//!
//! * [`RemoteScope::for_instance`] — the scope both the leader and every worker build from the
//!   same facts (namespace, block dimensions, sharding, key hash), so they agree on keys;
//! * [`RemoteSource`] / [`RemoteSink`] — one load's or one write's view of the store as a
//!   [`StorageTier`], so reads and writes run through the transfer engine like any other copy
//!   (batched: one pipelined `get`/`put` per transfer batch; a missing or invalid value fails
//!   its block only);
//! * [`LookupThread`] — the leader's background lookups (the engine never waits for the store
//!   when it can be asked again later);
//! * [`StoreHealth`] (`store_health.rs`) — the store's verdict (healthy, slow, unavailable) from
//!   its recent calls, which takes a slow or failing store out of the path;
//! * [`MemoryRemoteStore`] — an in-process store with injectable faults (down, slow, invalid
//!   values): the test double of the trait.
//!
//! Correctness never depends on a lookup: the store may evict a value between a lookup and the
//! read, and a value may have been planted or damaged; the read then fails that block (a load
//! error the engine recomputes), it never serves wrong bytes.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::HashAlgorithm;
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::tier::{BatchCopy, Capability, StorageTier, TierKind};

pub use super::store_health::{log_state_change, CallKind, CallOutcome, StoreHealth, StoreState};

mod lookup;
mod memory;
mod views;

pub use lookup::*;
pub use memory::*;
pub use views::*;

/// Width of the block keys the scope covers, in bits.
pub const KEY_BITS: u32 = 128;

/// What a [`RemoteStore`]'s values belong to: two instances share blocks through a store only
/// when their scopes are equal (same model and layout, same sharding, same keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteScope {
    /// Fingerprint of everything that makes two instances' blocks interchangeable (model and
    /// layout description, page size, one rank's bytes per block, world size, key hash and
    /// width), as lowercase hex; built by [`RemoteScope::new`]. Stores put it in their keys.
    pub fingerprint: String,
    /// Tensor-parallel size: every block is stored as one value per rank.
    pub world_size: usize,
    /// Bytes of one rank's share of a block (the length of every value's payload).
    pub bytes_per_block: usize,
}

impl RemoteScope {
    /// The scope of an instance as the leader and every worker build it: the namespace
    /// (`remote.namespace`), one rank's block dimensions `dims`, `world_size` ranks of
    /// `bytes_per_block` bytes each, and the configured key hash.
    pub fn for_instance(
        config: &Config,
        dims: &LayoutDims,
        world_size: usize,
        bytes_per_block: usize,
    ) -> Result<Self> {
        let description = format!(
            "kvbm-v1;ns={:?};layers={};outer={};page={};inner={};dtype={}",
            config.remote.namespace.as_deref().unwrap_or(""),
            dims.num_layers,
            dims.outer_dim,
            dims.page_size,
            dims.inner_dim,
            dims.dtype_bytes
        );
        Self::new(
            &description,
            dims.page_size,
            world_size,
            bytes_per_block,
            config.hash,
        )
    }

    /// The scope of an instance: `description` names the model and layout (anything whose
    /// change makes blocks incompatible: dtype, layers, heads, head size, block order).
    pub fn new(
        description: &str,
        page_size: usize,
        world_size: usize,
        bytes_per_block: usize,
        hash: HashAlgorithm,
    ) -> Result<Self> {
        if world_size == 0 || page_size == 0 || bytes_per_block == 0 {
            return Err(Error::invalid_argument(format!(
                "remote scope needs a non-zero world size ({world_size}), page size \
                 ({page_size}) and bytes per block ({bytes_per_block})"
            )));
        }
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [
            description.as_bytes(),
            &(page_size as u64).to_le_bytes(),
            &(world_size as u64).to_le_bytes(),
            &(bytes_per_block as u64).to_le_bytes(),
            format!("{hash:?}").as_bytes(),
            &KEY_BITS.to_le_bytes(),
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let digest = h.finalize();
        let fingerprint = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            fingerprint,
            world_size,
            bytes_per_block,
        })
    }
}

/// How one block of a [`RemoteStore::get`] turned out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteRead {
    /// Read and verified (key, length, checksum, and MAC when a secret is configured); the
    /// destination holds the block.
    Hit,
    /// Not in the store (never written, or evicted / expired): a miss, the engine recomputes.
    Missing,
    /// A value was there but failed verification (wrong key, truncated, bad checksum or MAC):
    /// never served; the reason names what was wrong.
    Invalid(String),
}

/// What a [`RemoteStore::put`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemotePut {
    /// Values written.
    pub written: usize,
    /// Values already present, not rewritten.
    pub present: usize,
}

/// Counters of a [`RemoteStore`] for metrics and reports (totals since the store was built).
/// Each worker sends its store's to the leader when they change
/// ([`WorkerMessage::StoreStats`](crate::connector::transport::WorkerMessage::StoreStats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteStoreStats {
    /// Whether the store answered its last call (false while it is down / reconnecting).
    pub available: bool,
    /// Calls that failed (connection refused or lost, server error).
    pub errors: u64,
    /// Calls that missed their deadline.
    pub timeouts: u64,
    /// Successful reconnections after a failure.
    pub reconnects: u64,
    /// Values that failed verification on read.
    pub invalid: u64,
}

impl RemoteStoreStats {
    /// The counters of `self` and `other` added (`available`: both answered).
    pub fn plus(self, other: RemoteStoreStats) -> RemoteStoreStats {
        RemoteStoreStats {
            available: self.available && other.available,
            errors: self.errors.saturating_add(other.errors),
            timeouts: self.timeouts.saturating_add(other.timeouts),
            reconnects: self.reconnects.saturating_add(other.reconnects),
            invalid: self.invalid.saturating_add(other.invalid),
        }
    }
}

/// A shared block store beyond this machine (the G4 tier), as a storage backend provides it
/// (e.g. Redis / Valkey). Keys are 128-bit block keys ([`SequenceHash`](crate::identity::SequenceHash)`.0`); the store scopes
/// them by its [`RemoteScope`] and by rank. Every call is bounded by `deadline`: a store that is
/// down or slow answers [`crate::ErrorKind::Timeout`] or another error, never hangs, and
/// reconnects in the background. A value is never served unless verified.
pub trait RemoteStore: Send + Sync + std::fmt::Debug {
    /// Where it is, for logs and metrics (no password or secret).
    fn describe(&self) -> String;

    /// The scope it was built for.
    fn scope(&self) -> &RemoteScope;

    /// Leader: how many of `keys`, from the first, the store holds for every one of the scope's
    /// ranks (stops at the first key missing for any rank). An error (timeout, unreachable)
    /// is for the caller to count as a miss.
    fn lookup_prefix(&self, keys: &[u128], deadline: std::time::Instant) -> Result<usize>;

    /// Worker `rank`: reads each of `keys` into the matching buffer of `dst` (each exactly
    /// [`RemoteScope::bytes_per_block`] long), one pipelined batch. One outcome per key; an error
    /// means the whole batch failed (nothing in `dst` may be used).
    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: std::time::Instant,
    ) -> Result<Vec<RemoteRead>>;

    /// Worker `rank`: stores each `(key, bytes)` (bytes exactly `bytes_per_block` long) unless
    /// already present, one pipelined batch.
    fn put(
        &self,
        rank: usize,
        blocks: &[(u128, &[u8])],
        deadline: std::time::Instant,
    ) -> Result<RemotePut>;

    /// Its counters.
    fn stats(&self) -> RemoteStoreStats;

    /// True when its values leave this process (a server others can write to): the leader
    /// then warns at start-up when no deployment secret authenticates them. An in-process
    /// store says false.
    fn leaves_the_process(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn dims() -> LayoutDims {
        LayoutDims {
            num_layers: 2,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        }
    }

    pub(super) fn store() -> MemoryRemoteStore {
        let config = Config::default();
        let d = dims();
        let scope = RemoteScope::for_instance(&config, &d, 1, d.bytes_per_block()).unwrap();
        MemoryRemoteStore::new(scope)
    }

    pub(super) const IO: Duration = Duration::from_secs(2);

    #[test]
    fn scopes_differ_by_namespace_shape_sharding_and_hash() {
        let d = dims();
        let base = Config::default();
        let a = RemoteScope::for_instance(&base, &d, 1, d.bytes_per_block()).unwrap();
        assert_eq!(
            a,
            RemoteScope::for_instance(&base, &d, 1, d.bytes_per_block()).unwrap()
        );
        let mut ns = base.clone();
        ns.remote.namespace = Some("other-model".into());
        let mut xxh = base.clone();
        xxh.hash = HashAlgorithm::Xxh3;
        let mut wider = d;
        wider.inner_dim = 16;
        for other in [
            RemoteScope::for_instance(&ns, &d, 1, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&xxh, &d, 1, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&base, &d, 2, d.bytes_per_block()).unwrap(),
            RemoteScope::for_instance(&base, &wider, 1, wider.bytes_per_block()).unwrap(),
        ] {
            assert_ne!(a.fingerprint, other.fingerprint);
        }
        assert!(RemoteScope::new("x", 4, 0, 8, HashAlgorithm::Sha256).is_err());
    }
}
