//! The load fence: how a load that missed its deadline is abandoned without its late I/O ever
//! reaching the engine's device blocks.
//!
//! A load from a tier that does I/O (disk, remote) writes the device through a [`FencedDevice`]:
//! a wrapper of the device tier whose writes go first into a private buffer (the I/O lands there,
//! however long it takes), then are *committed* — copied into the device block — only while the
//! fence is open. When the load's deadline passes, the worker [closes](FencedDevice::close) the
//! fence: blocks committed before are loaded, every other block is a load error the engine
//! recomputes, and the stuck I/O finishes in the background into its buffer, which is dropped.
//!
//! Invariants: after [`FencedDevice::close`] returns, no byte of this load is written to the
//! device (a commit holds the fence's lock for its copy, so closing waits for at most one
//! in-memory block copy, never for I/O); the set it returns is exactly the blocks written; the
//! wrapper lends no batch hook (every block goes through the commit). `tests/faults.rs` checks
//! them end to end (a stalled disk load never writes the device after its deadline).

use std::collections::HashSet;
use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::layout::Layout;
use crate::tier::{Capability, StorageTier, TierKind};

#[derive(Debug, Default)]
struct FenceState {
    closed: bool,
    committed: HashSet<usize>,
}

/// The device tier as one fenced load sees it; see the [module docs](self).
#[derive(Debug)]
pub(crate) struct FencedDevice {
    inner: Arc<dyn StorageTier>,
    state: Mutex<FenceState>,
}

impl FencedDevice {
    pub(crate) fn new(inner: Arc<dyn StorageTier>) -> Self {
        Self {
            inner,
            state: Mutex::new(FenceState::default()),
        }
    }

    /// Closes the fence: nothing is written to the device from now on. Returns the device blocks
    /// written before.
    pub(crate) fn close(&self) -> HashSet<usize> {
        let mut st = self.state.lock();
        st.closed = true;
        std::mem::take(&mut st.committed)
    }

    /// Copies one block's image into the device while the fence is open.
    fn commit(&self, block: usize, image: &[IoSlice<'_>]) -> Result<()> {
        let mut st = self.state.lock();
        if st.closed {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "load abandoned at its deadline: not written to the device",
            )
            .with("block", block));
        }
        self.inner.write_block(block, image)?;
        st.committed.insert(block);
        Ok(())
    }
}

impl StorageTier for FencedDevice {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }

    fn capability(&self) -> Capability {
        self.inner.capability()
    }

    fn layout(&self) -> &Layout {
        self.inner.layout()
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        self.inner.read_block(block, dst)
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        // The image is already in memory (the engine's bounce buffer): commit it.
        self.commit(block, src)
    }

    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        self.inner.with_block(block, f)
    }

    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        if !self.inner.capability().host_addressable {
            return Err(Error::unsupported(format!(
                "{} tier is not host addressable",
                self.inner.kind()
            )));
        }
        // The source's I/O lands in a private buffer, with no lock held: however long it takes,
        // it cannot reach the device once the fence is closed.
        let mut buf = vec![0u8; self.inner.bytes_per_block()];
        f(&mut [IoSliceMut::new(&mut buf)])?;
        self.commit(block, &[IoSlice::new(&buf)])
    }
}
