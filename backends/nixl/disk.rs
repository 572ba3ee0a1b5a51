//! The disk (G3) tier through NIXL's POSIX backend: [`NixlDiskTier`] keeps its blocks in the same
//! checksummed slot file as the built-in [`DiskTier`](crate::backends::disk::DiskTier) (same
//! options, errors and guarantees: a block never written is
//! [`ErrorKind::NotFound`](crate::ErrorKind::NotFound), a checksum mismatch is
//! [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt), writers of a block are serialised against
//! its readers), but its reads and writes are NIXL transfers between registered host memory and
//! the registered file.

use std::io::{IoSlice, IoSliceMut};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::path::Path;

use nixl_sys::{MemType, RegistrationHandle, XferOp};

use super::agent::{pair_runs, runs_of, BouncePool, NixlAgent, RawRegion};
use super::probe::NixlBackend;
use crate::backends::disk::{DiskTierOptions, DISK_ALIGNMENT};
use crate::backends::slot_file::{hash_segments, SlotFile};
use crate::error::{Error, Result};
use crate::layout::{Layout, LayoutDims};
use crate::tier::{Capability, StorageTier, TierKind};

/// A disk (G3) tier whose I/O goes through NIXL's POSIX backend; see the [backend docs](super).
///
/// Same file, slot layout (`bytes_per_block` rounded up to 4096 per block), O_DIRECT choice and
/// checksums as [`DiskTier`](crate::backends::disk::DiskTier). Buffers inside a host tier
/// registered with the agent go to NIXL as they are (with O_DIRECT: when 4096-aligned in address
/// and length); others go through one of `max_in_flight` registered bounce buffers.
pub struct NixlDiskTier {
    // Field order is drop order: the file's registration, then the bounce buffers, then the
    // slot file (whose descriptor NIXL used; it removes the file), then the agent.
    file_reg: Option<RegistrationHandle>,
    bounce: BouncePool,
    slots: SlotFile,
    agent: NixlAgent,
}

impl std::fmt::Debug for NixlDiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlDiskTier")
            .field("agent", &self.agent.name())
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl NixlDiskTier {
    /// Creates the tier's file like [`DiskTier::create`](crate::backends::disk::DiskTier::create)
    /// (same options, same errors) and registers it with `agent`'s POSIX backend.
    ///
    /// Errors also: `agent` has no POSIX backend
    /// ([`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)); NIXL refusing a
    /// registration ([`ErrorKind::Io`](crate::ErrorKind::Io)).
    pub fn create(
        agent: &NixlAgent,
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
    ) -> Result<Self> {
        agent.require_backend(NixlBackend::Posix)?;
        let slots = SlotFile::create(kind, dims, num_blocks, &opts)?;
        let slot_bytes = slots.slot_bytes();
        let fd = u64::try_from(slots.file().as_raw_fd())
            .map_err(|_| Error::internal("negative file descriptor"))?;
        let file_reg = agent
            .register(
                &RawRegion {
                    addr: 0,
                    len: slot_bytes * num_blocks,
                    mem: MemType::File,
                    dev: fd,
                },
                Some(NixlBackend::Posix),
            )
            .map_err(|e| e.with("tier", kind).with("path", slots.path().display()))?;
        let bounce = BouncePool::new(agent, NixlBackend::Posix, opts.max_in_flight, slot_bytes)
            .map_err(|e| e.with("tier", kind))?;
        tracing::debug!(
            tier = %kind,
            path = %slots.path().display(),
            agent = %agent.name(),
            direct_io = slots.direct_io(),
            "NIXL disk tier created"
        );
        Ok(Self {
            file_reg: Some(file_reg),
            bounce,
            slots,
            agent: agent.clone(),
        })
    }

    /// The tier's file.
    pub fn path(&self) -> &Path {
        self.slots.path()
    }

    /// Whether the file is opened with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.slots.direct_io()
    }

    /// Why O_DIRECT was requested but is not in use (see
    /// [`DiskTier::direct_io_fallback_reason`](crate::backends::disk::DiskTier::direct_io_fallback_reason)).
    pub fn direct_io_fallback_reason(&self) -> Option<&str> {
        self.slots.direct_io_fallback_reason()
    }

    /// Bytes of one block's slot in the file.
    pub fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }

    /// The agent doing the I/O.
    pub fn agent(&self) -> &NixlAgent {
        &self.agent
    }

    fn fd(&self) -> u64 {
        self.slots.file().as_raw_fd() as u64
    }

    /// Whether `segments` can go to NIXL as they are.
    fn usable_directly<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        self.slots.aligned(segments) && self.agent.all_registered(segments)
    }

    /// Bytes moved per bounced transfer: the whole slot under O_DIRECT (aligned length).
    fn bounce_len(&self) -> usize {
        if self.direct_io() {
            self.slot_bytes()
        } else {
            self.bytes_per_block()
        }
    }

    fn file_io(&self, op: XferOp, block: usize, local: &[(usize, usize)]) -> Result<()> {
        let offset = usize::try_from(self.slots.offset(block))
            .map_err(|_| Error::internal("file offset overflows usize"))?;
        let pairs = pair_runs(local, &[(offset, local.iter().map(|r| r.1).sum())]);
        self.agent
            .transfer(
                op,
                NixlBackend::Posix,
                self.agent.name(),
                MemType::File,
                self.fd(),
                &pairs,
            )
            .map_err(|e| {
                e.with("tier", self.slots.kind())
                    .with("block", block)
                    .with("path", self.path().display())
            })
    }
}

impl StorageTier for NixlDiskTier {
    fn kind(&self) -> TierKind {
        self.slots.kind()
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: if self.direct_io() { DISK_ALIGNMENT } else { 1 },
            checksummed: true,
            max_in_flight: self.bounce.count,
        }
    }

    fn layout(&self) -> &Layout {
        self.slots.layout()
    }

    /// Reads and verifies `block`, as
    /// [`DiskTier::read_block`](crate::backends::disk::DiskTier) does.
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        self.slots.read_verified(block, dst, |dst, expected| {
            if self.usable_directly(dst) {
                self.file_io(XferOp::Read, block, &runs_of(dst))?;
                return Ok(hash_segments(dst));
            }
            let mut guard = self.bounce.take();
            let buf = guard.buf()?;
            self.file_io(XferOp::Read, block, &[(buf.addr(), self.bounce_len())])?;
            Ok(self
                .slots
                .deliver(buf.as_slice(self.bounce_len()), expected, dst))
        })
    }

    /// Writes `block` and records its checksum; a failed write leaves it never written.
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        self.slots.write_recorded(block, src, |src| {
            if self.usable_directly(src) {
                return self.file_io(XferOp::Write, block, &runs_of(src));
            }
            let len = self.bounce_len();
            let mut bg = self.bounce.take();
            let buf = bg.buf()?;
            self.slots.fill(buf.as_mut_slice(len), src);
            self.file_io(XferOp::Write, block, &[(buf.addr(), len)])
        })
    }
}

impl Drop for NixlDiskTier {
    fn drop(&mut self) {
        // Deregister the file while its descriptor is still open (fields drop after this).
        drop(self.file_reg.take());
    }
}
