//! Connector metadata: what the leader tells the workers once per engine iteration.
//!
//! The leader builds one [`ConnectorMetadata`] per iteration; the engine carries its bytes to every
//! worker (`build_connector_meta` → `bind_connector_meta`). It lists the request slots to create,
//! the operations to run, and the finished requests whose device blocks the engine keeps until the
//! workers report them.
//!
//! Operations are trait objects tagged with their kind ([`typetag`]), so an adapter outside this
//! crate can add its own kinds: implement [`Operation`] with `#[typetag::serde(name = "...")]` and
//! describe the block copies it needs in [`Operation::transfer`]. The built-in kinds are [`Load`]
//! (onto the device) and [`Store`] (off the device, or further down the hierarchy).
//!
//! The encoding is our own compact binary format (see the `wire` module): the built-in kinds are
//! written field by field, an adapter's own kinds as tagged JSON inside it. Decoding never panics
//! on untrusted bytes: malformed or truncated input, an unknown operation kind, a wrong version or
//! an oversized document is an [`ErrorKind::Decode`] error naming what was wrong.

use std::fmt::Debug;

use serde::{Deserialize, Serialize};

use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::TierKind;

mod wire;

#[doc(hidden)]
pub use wire::BuiltinKind;

/// Version of the metadata format; a worker refuses any other (3: the binary encoding).
pub const METADATA_VERSION: u32 = 3;

/// Largest metadata document a worker accepts (bytes).
pub const MAX_METADATA_BYTES: usize = 64 << 20;

/// Identifies one operation across leader and workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OperationId(pub u64);

impl OperationId {
    /// The bit that marks ids of operations an adapter creates itself.
    pub const CUSTOM_BIT: u64 = 1 << 63;

    /// An id for an adapter's own operation: `n` with [`OperationId::CUSTOM_BIT`] set. The
    /// leader's ids never have it, so the two never collide; completions of custom ids go to
    /// [`SchedulerAdapter::on_custom_completion`](crate::connector::adapter::SchedulerAdapter::on_custom_completion).
    pub fn custom(n: u64) -> Self {
        OperationId(n | Self::CUSTOM_BIT)
    }

    /// Whether an adapter (not the leader) created this id.
    pub fn is_custom(self) -> bool {
        self.0 & Self::CUSTOM_BIT != 0
    }
}

impl std::fmt::Display for OperationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// Whether an operation writes the engine's device blocks (load) or reads them or lower tiers (store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::Display)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Direction {
    /// Onto the device: the engine must not compute on the destination blocks until it completes.
    Load,
    /// Off the device or down the hierarchy.
    Store,
}

/// Block copies between two tiers: the payload of every operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockTransfer {
    /// The operation's id.
    pub id: OperationId,
    /// The request it serves; `None` for background work (e.g. host → disk offload).
    pub request_id: Option<RequestId>,
    /// Source tier.
    pub src: TierKind,
    /// Destination tier.
    pub dst: TierKind,
    /// `(source block, destination block)` pairs.
    pub pairs: Vec<(usize, usize)>,
}

impl BlockTransfer {
    /// True when the copy reads the engine's device blocks.
    pub fn reads_device(&self) -> bool {
        self.src == TierKind::Device
    }

    /// True when the copy writes the engine's device blocks.
    pub fn writes_device(&self) -> bool {
        self.dst == TierKind::Device
    }
}

/// One unit of work for the workers. Object safe and serialisable with its kind as a tag.
#[typetag::serde(tag = "op")]
pub trait Operation: Debug + Send + Sync {
    /// Whether it loads onto the device or stores.
    fn direction(&self) -> Direction;
    /// The block copies it asks for.
    fn transfer(&self) -> &BlockTransfer;
    /// A boxed copy.
    fn clone_op(&self) -> Box<dyn Operation>;

    /// The operation's id.
    fn id(&self) -> OperationId {
        self.transfer().id
    }
    /// The request it serves, if any.
    fn request_id(&self) -> Option<&RequestId> {
        self.transfer().request_id.as_ref()
    }
    /// The key (sequence hash) of each pair's source block (remote loads) or destination
    /// block (remote writes), by the pair's index in the remote tier; of each pair's destination
    /// block by pair index ([`KeyedStore`]) or source block ([`KeyedLoad`]); empty otherwise.
    fn block_keys(&self) -> &[u128] {
        &[]
    }
    /// Which built-in kind this is (the encoder writes those compactly); `None`, the default, for
    /// an adapter's own kinds, which travel as tagged JSON.
    #[doc(hidden)]
    fn builtin_kind(&self) -> Option<BuiltinKind> {
        None
    }
}

/// A [`Load`] from the remote (G4) store: pair `(k, device block)` reads `keys[k]` (this rank's
/// shard) into the device block; a value missing or failing verification fails its block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteLoad {
    /// The copies (`src` is [`TierKind::Remote`] indexed by key, `dst` the device).
    pub transfer: BlockTransfer,
    /// The keys, by source index.
    pub keys: Vec<u128>,
}

/// A write of host blocks to the remote (G4) store: pair `(host block, k)` writes the host
/// block as `keys[k]` (this rank's shard), unless the store already holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteWrite {
    /// The copies (`src` is the host tier, `dst` [`TierKind::Remote`] indexed by key).
    pub transfer: BlockTransfer,
    /// The keys, by destination index.
    pub keys: Vec<u128>,
}

/// The [`Operation`] impl of a copy that carries one key per block (`$ty { transfer, keys }`).
macro_rules! keyed_operation {
    ($ty:ident, $name:literal, $kind:ident, $direction:ident) => {
        #[typetag::serde(name = $name)]
        impl Operation for $ty {
            fn builtin_kind(&self) -> Option<BuiltinKind> {
                Some(BuiltinKind::$kind)
            }
            fn direction(&self) -> Direction {
                Direction::$direction
            }
            fn transfer(&self) -> &BlockTransfer {
                &self.transfer
            }
            fn clone_op(&self) -> Box<dyn Operation> {
                Box::new(self.clone())
            }
            fn block_keys(&self) -> &[u128] {
                &self.keys
            }
        }
    };
}

keyed_operation!(RemoteWrite, "remote_write", RemoteWrite, Store);
keyed_operation!(RemoteLoad, "remote_load", RemoteLoad, Load);
keyed_operation!(KeyedStore, "keyed_store", KeyedStore, Store);
keyed_operation!(KeyedLoad, "keyed_load", KeyedLoad, Load);

impl Clone for Box<dyn Operation> {
    fn clone(&self) -> Self {
        self.clone_op()
    }
}

/// A [`Store`] whose destination tier keeps which key each block holds (a persisted disk tier,
/// `disk.persist`): `keys[i]` is the key of `transfer.pairs[i]`'s destination block, so a worker
/// restarted over the same file can say what its blocks are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyedStore {
    /// The copies.
    pub transfer: BlockTransfer,
    /// The key of each pair's destination block, by pair index.
    pub keys: Vec<u128>,
}

/// A [`Load`] from a persisted disk tier (`disk.persist`): `keys[i]` is the key the leader
/// expects in `transfer.pairs[i]`'s source block; a worker whose index says otherwise fails the
/// load (the engine recomputes) rather than serve another key's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyedLoad {
    /// The copies.
    pub transfer: BlockTransfer,
    /// The key of each pair's source block, by pair index.
    pub keys: Vec<u128>,
}

/// Load matched blocks from host or disk into the engine's device blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load(pub BlockTransfer);

/// Store computed blocks off the device (or from host down to disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Store(pub BlockTransfer);

#[typetag::serde(name = "load")]
impl Operation for Load {
    fn builtin_kind(&self) -> Option<BuiltinKind> {
        Some(BuiltinKind::Load)
    }
    fn direction(&self) -> Direction {
        Direction::Load
    }
    fn transfer(&self) -> &BlockTransfer {
        &self.0
    }
    fn clone_op(&self) -> Box<dyn Operation> {
        Box::new(self.clone())
    }
}

#[typetag::serde(name = "store")]
impl Operation for Store {
    fn builtin_kind(&self) -> Option<BuiltinKind> {
        Some(BuiltinKind::Store)
    }
    fn direction(&self) -> Direction {
        Direction::Store
    }
    fn transfer(&self) -> &BlockTransfer {
        &self.0
    }
    fn clone_op(&self) -> Box<dyn Operation> {
        Box::new(self.clone())
    }
}

/// Everything the workers need for one engine iteration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorMetadata {
    /// [`METADATA_VERSION`].
    pub version: u32,
    /// The leader's iteration counter (1 for the first metadata built).
    pub iteration: u64,
    /// Requests to track from now on.
    pub new_slots: Vec<RequestId>,
    /// Operations to run, in order.
    pub operations: Vec<Box<dyn Operation>>,
    /// Finished requests whose device blocks the engine keeps until the workers report them done
    /// (the leader answered `request_finished` with true).
    pub hold: Vec<RequestId>,
    /// Finished requests the engine frees at once (the leader answered false): workers forget
    /// them once their operations are done, whether or not the engine tells them itself.
    #[serde(default)]
    pub finished: Vec<RequestId>,
}

impl ConnectorMetadata {
    /// Empty metadata for `iteration`.
    pub fn empty(iteration: u64) -> Self {
        Self {
            version: METADATA_VERSION,
            iteration,
            new_slots: Vec::new(),
            operations: Vec::new(),
            hold: Vec::new(),
            finished: Vec::new(),
        }
    }

    /// True when there is nothing for the workers to do.
    pub fn is_empty(&self) -> bool {
        self.new_slots.is_empty()
            && self.operations.is_empty()
            && self.hold.is_empty()
            && self.finished.is_empty()
    }

    /// Encodes to bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        wire::encode(self)
    }

    /// Decodes untrusted bytes: any defect is an [`ErrorKind::Decode`] error, never a panic.
    /// Empty input is empty metadata for iteration 0 (some engines hand an empty buffer to
    /// workers on iterations with nothing to do).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() {
            return Ok(Self::empty(0));
        }
        if bytes.len() > MAX_METADATA_BYTES {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "connector metadata of {} bytes exceeds the {MAX_METADATA_BYTES}-byte limit",
                    bytes.len()
                ),
            ));
        }
        wire::decode(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnectorMetadata {
        let mut m = ConnectorMetadata::empty(7);
        m.new_slots.push(RequestId::from("a"));
        m.operations.push(Box::new(Load(BlockTransfer {
            id: OperationId(1),
            request_id: Some("a".into()),
            src: TierKind::Host,
            dst: TierKind::Device,
            pairs: vec![(3, 9)],
        })));
        m.operations.push(Box::new(Store(BlockTransfer {
            id: OperationId(2),
            request_id: None,
            src: TierKind::Host,
            dst: TierKind::Disk,
            pairs: vec![(3, 0)],
        })));
        m.hold.push("b".into());
        m
    }

    #[test]
    fn keyed_operations_round_trip_and_refuse_a_key_count_that_is_not_the_pair_count() {
        let t = |id, src, dst, pairs: Vec<(usize, usize)>| BlockTransfer {
            id: OperationId(id),
            request_id: Some("a".into()),
            src,
            dst,
            pairs,
        };
        let mut m = ConnectorMetadata::empty(3);
        m.new_slots.push(RequestId::from("a"));
        m.operations.push(Box::new(KeyedStore {
            transfer: t(1, TierKind::Device, TierKind::Disk, vec![(0, 5), (1, 6)]),
            keys: vec![11, u128::MAX],
        }));
        m.operations.push(Box::new(KeyedLoad {
            transfer: t(2, TierKind::Disk, TierKind::Device, vec![(5, 2)]),
            keys: vec![11],
        }));
        let d = ConnectorMetadata::decode(&m.encode().unwrap()).unwrap();
        assert_eq!(
            d.operations[0].builtin_kind(),
            Some(BuiltinKind::KeyedStore)
        );
        assert_eq!(d.operations[0].block_keys(), &[11, u128::MAX]);
        assert_eq!(d.operations[0].direction(), Direction::Store);
        assert_eq!(d.operations[1].builtin_kind(), Some(BuiltinKind::KeyedLoad));
        assert_eq!(d.operations[1].block_keys(), &[11]);
        assert_eq!(d.operations[1].direction(), Direction::Load);
        assert_eq!(d.operations[1].transfer(), m.operations[1].transfer());
        // Two keys for one pair: a decode error naming the operation, not a panic.
        let mut bad = ConnectorMetadata::empty(3);
        bad.new_slots.push(RequestId::from("a"));
        bad.operations.push(Box::new(KeyedLoad {
            transfer: t(9, TierKind::Disk, TierKind::Device, vec![(5, 2)]),
            keys: vec![1, 2],
        }));
        let err = ConnectorMetadata::decode(&bad.encode().unwrap()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Decode, "{err}");
        assert!(err.to_string().contains("operation 9"), "{err}");
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let d = ConnectorMetadata::decode(&m.encode().unwrap()).unwrap();
        assert_eq!(d.iteration, 7);
        assert_eq!(d.operations.len(), 2);
        assert_eq!(d.operations[0].direction(), Direction::Load);
        assert_eq!(d.operations[1].transfer(), m.operations[1].transfer());
        assert_eq!(d.hold, m.hold);
    }

    /// An adapter's own operation kind: travels as tagged JSON inside the binary document.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    struct Teleport(BlockTransfer);

    #[typetag::serde(name = "test_teleport")]
    impl Operation for Teleport {
        fn direction(&self) -> Direction {
            Direction::Load
        }
        fn transfer(&self) -> &BlockTransfer {
            &self.0
        }
        fn clone_op(&self) -> Box<dyn Operation> {
            Box::new(self.clone())
        }
    }

    /// A valid document with every operation kind and optional field.
    fn rich() -> ConnectorMetadata {
        let mut m = sample();
        m.finished.push("c".into());
        let t = |id, src, dst| BlockTransfer {
            id: OperationId(id),
            request_id: Some("a".into()),
            src,
            dst,
            pairs: vec![(0, 1), (2, usize::MAX)],
        };
        m.operations.push(Box::new(RemoteWrite {
            transfer: t(3, TierKind::Host, TierKind::Remote),
            keys: vec![11, u128::MAX],
        }));
        m.operations.push(Box::new(RemoteLoad {
            transfer: t(4, TierKind::Remote, TierKind::Device),
            keys: vec![13, 14],
        }));
        m.operations.push(Box::new(Teleport(t(
            OperationId::custom(5).0,
            TierKind::Disk,
            TierKind::Device,
        ))));
        m
    }

    #[test]
    fn every_kind_round_trips() {
        let m = rich();
        let bytes = m.encode().unwrap();
        assert_eq!(&bytes[..4], b"KVMD");
        let d = ConnectorMetadata::decode(&bytes).unwrap();
        assert_eq!(format!("{m:?}"), format!("{d:?}"));
        assert_eq!(d.operations[2].block_keys(), &[11, u128::MAX]);
        assert_eq!(d.operations[3].block_keys(), &[13, 14]);
        assert_eq!(d.operations[4].builtin_kind(), None);
        assert!(d.operations[4].id().is_custom());
        // Empty metadata too, and it stays small.
        let e = ConnectorMetadata::empty(3).encode().unwrap();
        assert!(e.len() < 40, "{}", e.len());
        assert_eq!(ConnectorMetadata::decode(&e).unwrap().iteration, 3);
    }

    #[test]
    fn malformed_bytes_are_decode_errors() {
        let good = sample().encode().unwrap();
        let with = |at: usize, b: &[u8]| {
            let mut v = good.clone();
            v[at..at + b.len()].copy_from_slice(b);
            v
        };
        // Offsets in `sample()`'s encoding: magic 0, version 4, iteration 8, new_slots count 16,
        // "a" 20..25, operations count 25, first kind 29.
        let mut padded = good.clone();
        padded.push(0);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"{".to_vec(), "magic"),
            (b"{\"version\":2}".to_vec(), "start with"),
            (vec![0xff, 0xfe, 0x00], "magic"),
            (with(4, &99u32.to_le_bytes()), "version 99"),
            (with(16, &u32::MAX.to_le_bytes()), "new_slots"),
            (with(20, &u32::MAX.to_le_bytes()), "new_slots"),
            (with(24, &[0xff]), "UTF-8"),
            (with(25, &u32::MAX.to_le_bytes()), "operations"),
            (with(29, &[7]), "unknown kind 7"),
            (with(29, &[255]), "custom operation"),
            (padded, "after its end"),
        ];
        for (i, (c, what)) in cases.iter().enumerate() {
            let e = ConnectorMetadata::decode(c).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Decode, "case {i}: {e}");
            assert!(e.to_string().contains(what), "case {i}: {e}");
        }
        // Every truncation is a Decode error naming where it ended.
        for n in 1..good.len() {
            let e = ConnectorMetadata::decode(&good[..n]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Decode, "truncated to {n}: {e}");
        }
        assert!(ConnectorMetadata::decode(b"").unwrap().is_empty());
    }

    #[test]
    fn bad_tier_and_presence_bytes_are_named() {
        let good = sample().encode().unwrap();
        // First operation: kind 29, id 30..38, request_id flag 38.
        let mut v = good.clone();
        v[38] = 2;
        let e = ConnectorMetadata::decode(&v).unwrap_err();
        assert!(e.to_string().contains("request_id"), "{e}");
        // request_id "a": 39..44, src 44.
        let mut v = good.clone();
        v[44] = 9;
        let e = ConnectorMetadata::decode(&v).unwrap_err();
        assert!(e.to_string().contains("source tier"), "{e}");
    }

    /// Fuzz tests of the decoder ("keep them fixed", issue 13): arbitrary bytes and mutated valid
    /// encodings are metadata or an [`ErrorKind::Decode`] error, never a panic; whatever decodes
    /// encodes and decodes again to the same document. Bounded (256 cases each).
    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        fn decodes_cleanly(bytes: &[u8]) -> Result<(), TestCaseError> {
            match ConnectorMetadata::decode(bytes) {
                Ok(m) => {
                    let again = m.encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let m2 = ConnectorMetadata::decode(&again)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(format!("{m:?}"), format!("{m2:?}"));
                }
                Err(e) => prop_assert_eq!(e.kind(), ErrorKind::Decode, "{}", e),
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn arbitrary_bytes_decode_or_fail_cleanly(
                bytes in prop::collection::vec(any::<u8>(), 0..600),
            ) {
                decodes_cleanly(&bytes)?;
                // The same bytes behind a valid header reach the field decoders.
                let mut b = rich().encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
                b.truncate(16);
                b.extend_from_slice(&bytes);
                decodes_cleanly(&b)?;
            }

            #[test]
            fn mutated_encodings_decode_or_fail_cleanly(
                edits in prop::collection::vec(
                    (any::<prop::sample::Index>(), any::<u8>(), 0u8..5),
                    1..8,
                ),
            ) {
                let mut b = rich().encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
                // Small values keep counts, kinds, tiers and flags plausible, so mutations often
                // stay well-formed and reach the next field.
                const SIGNIFICANT: &[u8] = &[0, 1, 2, 3, 4, 16, 255, b'{', b'"'];
                for (at, byte, op) in edits {
                    match op {
                        0 if !b.is_empty() => { let i = at.index(b.len()); b[i] = byte; }
                        1 if !b.is_empty() => {
                            let i = at.index(b.len());
                            b[i] = SIGNIFICANT[byte as usize % SIGNIFICANT.len()];
                        }
                        2 => {
                            let i = at.index(b.len() + 1);
                            b.insert(i, SIGNIFICANT[byte as usize % SIGNIFICANT.len()]);
                        }
                        3 if !b.is_empty() => { let i = at.index(b.len()); b.remove(i); }
                        _ if !b.is_empty() => { let i = at.index(b.len()); b.truncate(i); }
                        _ => {}
                    }
                }
                decodes_cleanly(&b)?;
            }

            #[test]
            fn words_anywhere_decode_or_fail_cleanly(
                at in any::<prop::sample::Index>(),
                word in prop_oneof![any::<u32>(), Just(u32::MAX), Just(0u32), Just(1u32), Just(1u32 << 31)],
            ) {
                // Overwrite four bytes of a valid document (a count, a length, an id, a block...).
                let mut b = rich().encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let i = at.index(b.len() - 3);
                b[i..i + 4].copy_from_slice(&word.to_le_bytes());
                decodes_cleanly(&b)?;
            }
        }
    }
}
