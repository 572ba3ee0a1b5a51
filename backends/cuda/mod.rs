//! The `cuda` backend: the engine's GPU cache as the device tier (G1), page-locked host memory as
//! the host tier (G2), and the copies between them on dedicated CUDA streams.
//!
//! Built on cudarc's driver API with `dynamic-loading`: nothing CUDA is needed to build, and
//! `libcuda.so.1` is opened at run time. [`probe()`] is the one door: it checks the library can be
//! opened (`dlopen`) before cudarc touches it, guards cudarc's first calls with `catch_unwind`
//! (cudarc panics when a library or symbol is missing), and answers an [`Error`](crate::Error)
//! that names the library or the driver call that failed. Every constructor here goes through it,
//! so no driver or no GPU is an error, never a panic.
//!
//! * [`CudaDevice`] — one GPU: its primary context (the one the engine uses), shared by the tiers.
//! * [`CudaDeviceTier`] — the engine's KV cache as a [`StorageTier`](crate::StorageTier):
//!   registered device pointers (one per allocation of the [`Layout`](crate::Layout)) that the
//!   engine owns; we never allocate or free them.
//! * [`PinnedHostTier`] — page-locked host memory (`cuMemHostAlloc`), host addressable like the
//!   memory tier; what G2 should be when CUDA is on.
//! * [`DeviceBuffer`], [`PinnedBuffer`] — owned GPU and pinned allocations (tests, the bench, and
//!   the device tier's bounce buffers).
//!
//! ## Copies
//!
//! Each device tier has two non-blocking streams: a *store* stream for device → host reads and a
//! *load* stream for host → device writes. A batch of block pairs becomes a list of [`CopyOp`]s
//! ([`plan_copies`]): runs adjacent on both sides merge into one copy, and a run repeated at a
//! fixed stride over consecutive blocks becomes one strided 2D copy (`cuMemcpy2DAsync`). The
//! batch's copies are enqueued back to back, one CUDA event is recorded after them, and the calling
//! thread — a transfer task on the transfer engine's blocking pool, never the engine's thread —
//! waits on that event (`CU_EVENT_BLOCKING_SYNC`: it sleeps, it does not spin).
//!
//! The transfer engine reaches these batches through the device tier's
//! [`BatchCopy`](crate::tier::BatchCopy) hook ([`StorageTier::batch_copy`](crate::StorageTier)):
//! any transfer with a [`CudaDeviceTier`] on one side and another kind of tier on the other is one
//! batch of planned copies per engine batch; see `batch.rs` for the paths and the lock order.
//!
//! ## Files
//!
//! | file | owns |
//! |---|---|
//! | `probe.rs` | finding the driver and its GPUs ([`probe()`]); driver errors as [`Error`](crate::Error)s |
//! | `gpu.rs` | [`CudaDevice`], [`DeviceBuffer`], [`PinnedBuffer`]; streams, events, enqueueing one copy |
//! | `plan.rs` | copy planning, pure: [`block_pieces`], [`plan_copies`] |
//! | `device.rs` | [`CudaDeviceTier`]: registration, locks, streams, store gating, `StorageTier` |
//! | `batch.rs` | the device tier's batched copies to and from other tiers, and its `BatchCopy` hook |
//! | `pinned.rs` | [`PinnedHostTier`] |
//!
//! Dependencies run one way: `probe` ← `gpu` ← `device` ← `batch`, with `plan` used by the last
//! three and `pinned` on `gpu` alone. Everything public is re-exported here: callers name
//! `backends::cuda::X`, never a file.

mod batch;
mod device;
mod gpu;
mod pinned;
mod plan;
mod probe;

/// The cudarc this backend is built on, for callers that need raw driver types (events, streams).
pub use cudarc;

pub use batch::{MAX_BATCH_BLOCKS, MAX_BOUNCE_BYTES};
pub use device::{device_of, CopyStats, CudaDeviceTier, DeviceRun};
pub use gpu::{CudaDevice, DeviceBuffer, PinnedBuffer};
pub use pinned::PinnedHostTier;
pub use plan::{block_pieces, plan_copies, CopyOp, Direction, Piece};
/// A failed driver call as an [`Error`](crate::Error) (for the tool's bench, and every file here).
pub(crate) use probe::cuda_err;
pub use probe::{probe, CudaInfo, GpuInfo, DRIVER_LIBRARIES};
