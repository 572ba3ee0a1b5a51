//! The `disk` backend (G3): blocks in one preallocated file, O_DIRECT where the filesystem allows.
//!
//! A [`DiskTier`] owns exactly one file in its configured directory, created with a unique name
//! (process id + counter), mode `0600` and `O_EXCL`, preallocated to its full size, and removed
//! when the tier is dropped (unless [`DiskTierOptions::persist`] is set). The file holds canonical
//! block images (its [`Layout`] is always fully contiguous): block `b` sits in a *slot* of
//! `round_up(bytes_per_block, 4096)` bytes at byte offset `b × slot`, so every slot starts on a
//! [`DISK_ALIGNMENT`] boundary.
//!
//! I/O is positional and vectored (`preadv`/`pwritev`) on one shared file descriptor, so calls on
//! different blocks run in parallel from different threads. With O_DIRECT the page cache is
//! bypassed; caller buffers whose segments are all [`DISK_ALIGNMENT`]-aligned (address and length)
//! are used as they are, anything else goes through an aligned bounce buffer from a small pool
//! (at most `max_in_flight` buffers of one slot each are kept). When O_DIRECT is refused (tmpfs
//! on older kernels, some network filesystems, or a failing probe) the tier falls back to buffered
//! I/O, logs why, and reports it in [`DiskTier::direct_io_fallback_reason`].
//!
//! Invariants:
//! * every block written carries an xxh3-64 checksum of its canonical image, kept in memory (not in
//!   the file); every read verifies it and answers [`ErrorKind::Corrupt`] on a mismatch;
//! * a block that was never written (or whose last write failed part-way) is
//!   [`ErrorKind::NotFound`], never a block of zeros;
//! * the per-block lock guarding the checksum serialises writers of a block against its readers;
//!   different blocks never share bytes of the file, so they need no mutual exclusion;
//! * a bad block id or segment length is refused before any I/O: nothing on disk changes.
//!
//! Nothing is `fsync`ed: the tier is a cache whose checksums live in memory, so its contents do
//! not outlive the process in any usable form (a persisted file is kept only for inspection).

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::tier::{check_io, copy_segments, total_len, Capability, StorageTier, TierKind};

/// Alignment of slots in the file and of buffers used with O_DIRECT, in bytes.
pub const DISK_ALIGNMENT: usize = 4096;

/// Default for [`DiskTierOptions::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;

/// Most iovecs one `preadv`/`pwritev` call accepts (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// How many names to try when a generated file name already exists (a stale persisted file).
const NAME_ATTEMPTS: u32 = 64;

/// Distinguishes the files of the tiers of one process.
static NEXT_FILE_ID: AtomicU64 = AtomicU64::new(0);

/// How to create a [`DiskTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierOptions {
    /// Directory for the tier's file; created (with parents) if missing.
    pub dir: PathBuf,
    /// Use O_DIRECT when the filesystem accepts it. Default `true`; when refused the tier falls
    /// back to buffered I/O (see [`DiskTier::direct_io_fallback_reason`]).
    pub direct_io: bool,
    /// Keep the file when the tier is dropped. Default `false`. A kept file cannot be reopened as a
    /// tier (its checksums were in memory); it is for inspection only.
    pub persist: bool,
    /// Blocking calls the tier serves well in parallel, reported in [`Capability::max_in_flight`];
    /// also the number of bounce buffers kept for reuse. Default [`DEFAULT_MAX_IN_FLIGHT`] (4);
    /// must be non-zero.
    pub max_in_flight: usize,
}

impl DiskTierOptions {
    /// Options for a tier in `dir`, with every other field at its default.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            direct_io: true,
            persist: false,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// Sets [`Self::direct_io`].
    #[must_use]
    pub fn with_direct_io(mut self, direct_io: bool) -> Self {
        self.direct_io = direct_io;
        self
    }

    /// Sets [`Self::persist`].
    #[must_use]
    pub fn with_persist(mut self, persist: bool) -> Self {
        self.persist = persist;
        self
    }

    /// Sets [`Self::max_in_flight`].
    #[must_use]
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }
}

/// A heap buffer whose usable part starts on a [`DISK_ALIGNMENT`] boundary (safe code: it
/// over-allocates and skips to the first aligned byte).
struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` usable bytes.
    fn new(len: usize) -> Result<Self> {
        let total = len
            .checked_add(DISK_ALIGNMENT - 1)
            .ok_or_else(|| Error::invalid_argument(format!("buffer of {len} bytes overflows")))?;
        let mut storage = Vec::new();
        storage.try_reserve_exact(total).map_err(|_| {
            Error::no_space("bytes of bounce buffer", total, 0, total).with("tier", "disk")
        })?;
        storage.resize(total, 0);
        let start = storage.as_ptr().align_offset(DISK_ALIGNMENT);
        if start >= DISK_ALIGNMENT {
            return Err(Error::internal("cannot align a bounce buffer"));
        }
        Ok(Self {
            storage,
            start,
            len,
        })
    }

    fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Blocks in one preallocated file; see the [module docs](self).
pub struct DiskTier {
    kind: TierKind,
    layout: Layout,
    path: PathBuf,
    file: File,
    direct_io: bool,
    fallback_reason: Option<String>,
    persist: bool,
    max_in_flight: usize,
    /// Bytes of one slot: `bytes_per_block` rounded up to [`DISK_ALIGNMENT`].
    slot_bytes: usize,
    /// Checksum of each block's last complete write; `None` = never (successfully) written.
    checksums: Box<[RwLock<Option<u64>>]>,
    /// Reusable slot-sized bounce buffers (at most `max_in_flight` kept).
    bounce: Mutex<Vec<AlignedBuf>>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("direct_io", &self.direct_io)
            .field("fallback_reason", &self.fallback_reason)
            .field("layout", &self.layout)
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

impl DiskTier {
    /// Creates one preallocated file for `num_blocks` blocks of `dims` in `opts.dir` (created if
    /// missing). `kind` is normally [`TierKind::Disk`].
    ///
    /// Errors: invalid dimensions or a file size that does not fit an `off_t`
    /// ([`ErrorKind::InvalidLayout`]), `max_in_flight == 0` ([`ErrorKind::InvalidArgument`]), no
    /// room to preallocate ([`ErrorKind::NoSpace`]), any other file-system failure
    /// ([`ErrorKind::Io`], naming the path). On error no file is left behind.
    pub fn create(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
    ) -> Result<Self> {
        Self::create_with(kind, dims, num_blocks, opts, open_direct)
    }

    /// [`Self::create`] with the O_DIRECT opener (open + probe) passed in, so tests can force a
    /// fallback.
    fn create_with(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
        open_direct: impl FnOnce(&Path) -> std::result::Result<File, String>,
    ) -> Result<Self> {
        if opts.max_in_flight == 0 {
            return Err(
                Error::invalid_argument("max_in_flight must be non-zero").with("tier", kind)
            );
        }
        let layout = Layout::fully_contiguous(dims, num_blocks)?;
        let bytes_per_block = layout.bytes_per_block();
        let slot_bytes = bytes_per_block
            .checked_next_multiple_of(DISK_ALIGNMENT)
            .ok_or_else(|| {
                Error::invalid_layout("bytes_per_block rounded up to 4096 overflows usize")
            })?;
        let file_bytes = slot_bytes
            .checked_mul(num_blocks)
            .and_then(|n| u64::try_from(n).ok())
            .filter(|&n| libc::off_t::try_from(n).is_ok())
            .ok_or_else(|| {
                Error::invalid_layout(format!(
                    "{num_blocks} slots of {slot_bytes} bytes do not fit in one file"
                ))
                .with("tier", kind)
            })?;

        std::fs::create_dir_all(&opts.dir).map_err(|e| {
            Error::io("create_dir", e)
                .with("tier", kind)
                .with("path", opts.dir.display())
        })?;
        let (path, file) = create_file(kind, &opts.dir)?;

        if let Err(e) = preallocate(&file, file_bytes) {
            let err = if e.raw_os_error() == Some(libc::ENOSPC) {
                Error::new(
                    ErrorKind::NoSpace,
                    format!("no space to preallocate {file_bytes} bytes for the disk tier"),
                )
                .with_source(e)
            } else {
                Error::io("fallocate", e)
            };
            remove_quietly(&path);
            return Err(err.with("tier", kind).with("path", path.display()));
        }

        let (file, direct_io, fallback_reason) = if opts.direct_io {
            match open_direct(&path) {
                Ok(direct) => (direct, true, None),
                Err(reason) => {
                    tracing::warn!(
                        tier = %kind,
                        path = %path.display(),
                        %reason,
                        "O_DIRECT unavailable; disk tier falls back to buffered I/O"
                    );
                    (file, false, Some(reason))
                }
            }
        } else {
            (file, false, None)
        };
        tracing::debug!(
            tier = %kind,
            path = %path.display(),
            num_blocks,
            slot_bytes,
            direct_io,
            "disk tier created"
        );

        Ok(Self {
            kind,
            layout,
            path,
            file,
            direct_io,
            fallback_reason,
            persist: opts.persist,
            max_in_flight: opts.max_in_flight,
            slot_bytes,
            checksums: (0..num_blocks).map(|_| RwLock::new(None)).collect(),
            bounce: Mutex::new(Vec::new()),
        })
    }

    /// The tier's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether O_DIRECT is in use.
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// Why O_DIRECT was requested but is not in use (the failed open or probe); `None` when it is
    /// in use or was not requested.
    pub fn direct_io_fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Bytes of one block's slot in the file (`bytes_per_block` rounded up to [`DISK_ALIGNMENT`]).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// File offset of `block`'s slot. `block` must be in range (checked by the caller); the
    /// product fits (checked at creation).
    fn offset(&self, block: usize) -> u64 {
        (block * self.slot_bytes) as u64
    }

    fn checksum_lock(&self, op: &'static str, block: usize) -> Result<&RwLock<Option<u64>>> {
        self.checksums.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.checksums.len())
                .with("tier", self.kind)
                .with("op", op)
        })
    }

    /// Whether `segments` can be handed to the kernel as they are.
    fn usable_directly<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        !self.direct_io
            || segments.iter().all(|s| {
                s.is_empty()
                    || ((s.as_ptr() as usize) % DISK_ALIGNMENT == 0
                        && s.len() % DISK_ALIGNMENT == 0)
            })
    }

    fn take_bounce(&self) -> Result<AlignedBuf> {
        match self.bounce.lock().pop() {
            Some(buf) => Ok(buf),
            None => AlignedBuf::new(self.slot_bytes),
        }
    }

    fn return_bounce(&self, buf: AlignedBuf) {
        let mut pool = self.bounce.lock();
        if pool.len() < self.max_in_flight {
            pool.push(buf);
        }
    }

    fn io_error(&self, op: &'static str, block: usize, e: io::Error) -> Error {
        Error::io(op, e)
            .with("tier", self.kind)
            .with("block", block)
            .with("path", self.path.display())
    }

    /// Reads `block`'s slot through a bounce buffer, verifies it against `expected` and only then
    /// copies it into `dst` (so `dst` is untouched on a mismatch). Returns the checksum read.
    fn read_bounced(&self, block: usize, dst: &mut [IoSliceMut<'_>], expected: u64) -> Result<u64> {
        let mut buf = self.take_bounce()?;
        let result = preadv_all(
            &self.file,
            &mut [IoSliceMut::new(buf.as_mut_slice())],
            self.offset(block),
        )
        .map_err(|e| self.io_error("preadv", block, e))
        .map(|()| {
            let image = &buf.as_slice()[..self.bytes_per_block()];
            let actual = xxhash_rust::xxh3::xxh3_64(image);
            if actual == expected {
                copy_segments(&[IoSlice::new(image)], dst);
            }
            actual
        });
        self.return_bounce(buf);
        result
    }

    /// Writes the image in `src` to `block`'s slot through a bounce buffer (padding zeroed).
    fn write_bounced(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        let mut buf = self.take_bounce()?;
        let bytes_per_block = self.bytes_per_block();
        {
            let slot = buf.as_mut_slice();
            let (image, padding) = slot.split_at_mut(bytes_per_block);
            copy_segments(src, &mut [IoSliceMut::new(image)]);
            padding.fill(0);
        }
        let result = pwritev_all(
            &self.file,
            &[IoSlice::new(buf.as_slice())],
            self.offset(block),
        )
        .map_err(|e| self.io_error("pwritev", block, e));
        self.return_bounce(buf);
        result
    }
}

impl StorageTier for DiskTier {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: if self.direct_io { DISK_ALIGNMENT } else { 1 },
            checksummed: true,
            max_in_flight: self.max_in_flight,
        }
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Reads and verifies `block`. A block never written is [`ErrorKind::NotFound`]; a checksum
    /// mismatch is [`ErrorKind::Corrupt`] naming the block and the file, and then the contents of
    /// `dst` are unspecified and must not be trusted (with aligned buffers the corrupt bytes were
    /// read straight into them).
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        let guard = self.checksum_lock("read_block", block)?.read();
        let Some(expected) = *guard else {
            return Err(never_written(self.kind, block, &self.path));
        };
        let actual = if self.usable_directly(dst) {
            preadv_all(&self.file, dst, self.offset(block))
                .map_err(|e| self.io_error("preadv", block, e))?;
            hash_segments(dst)
        } else {
            self.read_bounced(block, dst, expected)?
        };
        verify_checksum(self.kind, block, &self.path, expected, actual)
    }

    /// Writes `block` and records its checksum. If the write fails part-way the block counts as
    /// never written until it is written again.
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        let mut guard = self.checksum_lock("write_block", block)?.write();
        let checksum = hash_segments(src);
        *guard = None;
        if self.usable_directly(src) {
            pwritev_all(&self.file, src, self.offset(block))
                .map_err(|e| self.io_error("pwritev", block, e))?;
        } else {
            self.write_bounced(block, src)?;
        }
        *guard = Some(checksum);
        Ok(())
    }
}

impl Drop for DiskTier {
    /// Removes the file unless [`DiskTierOptions::persist`] was set.
    fn drop(&mut self) {
        if !self.persist {
            remove_quietly(&self.path);
        }
    }
}

/// xxh3-64 over the concatenation of `segments` (streaming, no copy).
/// The error for a block that was never written (or whose last write failed part-way).
pub(crate) fn never_written(kind: TierKind, block: usize, path: &Path) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("block {block} was never written"),
    )
    .with("tier", kind)
    .with("block", block)
    .with("path", path.display())
}

/// `Ok` when the checksum read matches the one recorded; otherwise a logged `Corrupt` error
/// saying the bytes read are not to be trusted.
pub(crate) fn verify_checksum(
    kind: TierKind,
    block: usize,
    path: &Path,
    expected: u64,
    actual: u64,
) -> Result<()> {
    if actual == expected {
        return Ok(());
    }
    tracing::warn!(tier = %kind, block, path = %path.display(), "disk block failed its checksum");
    Err(Error::corrupt(format!(
        "block {block} failed its checksum (stored {expected:016x}, read {actual:016x}); \
         the bytes read are not to be trusted"
    ))
    .with("tier", kind)
    .with("block", block)
    .with("path", path.display()))
}

/// xxh3-64 over the concatenation of `segments`: the checksum recorded per block.
pub(crate) fn hash_segments<T: Deref<Target = [u8]>>(segments: &[T]) -> u64 {
    let mut hasher = Xxh3::new();
    for s in segments {
        hasher.update(s);
    }
    hasher.digest()
}

/// Removes `path`, logging (not returning) a failure other than "already gone".
fn remove_quietly(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove disk tier file");
        }
    }
}

/// Creates a new file with a unique name in `dir`, mode 0600, readable and writable.
fn create_file(kind: TierKind, dir: &Path) -> Result<(PathBuf, File)> {
    let pid = std::process::id();
    let mut last_err = None;
    for _ in 0..NAME_ATTEMPTS {
        let id = NEXT_FILE_ID.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("kvbm-{kind}-{pid}-{id}.blocks"));
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last_err = Some((path, e)),
            Err(e) => {
                return Err(Error::io("create", e)
                    .with("tier", kind)
                    .with("path", path.display()))
            }
        }
    }
    Err(match last_err {
        Some((path, e)) => Error::io("create", e)
            .with("tier", kind)
            .with("path", path.display()),
        None => Error::internal("no file name was tried"),
    })
}

/// Gives the file its full length, with real blocks where the filesystem supports it.
fn preallocate(file: &File, len: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let off_len = libc::off_t::try_from(len).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidInput, "file size overflows off_t")
        })?;
        loop {
            // SAFETY: plain syscall on a descriptor we own; no memory is passed.
            let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, off_len) };
            if rc == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP | libc::ENOSYS) => break,
                _ => return Err(e),
            }
        }
    }
    file.set_len(len)
}

/// Opens `path` again with O_DIRECT and checks that an aligned write and read at slot 0 work.
/// `Err` carries the reason to report.
fn open_direct(path: &Path) -> std::result::Result<File, String> {
    #[cfg(target_os = "linux")]
    {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| format!("open with O_DIRECT failed: {e}"))?;
        let mut out = AlignedBuf::new(DISK_ALIGNMENT).map_err(|e| e.to_string())?;
        for (i, b) in out.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let mut back = AlignedBuf::new(DISK_ALIGNMENT).map_err(|e| e.to_string())?;
        pwritev_all(&file, &[IoSlice::new(out.as_slice())], 0)
            .map_err(|e| format!("O_DIRECT probe write failed: {e}"))?;
        preadv_all(&file, &mut [IoSliceMut::new(back.as_mut_slice())], 0)
            .map_err(|e| format!("O_DIRECT probe read failed: {e}"))?;
        if out.as_slice() != back.as_slice() {
            return Err("O_DIRECT probe read back different bytes".to_owned());
        }
        Ok(file)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        Err("O_DIRECT is only used on Linux".to_owned())
    }
}

fn to_off_t(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset overflows off_t"))
}

/// Writes all of `src` at `offset`: `pwritev` at most [`IOV_MAX`] segments at a time, resuming
/// after short writes and `EINTR`.
fn pwritev_all(file: &File, src: &[IoSlice<'_>], mut offset: u64) -> io::Result<()> {
    let mut owned: Vec<IoSlice<'_>> = src.iter().filter(|s| !s.is_empty()).copied().collect();
    let mut bufs: &mut [IoSlice<'_>] = &mut owned;
    while !bufs.is_empty() {
        let count = bufs.len().min(IOV_MAX);
        // SAFETY: `IoSlice` is ABI-compatible with `iovec` on Unix; the first `count` entries
        // borrow live buffers for the duration of the call, which only reads them.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                bufs.as_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                to_off_t(offset)?,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote no bytes",
            ));
        }
        let n = n.unsigned_abs();
        offset += n as u64;
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Fills all of `dst` from `offset`: `preadv` at most [`IOV_MAX`] segments at a time, resuming
/// after short reads and `EINTR`. `dst` itself is left as it was (only its bytes change).
fn preadv_all(file: &File, dst: &mut [IoSliceMut<'_>], mut offset: u64) -> io::Result<()> {
    let mut owned: Vec<IoSliceMut<'_>> = dst
        .iter_mut()
        .filter(|s| !s.is_empty())
        .map(|s| IoSliceMut::new(&mut s[..]))
        .collect();
    let mut bufs: &mut [IoSliceMut<'_>] = &mut owned;
    while !bufs.is_empty() {
        let count = bufs.len().min(IOV_MAX);
        // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on Unix; the first `count` entries
        // borrow live, exclusively held buffers for the duration of the call.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                bufs.as_mut_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                to_off_t(offset)?,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "preadv reached the end of the file",
            ));
        }
        let n = n.unsigned_abs();
        offset += n as u64;
        IoSliceMut::advance_slices(&mut bufs, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::StorageTierExt;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::PermissionsExt;

    fn dims() -> LayoutDims {
        LayoutDims {
            num_layers: 3,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        }
    }

    fn image(block: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + block * 31 + 1) as u8).collect()
    }

    fn tier_in(dir: &Path, direct_io: bool) -> DiskTier {
        DiskTier::create(
            TierKind::Disk,
            dims(),
            4,
            DiskTierOptions::new(dir).with_direct_io(direct_io),
        )
        .unwrap()
    }

    #[test]
    fn options_defaults() {
        let o = DiskTierOptions::new("/x");
        assert!(o.direct_io);
        assert!(!o.persist);
        assert_eq!(o.max_in_flight, 4);
    }

    #[test]
    fn file_is_mode_0600_preallocated_and_slots_are_aligned() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier_in(dir.path(), true);
        let meta = std::fs::metadata(tier.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(tier.slot_bytes(), DISK_ALIGNMENT);
        assert_eq!(meta.len(), 4 * DISK_ALIGNMENT as u64);
        assert!(tier.path().starts_with(dir.path()));
        println!(
            "O_DIRECT in {}: {} ({:?})",
            dir.path().display(),
            tier.direct_io(),
            tier.direct_io_fallback_reason()
        );
    }

    #[test]
    fn file_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier_in(dir.path(), true);
        let path = tier.path().to_owned();
        assert!(path.exists());
        drop(tier);
        assert!(!path.exists());
    }

    #[test]
    fn file_kept_with_persist() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::create(
            TierKind::Disk,
            dims(),
            2,
            DiskTierOptions::new(dir.path()).with_persist(true),
        )
        .unwrap();
        let path = tier.path().to_owned();
        drop(tier);
        assert!(path.exists());
    }

    #[test]
    fn two_tiers_get_distinct_files_and_missing_dir_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a/b");
        let a = tier_in(&nested, false);
        let b = tier_in(&nested, false);
        assert_ne!(a.path(), b.path());
    }

    #[test]
    fn uncreatable_dir_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").unwrap();
        let err = DiskTier::create(
            TierKind::Disk,
            dims(),
            2,
            DiskTierOptions::new(blocker.join("sub")),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(
            err.to_string().contains(&*blocker.to_string_lossy()),
            "{err}"
        );
    }

    #[test]
    fn zero_max_in_flight_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = DiskTier::create(
            TierKind::Disk,
            dims(),
            2,
            DiskTierOptions::new(dir.path()).with_max_in_flight(0),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn fallback_reason_on_tmpfs() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            println!("skipped: /dev/shm does not exist");
            return;
        }
        let dir = match tempfile::tempdir_in(shm) {
            Ok(d) => d,
            Err(e) => {
                println!("skipped: cannot create a directory in /dev/shm: {e}");
                return;
            }
        };
        let tier = tier_in(dir.path(), true);
        if tier.direct_io() {
            // Linux ≥ 6.6 accepts O_DIRECT on tmpfs: nothing to fall back from.
            println!("tmpfs accepts O_DIRECT on this kernel; no fallback to check");
            assert!(tier.direct_io_fallback_reason().is_none());
        } else {
            let reason = tier.direct_io_fallback_reason().unwrap();
            println!("tmpfs fallback reason: {reason}");
            assert!(reason.contains("O_DIRECT"), "{reason}");
            assert_eq!(tier.capability().direct_io_alignment, 1);
        }
        tier.write_block_from_slice(1, &image(1, 384)).unwrap();
        assert_eq!(tier.read_block_to_vec(1).unwrap(), image(1, 384));
    }

    #[test]
    fn forced_fallback_is_reported_and_works() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::create_with(
            TierKind::Disk,
            dims(),
            2,
            DiskTierOptions::new(dir.path()),
            |_| Err("simulated: open with O_DIRECT failed: Invalid argument".to_owned()),
        )
        .unwrap();
        assert!(!tier.direct_io());
        assert!(tier
            .direct_io_fallback_reason()
            .unwrap()
            .contains("simulated"));
        assert_eq!(tier.capability().direct_io_alignment, 1);
        tier.write_block_from_slice(1, &image(1, 384)).unwrap();
        assert_eq!(tier.read_block_to_vec(1).unwrap(), image(1, 384));
    }

    #[test]
    fn not_requested_means_no_reason() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier_in(dir.path(), false);
        assert!(!tier.direct_io());
        assert!(tier.direct_io_fallback_reason().is_none());
        assert_eq!(tier.capability().direct_io_alignment, 1);
    }

    #[test]
    fn never_written_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier_in(dir.path(), true);
        let err = tier.read_block_to_vec(2).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        assert_eq!(err.context_value("block"), Some("2"));
    }

    #[test]
    fn corruption_is_detected() {
        for direct_io in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let tier = tier_in(dir.path(), direct_io);
            let bpb = tier.bytes_per_block();
            tier.write_block_from_slice(0, &image(0, bpb)).unwrap();
            tier.write_block_from_slice(1, &image(1, bpb)).unwrap();
            {
                let mut f = OpenOptions::new().write(true).open(tier.path()).unwrap();
                f.seek(SeekFrom::Start(tier.slot_bytes() as u64 + 10))
                    .unwrap();
                f.write_all(&[0xAB, 0xCD, 0xEF]).unwrap();
                f.sync_all().unwrap();
            }
            let err = tier.read_block_to_vec(1).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
            assert_eq!(err.context_value("block"), Some("1"));
            let path = tier.path().display().to_string();
            assert_eq!(err.context_value("path"), Some(path.as_str()));
            // The neighbour is intact, and rewriting the block heals it.
            assert_eq!(tier.read_block_to_vec(0).unwrap(), image(0, bpb));
            tier.write_block_from_slice(1, &image(1, bpb)).unwrap();
            assert_eq!(tier.read_block_to_vec(1).unwrap(), image(1, bpb));
        }
    }

    fn aligned_dims() -> LayoutDims {
        LayoutDims {
            num_layers: 2,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 128,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn aligned_buffers_skip_the_bounce_and_corruption_is_still_caught() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::create(
            TierKind::Disk,
            aligned_dims(),
            2,
            DiskTierOptions::new(dir.path()),
        )
        .unwrap();
        let bpb = tier.bytes_per_block();
        assert_eq!(tier.slot_bytes(), bpb);
        let mut buf = AlignedBuf::new(bpb).unwrap();
        buf.as_mut_slice().copy_from_slice(&image(1, bpb));
        assert!(tier.usable_directly(&[IoSlice::new(buf.as_slice())]));
        assert!(tier.usable_directly(&[
            IoSlice::new(&buf.as_slice()[..DISK_ALIGNMENT]),
            IoSlice::new(&[]),
            IoSlice::new(&buf.as_slice()[DISK_ALIGNMENT..]),
        ]));
        // Off by one byte, or a piece whose length is not a multiple: bounce under O_DIRECT only.
        let odd = [IoSlice::new(&buf.as_slice()[1..])];
        assert_eq!(tier.usable_directly(&odd), !tier.direct_io());

        tier.write_block(1, &[IoSlice::new(buf.as_slice())])
            .unwrap();
        let mut back = AlignedBuf::new(bpb).unwrap();
        tier.read_block(1, &mut [IoSliceMut::new(back.as_mut_slice())])
            .unwrap();
        assert_eq!(back.as_slice(), buf.as_slice());
        assert!(
            tier.bounce.lock().is_empty(),
            "aligned I/O used a bounce buffer"
        );

        {
            let mut f = OpenOptions::new().write(true).open(tier.path()).unwrap();
            f.seek(SeekFrom::Start(tier.slot_bytes() as u64 + bpb as u64 - 1))
                .unwrap();
            f.write_all(&[!image(1, bpb)[bpb - 1]]).unwrap();
            f.sync_all().unwrap();
        }
        let err = tier
            .read_block(1, &mut [IoSliceMut::new(back.as_mut_slice())])
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.message().contains("not to be trusted"));
    }

    #[test]
    fn bounce_buffers_are_reused_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::create(
            TierKind::Disk,
            dims(),
            8,
            DiskTierOptions::new(dir.path()).with_max_in_flight(2),
        )
        .unwrap();
        let bpb = tier.bytes_per_block();
        std::thread::scope(|s| {
            for t in 0..4 {
                let tier = &tier;
                s.spawn(move || {
                    for round in 0..20 {
                        let b = (t + round * 4) % 8;
                        tier.write_block_from_slice(b, &image(b, bpb)).unwrap();
                        assert_eq!(tier.read_block_to_vec(b).unwrap(), image(b, bpb));
                    }
                });
            }
        });
        let kept = tier.bounce.lock().len();
        assert!(kept <= 2, "{kept} bounce buffers kept");
        if tier.direct_io() {
            assert!(kept >= 1);
        }
    }

    #[test]
    fn many_segments_exceed_iov_max() {
        let dims = LayoutDims {
            num_layers: 2,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 128,
            dtype_bytes: 2,
        };
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::create(
            TierKind::Disk,
            dims,
            2,
            DiskTierOptions::new(dir.path()).with_direct_io(false),
        )
        .unwrap();
        let bpb = tier.bytes_per_block();
        let img = image(1, bpb);
        let src: Vec<IoSlice<'_>> = img.chunks(3).map(IoSlice::new).collect();
        assert!(src.len() > IOV_MAX);
        tier.write_block(1, &src).unwrap();
        let mut back = vec![0u8; bpb];
        {
            let mut dst: Vec<IoSliceMut<'_>> = back.chunks_mut(5).map(IoSliceMut::new).collect();
            tier.read_block(1, &mut dst).unwrap();
        }
        assert_eq!(back, img);
    }
}
