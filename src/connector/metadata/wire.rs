//! The binary encoding of [`ConnectorMetadata`]: compact, versioned, and cheap to build and read
//! on the scheduler's hot path (the leader encodes once per iteration, every worker decodes).
//!
//! Layout (integers little-endian, lengths `u32`):
//!
//! ```text
//! magic "KVMD" · version u32 · iteration u64
//! new_slots: n · n × str
//! operations: n · n × (kind u8 · body)
//!     0 load, 1 store:   transfer
//!     2 remote_write:    transfer · keys
//!     3 remote_load:     transfer · keys
//!     4 keyed_store:     transfer · keys (a store into a persisted disk tier)
//!     5 keyed_load:      transfer · keys (a load from a persisted disk tier)
//!     255 custom:        n · n bytes of the operation as tagged JSON (an adapter's own kind)
//!   transfer: id u64 · request_id (0 | 1 str) · src u8 · dst u8 · pairs: n · n × (u64 · u64)
//!   keys: n · n × u128
//! hold: n · n × str · finished: n · n × str
//! str: n · n bytes of UTF-8
//! ```
//!
//! Every count is checked against the bytes left before anything is allocated for it, and bytes
//! after the document are refused, so a truncated, padded or garbled document is an
//! [`ErrorKind::Decode`] error naming the field, never a panic or a large allocation.

use super::{
    BlockTransfer, ConnectorMetadata, KeyedLoad, KeyedStore, Load, Operation, OperationId,
    RemoteLoad, RemoteWrite, Store, METADATA_VERSION,
};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::tier::TierKind;

/// The first bytes of every encoded document.
pub(super) const MAGIC: &[u8; 4] = b"KVMD";

const KIND_LOAD: u8 = 0;
const KIND_STORE: u8 = 1;
const KIND_REMOTE_WRITE: u8 = 2;
const KIND_REMOTE_LOAD: u8 = 3;
const KIND_KEYED_STORE: u8 = 4;
const KIND_KEYED_LOAD: u8 = 5;
const KIND_CUSTOM: u8 = 255;

/// Which built-in operation kind a boxed [`Operation`] is, so the encoder can write it compactly.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuiltinKind {
    /// [`Load`].
    Load,
    /// [`Store`].
    Store,
    /// [`RemoteWrite`].
    RemoteWrite,
    /// [`RemoteLoad`].
    RemoteLoad,
    /// [`KeyedStore`].
    KeyedStore,
    /// [`KeyedLoad`].
    KeyedLoad,
}

fn tier_code(t: TierKind) -> u8 {
    match t {
        TierKind::Device => 0,
        TierKind::Host => 1,
        TierKind::Disk => 2,
        TierKind::Remote => 3,
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_len(out: &mut Vec<u8>, n: usize, what: &str) -> Result<()> {
    let n = u32::try_from(n).map_err(|_| {
        Error::internal(format!(
            "cannot encode connector metadata: {what} has {n} entries, more than a u32 holds"
        ))
    })?;
    put_u32(out, n);
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str, what: &str) -> Result<()> {
    put_len(out, s.len(), what)?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_ids(out: &mut Vec<u8>, ids: &[RequestId], what: &str) -> Result<()> {
    put_len(out, ids.len(), what)?;
    for id in ids {
        put_str(out, id.as_str(), what)?;
    }
    Ok(())
}

fn put_transfer(out: &mut Vec<u8>, t: &BlockTransfer) -> Result<()> {
    put_u64(out, t.id.0);
    match &t.request_id {
        None => out.push(0),
        Some(r) => {
            out.push(1);
            put_str(out, r.as_str(), "request_id")?;
        }
    }
    out.push(tier_code(t.src));
    out.push(tier_code(t.dst));
    put_len(out, t.pairs.len(), "pairs")?;
    out.reserve(t.pairs.len() * 16);
    for &(s, d) in &t.pairs {
        put_u64(out, s as u64);
        put_u64(out, d as u64);
    }
    Ok(())
}

fn put_keys(out: &mut Vec<u8>, keys: &[u128]) -> Result<()> {
    put_len(out, keys.len(), "keys")?;
    out.reserve(keys.len() * 16);
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    Ok(())
}

/// Encodes `meta` (its `version` field is written as given).
pub(super) fn encode(meta: &ConnectorMetadata) -> Result<Vec<u8>> {
    let mut size = 64;
    for op in &meta.operations {
        size += 48 + op.transfer().pairs.len() * 16 + op.block_keys().len() * 16;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, meta.version);
    put_u64(&mut out, meta.iteration);
    put_ids(&mut out, &meta.new_slots, "new_slots")?;
    put_len(&mut out, meta.operations.len(), "operations")?;
    for op in &meta.operations {
        match op.builtin_kind() {
            Some(BuiltinKind::Load) => {
                out.push(KIND_LOAD);
                put_transfer(&mut out, op.transfer())?;
            }
            Some(BuiltinKind::Store) => {
                out.push(KIND_STORE);
                put_transfer(&mut out, op.transfer())?;
            }
            Some(BuiltinKind::RemoteWrite) => {
                out.push(KIND_REMOTE_WRITE);
                put_transfer(&mut out, op.transfer())?;
                put_keys(&mut out, op.block_keys())?;
            }
            Some(BuiltinKind::RemoteLoad) => {
                out.push(KIND_REMOTE_LOAD);
                put_transfer(&mut out, op.transfer())?;
                put_keys(&mut out, op.block_keys())?;
            }
            Some(kind @ (BuiltinKind::KeyedStore | BuiltinKind::KeyedLoad)) => {
                out.push(if kind == BuiltinKind::KeyedStore {
                    KIND_KEYED_STORE
                } else {
                    KIND_KEYED_LOAD
                });
                put_transfer(&mut out, op.transfer())?;
                put_keys(&mut out, op.block_keys())?;
            }
            None => {
                out.push(KIND_CUSTOM);
                let json = serde_json::to_vec(op).map_err(|e| {
                    Error::internal(format!("cannot encode operation {}: {e}", op.id()))
                })?;
                put_len(&mut out, json.len(), "custom operation")?;
                out.extend_from_slice(&json);
            }
        }
    }
    put_ids(&mut out, &meta.hold, "hold")?;
    put_ids(&mut out, &meta.finished, "finished")?;
    Ok(out)
}

fn decode_err(msg: String) -> Error {
    Error::new(ErrorKind::Decode, msg)
}

/// A cursor over untrusted bytes; every read names the field it was reading.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.bytes.len() - self.at;
        if n > left {
            return Err(decode_err(format!(
                "connector metadata ends inside {what} at byte {} ({n} bytes needed, {left} left)",
                self.at
            )));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of entries of at least `min_size` bytes each, bounded by the bytes left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.u32(what)? as usize;
        let left = self.bytes.len() - self.at;
        if n.saturating_mul(min_size) > left {
            return Err(decode_err(format!(
                "connector metadata claims {n} entries in {what}, more than its {left} remaining bytes hold"
            )));
        }
        Ok(n)
    }

    fn str(&mut self, what: &str) -> Result<&'a str> {
        let n = self.count(1, what)?;
        std::str::from_utf8(self.take(n, what)?)
            .map_err(|e| decode_err(format!("{what} in connector metadata is not UTF-8: {e}")))
    }

    fn flag(&mut self, what: &str) -> Result<bool> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(decode_err(format!(
                "connector metadata has presence byte {b} for {what} (0 or 1 expected)"
            ))),
        }
    }

    fn ids(&mut self, what: &str) -> Result<Vec<RequestId>> {
        let n = self.count(4, what)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(RequestId::from(self.str(what)?));
        }
        Ok(v)
    }

    fn tier(&mut self, what: &str) -> Result<TierKind> {
        match self.u8(what)? {
            0 => Ok(TierKind::Device),
            1 => Ok(TierKind::Host),
            2 => Ok(TierKind::Disk),
            3 => Ok(TierKind::Remote),
            b => Err(decode_err(format!(
                "connector metadata names tier {b} as {what} (0..=3 expected)"
            ))),
        }
    }

    fn block(&mut self, what: &str) -> Result<usize> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| {
            decode_err(format!(
                "block {v} in connector metadata's {what} does not fit this machine's usize"
            ))
        })
    }

    fn transfer(&mut self) -> Result<BlockTransfer> {
        let id = OperationId(self.u64("operation id")?);
        let request_id = if self.flag("request_id")? {
            Some(RequestId::from(self.str("request_id")?))
        } else {
            None
        };
        let src = self.tier("source tier")?;
        let dst = self.tier("destination tier")?;
        let n = self.count(16, "pairs")?;
        let mut pairs = Vec::with_capacity(n);
        for _ in 0..n {
            pairs.push((self.block("pairs")?, self.block("pairs")?));
        }
        Ok(BlockTransfer {
            id,
            request_id,
            src,
            dst,
            pairs,
        })
    }

    fn keys(&mut self) -> Result<Vec<u128>> {
        let n = self.count(16, "keys")?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(u128::from_le_bytes(self.array("keys")?));
        }
        Ok(keys)
    }

    fn operation(&mut self, index: usize) -> Result<Box<dyn Operation>> {
        let kind = self.u8("operation kind")?;
        Ok(match kind {
            KIND_LOAD => Box::new(Load(self.transfer()?)),
            KIND_STORE => Box::new(Store(self.transfer()?)),
            KIND_REMOTE_WRITE => {
                let transfer = self.transfer()?;
                let keys = self.keys()?;
                Box::new(RemoteWrite { transfer, keys })
            }
            KIND_REMOTE_LOAD => {
                let transfer = self.transfer()?;
                let keys = self.keys()?;
                Box::new(RemoteLoad { transfer, keys })
            }
            KIND_KEYED_STORE | KIND_KEYED_LOAD => {
                let transfer = self.transfer()?;
                let keys = self.keys()?;
                if keys.len() != transfer.pairs.len() {
                    return Err(decode_err(format!(
                        "keyed operation {}: {} keys for {} pairs",
                        transfer.id.0,
                        keys.len(),
                        transfer.pairs.len()
                    )));
                }
                if kind == KIND_KEYED_STORE {
                    Box::new(KeyedStore { transfer, keys })
                } else {
                    Box::new(KeyedLoad { transfer, keys })
                }
            }
            KIND_CUSTOM => {
                let n = self.count(1, "custom operation")?;
                let json = self.take(n, "custom operation")?;
                serde_json::from_slice::<Box<dyn Operation>>(json).map_err(|e| {
                    decode_err(format!(
                        "operation {index} of connector metadata is a malformed custom operation: {e}"
                    ))
                })?
            }
            k => {
                return Err(decode_err(format!(
                    "operation {index} of connector metadata has unknown kind {k}"
                )))
            }
        })
    }
}

/// Decodes a whole document (non-empty, already bounded in size by the caller).
pub(super) fn decode(bytes: &[u8]) -> Result<ConnectorMetadata> {
    let mut r = Reader { bytes, at: 0 };
    let magic = r.take(MAGIC.len(), "the magic bytes")?;
    if magic != MAGIC {
        return Err(decode_err(format!(
            "connector metadata does not start with {:?} (an older leader's JSON, or not metadata)",
            String::from_utf8_lossy(MAGIC)
        )));
    }
    let version = r.u32("version")?;
    if version != METADATA_VERSION {
        return Err(decode_err(format!(
            "connector metadata version {version} is not the supported version {METADATA_VERSION}"
        )));
    }
    let iteration = r.u64("iteration")?;
    let new_slots = r.ids("new_slots")?;
    // Every operation takes at least 1 + 8 + 1 + 2 + 4 bytes.
    let n = r.count(16, "operations")?;
    let mut operations = Vec::with_capacity(n);
    for i in 0..n {
        operations.push(r.operation(i)?);
    }
    let hold = r.ids("hold")?;
    let finished = r.ids("finished")?;
    if r.at != bytes.len() {
        return Err(decode_err(format!(
            "connector metadata has {} bytes after its end",
            bytes.len() - r.at
        )));
    }
    Ok(ConnectorMetadata {
        version,
        iteration,
        new_slots,
        operations,
        hold,
        finished,
    })
}
