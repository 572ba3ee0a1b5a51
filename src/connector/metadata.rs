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
//! The encoding is JSON (self-describing, which tagged trait objects need, and readable in logs and
//! snapshots). Decoding never panics on untrusted bytes: malformed input, an unknown operation kind,
//! a wrong version or an oversized document is an [`ErrorKind::Decode`] error.

use std::fmt::Debug;

use serde::{Deserialize, Serialize};

use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::TierKind;

/// Version of the metadata format; a worker refuses any other.
pub const METADATA_VERSION: u32 = 2;

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
    /// block (remote writes), by the pair's index in the remote tier; empty otherwise.
    fn block_keys(&self) -> &[u128] {
        &[]
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

#[typetag::serde(name = "remote_load")]
impl Operation for RemoteLoad {
    fn direction(&self) -> Direction {
        Direction::Load
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

#[typetag::serde(name = "remote_write")]
impl Operation for RemoteWrite {
    fn direction(&self) -> Direction {
        Direction::Store
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

impl Clone for Box<dyn Operation> {
    fn clone(&self) -> Self {
        self.clone_op()
    }
}

/// Load matched blocks from host or disk into the engine's device blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load(pub BlockTransfer);

/// Store computed blocks off the device (or from host down to disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Store(pub BlockTransfer);

#[typetag::serde(name = "load")]
impl Operation for Load {
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
        serde_json::to_vec(self)
            .map_err(|e| Error::internal(format!("cannot encode connector metadata: {e}")))
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
        let meta: ConnectorMetadata = serde_json::from_slice(bytes).map_err(|e| {
            Error::new(
                ErrorKind::Decode,
                format!("malformed connector metadata: {e}"),
            )
        })?;
        if meta.version != METADATA_VERSION {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "connector metadata version {} is not the supported version {METADATA_VERSION}",
                    meta.version
                ),
            ));
        }
        Ok(meta)
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
    fn round_trip() {
        let m = sample();
        let d = ConnectorMetadata::decode(&m.encode().unwrap()).unwrap();
        assert_eq!(d.iteration, 7);
        assert_eq!(d.operations.len(), 2);
        assert_eq!(d.operations[0].direction(), Direction::Load);
        assert_eq!(d.operations[1].transfer(), m.operations[1].transfer());
        assert_eq!(d.hold, m.hold);
    }

    #[test]
    fn malformed_bytes_are_decode_errors() {
        let good = sample().encode().unwrap();
        let cases: Vec<Vec<u8>> = vec![
            b"{".to_vec(),
            b"null".to_vec(),
            vec![0xff, 0xfe, 0x00],
            good[..good.len() / 2].to_vec(),
            String::from_utf8(good.clone())
                .unwrap()
                .replace("\"load\"", "\"teleport\"")
                .into_bytes(),
            String::from_utf8(good.clone())
                .unwrap()
                .replace("\"version\":2", "\"version\":99")
                .into_bytes(),
            String::from_utf8(good.clone())
                .unwrap()
                .replace("[[3,9]]", "[[-3,9]]")
                .into_bytes(),
            "[".repeat(100_000).into_bytes(),
        ];
        for (i, c) in cases.iter().enumerate() {
            let e = ConnectorMetadata::decode(c).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Decode, "case {i}: {e}");
        }
        assert!(ConnectorMetadata::decode(b"").unwrap().is_empty());
    }

    /// Fuzz tests of the decoder ("keep them fixed", issue 13): arbitrary bytes and mutated valid
    /// encodings are metadata or an [`ErrorKind::Decode`] error, never a panic; whatever decodes
    /// encodes and decodes again to the same document. Bounded (256 cases each).
    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        /// A valid document with every operation kind and optional field.
        fn rich() -> ConnectorMetadata {
            let mut m = sample();
            m.finished.push("c".into());
            let t = |id, src, dst| BlockTransfer {
                id: OperationId(id),
                request_id: Some("a".into()),
                src,
                dst,
                pairs: vec![(0, 1), (2, 3)],
            };
            m.operations.push(Box::new(RemoteWrite {
                transfer: t(3, TierKind::Host, TierKind::Remote),
                keys: vec![11, 12],
            }));
            m.operations.push(Box::new(RemoteLoad {
                transfer: t(4, TierKind::Remote, TierKind::Device),
                keys: vec![13, 14],
            }));
            m
        }

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
            }

            #[test]
            fn mutated_encodings_decode_or_fail_cleanly(
                edits in prop::collection::vec(
                    (any::<prop::sample::Index>(), any::<u8>(), 0u8..5),
                    1..8,
                ),
            ) {
                let mut b = rich().encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
                // Bytes JSON gives meaning to, so mutations often stay well-formed.
                const SIGNIFICANT: &[u8] = b"{}[]\",:0123456789-.eE tfn";
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
            fn numbers_anywhere_decode_or_fail_cleanly(
                at in any::<prop::sample::Index>(),
                n in prop_oneof![any::<i64>().prop_map(|v| v.to_string()), any::<f64>().prop_map(|v| v.to_string()), Just("1e400".to_string()), Just("18446744073709551616".to_string())],
            ) {
                // Replace one number of a valid document (a block, an id, the iteration, ...).
                let text = String::from_utf8(rich().encode().map_err(|e| TestCaseError::fail(e.to_string()))?)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let digits: Vec<usize> = text.match_indices(|c: char| c.is_ascii_digit()).map(|(i, _)| i).collect();
                let i = digits[at.index(digits.len())];
                let end = text[i..].find(|c: char| !c.is_ascii_digit()).map_or(text.len(), |e| i + e);
                let mutated = format!("{}{}{}", &text[..i], n, &text[end..]);
                decodes_cleanly(mutated.as_bytes())?;
            }
        }
    }
}
