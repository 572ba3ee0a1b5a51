//! The remote (G4) tier over UCX: a worker exports a host tier ([`TierExport`]: agent metadata,
//! layout, allocation addresses, block header array), another imports it as a [`RemoteTier`]
//! whose reads and writes are one-sided transfers into and out of the exporter's memory, and
//! reads one load's blocks through a [`VerifiedRemote`] (each block checked against the key the
//! reader expects).
//!
//! Invariant: [`RemoteTier`] serialises its own readers and writers of a block; it cannot see what
//! the exporting process does to that block meanwhile, so the exporter must not reuse a block
//! while another worker may read it (the leader's job; see `docs/nixl.md`).

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use nixl_sys::{MemType, XferOp};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use super::agent::{nixl_error, pair_runs, runs_of, BouncePool, NixlAgent};
use super::headers::{decode_header, BLOCK_HEADER_BYTES};
use super::probe::NixlBackend;
use crate::backends::slot_file::hash_segments;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::{check_io, copy_segments, total_len, Capability, StorageTier, TierKind};

/// What a worker publishes so that another can reach one of its host tiers over UCX.
///
/// Plain data (serde): send it any way (a file, a pipe, the leader's transport). `metadata` is
/// NIXL's opaque agent metadata (connection info and registrations).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierExport {
    /// The exporting agent's name.
    pub agent: String,
    /// The exported tier's level (normally host).
    pub kind: TierKind,
    /// Its layout.
    pub layout: Layout,
    /// Base address of each of its allocations, in the exporter's address space.
    pub allocations: Vec<u64>,
    /// NIXL metadata of the exporting agent.
    pub metadata: Vec<u8>,
    /// Address of the tier's block header array ([`BlockHeaders`](super::BlockHeaders)) in the exporter's address
    /// space, when it registered one; needed by [`RemoteTier::read_verified`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<u64>,
}

impl TierExport {
    /// JSON bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::internal(format!("encode tier export: {e}")))
    }

    /// From [`to_bytes`](Self::to_bytes)'s output; [`ErrorKind::Decode`] on anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes)
            .map_err(|e| Error::new(ErrorKind::Decode, format!("not a NIXL tier export: {e}")))
    }
}

/// Another worker's host tier, read and written over UCX: the G4 (`remote`) tier.
///
/// Blocks are the exporter's; this side serialises its own readers and writers of a block.
/// Buffers inside a host tier registered with the local agent are used as they are; others go
/// through registered bounce buffers.
pub struct RemoteTier {
    bounce: BouncePool,
    agent: NixlAgent,
    remote: String,
    layout: Layout,
    allocations: Vec<usize>,
    headers: Option<usize>,
    locks: Box<[RwLock<()>]>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("agent", &self.agent.name())
            .field("remote", &self.remote)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// Default number of bounce buffers (and calls served well in parallel) of a [`RemoteTier`].
pub const REMOTE_MAX_IN_FLIGHT: usize = 4;

impl RemoteTier {
    /// Loads `export`'s metadata into `agent` (which needs the UCX backend) and returns the
    /// remote tier; `max_in_flight` bounce buffers of one block are registered.
    ///
    /// Errors: `agent` lacks UCX or `max_in_flight` is 0 ([`ErrorKind::InvalidArgument`]); an
    /// export whose allocations do not match its layout ([`ErrorKind::Decode`]); NIXL refusing
    /// the metadata ([`ErrorKind::Io`]).
    pub fn connect(agent: &NixlAgent, export: &TierExport, max_in_flight: usize) -> Result<Self> {
        agent.require_backend(NixlBackend::Ucx)?;
        if max_in_flight == 0 {
            return Err(Error::invalid_argument("max_in_flight must be non-zero"));
        }
        let layout = export.layout;
        if export.allocations.len() != layout.num_allocations() {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "tier export lists {} allocations, its layout has {}",
                    export.allocations.len(),
                    layout.num_allocations()
                ),
            )
            .with("remote_agent", &export.agent));
        }
        let allocations = export
            .allocations
            .iter()
            .map(|&a| {
                usize::try_from(a).map_err(|_| {
                    Error::new(ErrorKind::Decode, "allocation address overflows usize")
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let remote = agent
            .inner
            .agent
            .load_remote_md(&export.metadata)
            .map_err(|e| {
                nixl_error("load a remote agent's metadata", e)
                    .with("agent", agent.name())
                    .with("remote_agent", &export.agent)
            })?;
        if remote != export.agent {
            return Err(Error::new(
                ErrorKind::Decode,
                format!(
                    "tier export names agent {} but its metadata is agent {remote}",
                    export.agent
                ),
            ));
        }
        let headers = export
            .headers
            .map(|a| {
                usize::try_from(a)
                    .map_err(|_| Error::new(ErrorKind::Decode, "header address overflows usize"))
            })
            .transpose()?;
        let bounce = BouncePool::new(
            agent,
            NixlBackend::Ucx,
            max_in_flight,
            layout.bytes_per_block().max(BLOCK_HEADER_BYTES),
        )?;
        Ok(Self {
            bounce,
            agent: agent.clone(),
            remote,
            locks: (0..layout.num_blocks()).map(|_| RwLock::new(())).collect(),
            layout,
            allocations,
            headers,
        })
    }

    /// Whether the export carried block headers ([`read_verified`](Self::read_verified) works).
    pub fn has_headers(&self) -> bool {
        self.headers.is_some()
    }

    /// Reads block `block` only if it is verified to hold `key`: reads the exporter's header
    /// entry for the block (one-sided), then the block's bytes into a bounce buffer, and copies
    /// them to `dst` only when the header is valid (sealed, not invalidated), names `key`, and
    /// the bytes' xxh3-64 equals the header's checksum. Returns the checksum.
    ///
    /// Why this is enough while the exporter may evict and rewrite the block at any time: the
    /// exporter invalidates the header before it writes the block and publishes (key, checksum)
    /// only after the write, so a valid header for `key` means some complete image of `key`
    /// had that checksum; bytes read afterwards that hash to it are that image (a torn or newer
    /// image hashes differently, up to xxh3-64 collisions). A header torn by a concurrent
    /// update fails its seal.
    ///
    /// Errors: no headers in the export ([`ErrorKind::Unsupported`]); header invalid or naming
    /// another key ([`ErrorKind::NotFound`]); checksum mismatch ([`ErrorKind::Corrupt`]);
    /// transfer failures ([`ErrorKind::Io`]); `dst` of the wrong length.
    pub fn read_verified(
        &self,
        block: usize,
        key: u128,
        dst: &mut [IoSliceMut<'_>],
    ) -> Result<u64> {
        check_io(
            TierKind::Remote,
            "read_verified",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let hdr = self.headers.ok_or_else(|| {
            Error::unsupported(format!(
                "the export of {} carries no block headers: its blocks cannot be verified",
                self.remote
            ))
            .with("remote_agent", &self.remote)
        })?;
        let ctx = |e: Error| {
            e.with("tier", TierKind::Remote)
                .with("block", block)
                .with("remote_agent", &self.remote)
                .with("key", format!("{key:#034x}"))
        };
        let _guard = self.lock("read_verified", block)?.read();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        self.agent
            .transfer(
                XferOp::Read,
                NixlBackend::Ucx,
                &self.remote,
                MemType::Dram,
                0,
                &[(
                    buf.addr(),
                    hdr + block * BLOCK_HEADER_BYTES,
                    BLOCK_HEADER_BYTES,
                )],
            )
            .map_err(ctx)?;
        let (found, checksum) =
            decode_header(buf.as_slice(BLOCK_HEADER_BYTES)).ok_or_else(|| {
                ctx(Error::new(
                    ErrorKind::NotFound,
                    "remote block header is invalid (never published, or being rewritten)",
                ))
            })?;
        if found != key {
            return Err(ctx(Error::new(
                ErrorKind::NotFound,
                format!("remote block holds key {found:#034x}, not the expected one"),
            )));
        }
        let bpb = self.bytes_per_block();
        self.io(XferOp::Read, block, &[(buf.addr(), bpb)])?;
        let got = hash_segments(&[buf.as_slice(bpb)]);
        if got != checksum {
            return Err(ctx(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "remote block bytes hash to {got:#018x}, its header says {checksum:#018x} \
                     (rewritten during the read?)"
                ),
            )));
        }
        copy_segments(&[IoSlice::new(buf.as_slice(bpb))], dst);
        Ok(checksum)
    }

    /// The exporting agent's name.
    pub fn remote_agent(&self) -> &str {
        &self.remote
    }

    fn remote_runs(&self, block: usize) -> Result<Vec<(usize, usize)>> {
        self.layout
            .regions(block)?
            .map(|r| {
                self.allocations
                    .get(r.allocation)
                    .map(|base| (base + r.offset, r.len))
                    .ok_or_else(|| Error::internal("region names a missing allocation"))
            })
            .collect()
    }

    fn io(&self, op: XferOp, block: usize, local: &[(usize, usize)]) -> Result<()> {
        let pairs = pair_runs(local, &self.remote_runs(block)?);
        self.agent
            .transfer(op, NixlBackend::Ucx, &self.remote, MemType::Dram, 0, &pairs)
            .map_err(|e| e.with("tier", TierKind::Remote).with("block", block))
    }

    fn lock(&self, op: &'static str, block: usize) -> Result<&RwLock<()>> {
        self.locks.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.locks.len())
                .with("tier", TierKind::Remote)
                .with("op", op)
        })
    }
}

impl StorageTier for RemoteTier {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: 1,
            checksummed: false,
            max_in_flight: self.bounce.count,
        }
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            TierKind::Remote,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let _guard = self.lock("read_block", block)?.read();
        if self.agent.all_registered(dst) {
            return self.io(XferOp::Read, block, &runs_of(dst));
        }
        let bpb = self.bytes_per_block();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        self.io(XferOp::Read, block, &[(buf.addr(), bpb)])?;
        copy_segments(&[IoSlice::new(buf.as_slice(bpb))], dst);
        Ok(())
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            TierKind::Remote,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        let _guard = self.lock("write_block", block)?.write();
        if self.agent.all_registered(src) {
            return self.io(XferOp::Write, block, &runs_of(src));
        }
        let bpb = self.bytes_per_block();
        let mut bg = self.bounce.take();
        let buf = bg.buf()?;
        copy_segments(src, &mut [IoSliceMut::new(buf.as_mut_slice(bpb))]);
        self.io(XferOp::Write, block, &[(buf.addr(), bpb)])
    }
}

/// loads from (transfer engine source) for one remote load. `read_block` of a block with no
/// expected key, or whose check fails, is an error (the block fails, never served); writes are
/// refused.
#[derive(Debug)]
pub struct VerifiedRemote {
    tier: Arc<RemoteTier>,
    keys: std::collections::HashMap<usize, u128>,
}

impl VerifiedRemote {
    /// `keys`: `(remote block, expected key)`.
    pub fn new(tier: Arc<RemoteTier>, keys: impl IntoIterator<Item = (usize, u128)>) -> Self {
        Self {
            tier,
            keys: keys.into_iter().collect(),
        }
    }
}

impl StorageTier for VerifiedRemote {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    fn capability(&self) -> Capability {
        Capability {
            checksummed: true,
            ..self.tier.capability()
        }
    }

    fn layout(&self) -> &Layout {
        self.tier.layout()
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        let key = *self.keys.get(&block).ok_or_else(|| {
            Error::new(ErrorKind::NotFound, "no expected key for this remote block")
                .with("tier", TierKind::Remote)
                .with("block", block)
        })?;
        self.tier.read_verified(block, key, dst).map(|_| ())
    }

    fn write_block(&self, block: usize, _src: &[IoSlice<'_>]) -> Result<()> {
        Err(Error::unsupported("verified remote reads are read-only")
            .with("tier", TierKind::Remote)
            .with("block", block))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutDims;

    #[test]
    fn export_round_trips_and_garbage_is_decode() {
        let e = TierExport {
            agent: "a".into(),
            kind: TierKind::Host,
            layout: Layout::fully_contiguous(
                LayoutDims {
                    num_layers: 1,
                    outer_dim: 2,
                    page_size: 4,
                    inner_dim: 8,
                    dtype_bytes: 2,
                },
                3,
            )
            .unwrap(),
            allocations: vec![4096],
            metadata: vec![1, 2, 3],
            headers: None,
        };
        assert_eq!(TierExport::from_bytes(&e.to_bytes().unwrap()).unwrap(), e);
        assert_eq!(
            TierExport::from_bytes(b"nope").unwrap_err().kind(),
            ErrorKind::Decode
        );
    }
}
