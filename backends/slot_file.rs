//! The slot file both disk tiers keep their blocks in (the built-in
//! [`DiskTier`](super::disk::DiskTier) and, with the `nixl` feature, the NIXL disk tier): its
//! creation, its slots and the per-block checksum table that makes every read verified.
//!
//! A [`SlotFile`] owns one file in its directory, created with a unique name (process id +
//! counter), mode `0600`, `O_EXCL | O_NOFOLLOW`, preallocated to its full size, switched to
//! O_DIRECT when asked and the filesystem accepts it (checked with an aligned write and read), and
//! removed when dropped unless persisted. Block `b` sits in a *slot* of
//! `round_up(bytes_per_block, 4096)` bytes at byte offset `b × slot`, so every slot starts on a
//! [`DISK_ALIGNMENT`] boundary.
//!
//! Files are handled so that nobody else can swap or plant them:
//! * the file is opened exactly once: O_DIRECT is turned on with `fcntl(F_SETFL)` on that
//!   descriptor, never by reopening the path, so what is registered and written is the inode that
//!   was created;
//! * the directory ([`prepare_dir`]) is created only as its last component, mode `0700` (its
//!   parent must exist); an existing directory must be owned by this user (or root) and not
//!   writable by others unless sticky (like `/tmp`), else creation is refused naming the path;
//! * while the tier lives its file is held under an exclusive `flock`. A process killed with
//!   SIGKILL cannot remove its file, so each new tier removes, in its directory, the files named
//!   like a tier's (`kvbm-<tier>-<pid>-<n>.blocks`) whose process is gone and whose lock is free
//!   (both checked, so a live tier's file, even from another pid namespace, is never removed).
//!   A persisted file is named `kvbm-<tier>-<pid>-<n>.persist.blocks` and never removed.
//!
//! The tiers do the I/O their own way; the protocol around it is here, in
//! [`SlotFile::read_verified`] and [`SlotFile::write_recorded`]:
//! * a bad block id or segment length is refused before any I/O;
//! * every block written records the xxh3-64 checksum of its canonical image (in memory, not in
//!   the file), cleared while the write runs, so a block never written or whose last write failed
//!   part-way is [`ErrorKind::NotFound`], never a block of zeros;
//! * every read is verified against it: a mismatch is a logged [`ErrorKind::Corrupt`];
//! * the per-block lock around the checksum serialises writers of a block against its readers;
//!   different blocks never share bytes of the file, so they need no mutual exclusion.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use xxhash_rust::xxh3::Xxh3;

mod persisted;

pub(crate) use persisted::flush_all_persisted;
pub use persisted::INDEX_SAVE_WITHIN;

use super::disk::DiskTierOptions;

use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, Layout, LayoutDims};
use crate::tier::{check_io, copy_segments, total_len, TierKind};

/// Alignment of slots in the file and of buffers used with O_DIRECT, in bytes.
pub const DISK_ALIGNMENT: usize = 4096;

/// Most iovecs one `preadv`/`pwritev` call accepts (Linux `IOV_MAX`).
pub(crate) const IOV_MAX: usize = 1024;

/// How many names to try when a generated file name already exists (a stale persisted file).
const NAME_ATTEMPTS: u32 = 64;

/// Most directory entries looked at for files of dead processes per tier created: keeps start-up
/// bounded in a directory shared with much else.
const MAX_STALE_SCAN: usize = 4096;

/// Distinguishes the files of the tiers of one process.
static NEXT_FILE_ID: AtomicU64 = AtomicU64::new(0);

/// One preallocated file of checksummed block slots; see the [module docs](self).
pub(crate) struct SlotFile {
    kind: TierKind,
    layout: Layout,
    path: PathBuf,
    file: File,
    direct_io: bool,
    fallback_reason: Option<String>,
    persist: bool,
    /// Bytes of one slot: `bytes_per_block` rounded up to [`DISK_ALIGNMENT`].
    slot_bytes: usize,
    /// Checksum of each block's last complete write; `None` = never (successfully) written.
    checksums: Box<[RwLock<Option<u64>>]>,
    /// A persisted file's index, kept durable (`persisted.rs`); `None` otherwise.
    durable: Option<std::sync::Arc<persisted::Durable>>,
}

impl std::fmt::Debug for SlotFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotFile")
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("direct_io", &self.direct_io)
            .field("fallback_reason", &self.fallback_reason)
            .field("layout", &self.layout)
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

impl SlotFile {
    /// Creates one preallocated file for `num_blocks` blocks of `dims` in `opts.dir` (its last
    /// component created `0700` if missing; see [`prepare_dir`]), switched to O_DIRECT (and
    /// probed) when `opts.direct_io` is set; files of dead processes in the directory are removed
    /// first.
    ///
    /// Errors: `max_in_flight == 0` ([`ErrorKind::InvalidArgument`]), invalid dimensions or a
    /// file size that does not fit an `off_t` ([`ErrorKind::InvalidLayout`]), no room to
    /// preallocate ([`ErrorKind::NoSpace`]), any other file-system failure ([`ErrorKind::Io`],
    /// naming the path). On error no file is left behind.
    pub(crate) fn create(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: &DiskTierOptions,
    ) -> Result<Self> {
        Self::create_with(kind, dims, num_blocks, opts, open_direct)
    }

    /// [`Self::create`] with the O_DIRECT switch (set + probe, on the open file) passed in, so
    /// tests can force a fallback.
    pub(crate) fn create_with(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: &DiskTierOptions,
        open_direct: impl FnOnce(&File) -> std::result::Result<(), String>,
    ) -> Result<Self> {
        let (layout, slot_bytes, file_bytes) = prepare(kind, dims, num_blocks, opts)?;
        let (path, file) = create_file(kind, &opts.dir, opts.persist)?;

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

        let (direct_io, fallback_reason) =
            match direct_setup(kind, &path, &file, opts.direct_io, open_direct) {
                Ok(v) => v,
                Err(e) => {
                    remove_quietly(&path);
                    return Err(e);
                }
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
            slot_bytes,
            checksums: (0..num_blocks).map(|_| RwLock::new(None)).collect(),
            durable: None,
        })
    }

    /// The file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (with O_DIRECT when [`Self::direct_io`]).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The tier's level.
    pub(crate) fn kind(&self) -> TierKind {
        self.kind
    }

    /// The blocks' layout (always fully contiguous: canonical images).
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether O_DIRECT is in use.
    pub(crate) fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// Why O_DIRECT was requested but is not in use; `None` when it is in use or was not
    /// requested.
    pub(crate) fn direct_io_fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Bytes of one slot (`bytes_per_block` rounded up to [`DISK_ALIGNMENT`]).
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// File offset of `block`'s slot. `block` must be in range (checked by the caller); the
    /// product fits (checked at creation).
    pub(crate) fn offset(&self, block: usize) -> u64 {
        (block * self.slot_bytes) as u64
    }

    /// Whether `segments` meet O_DIRECT's alignment (address and length), or O_DIRECT is off.
    pub(crate) fn aligned<T: Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        !self.direct_io
            || segments.iter().all(|s| {
                s.is_empty()
                    || ((s.as_ptr() as usize) % DISK_ALIGNMENT == 0
                        && s.len() % DISK_ALIGNMENT == 0)
            })
    }

    /// The error for an I/O call that failed on `block`.
    pub(crate) fn io_error(&self, op: &'static str, block: usize, e: io::Error) -> Error {
        Error::io(op, e)
            .with("tier", self.kind)
            .with("block", block)
            .with("path", self.path.display())
    }

    fn checksum_lock(&self, op: &'static str, block: usize) -> Result<&RwLock<Option<u64>>> {
        self.checksums.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.checksums.len())
                .with("tier", self.kind)
                .with("op", op)
        })
    }

    /// Reads and verifies `block`: checks the call, holds the block's lock, answers
    /// [`ErrorKind::NotFound`] for a block never written, runs `read(dst, expected)` (which fills
    /// `dst` and returns the checksum of what it read) and compares. On a mismatch
    /// ([`ErrorKind::Corrupt`]) the contents of `dst` are unspecified.
    pub(crate) fn read_verified(
        &self,
        block: usize,
        dst: &mut [IoSliceMut<'_>],
        read: impl FnOnce(&mut [IoSliceMut<'_>], u64) -> Result<u64>,
    ) -> Result<()> {
        check_io(
            self.kind,
            "read_block",
            block,
            self.layout.num_blocks(),
            total_len(dst),
            self.layout.bytes_per_block(),
        )?;
        let guard = self.checksum_lock("read_block", block)?.read();
        let Some(expected) = *guard else {
            return Err(never_written(self.kind, block, &self.path));
        };
        let actual = read(dst, expected)?;
        verify_checksum(self.kind, block, &self.path, expected, actual)
    }

    /// Writes `block` through `write` and records its checksum: checks the call, holds the
    /// block's lock, and leaves the block never written if `write` fails.
    pub(crate) fn write_recorded(
        &self,
        block: usize,
        src: &[IoSlice<'_>],
        write: impl FnOnce(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        check_io(
            self.kind,
            "write_block",
            block,
            self.layout.num_blocks(),
            total_len(src),
            self.layout.bytes_per_block(),
        )?;
        let mut guard = self.checksum_lock("write_block", block)?.write();
        let checksum = hash_segments(src);
        // A persisted index withdraws the block first: refused (nothing written) if it cannot.
        self.before_write(block)?;
        *guard = None;
        write(src)?;
        *guard = Some(checksum);
        Ok(())
    }

    /// For a read through a bounce buffer: hashes the image read (`slot`'s first
    /// `bytes_per_block` bytes) and copies it into `dst` only when it matches `expected`, so
    /// `dst` is untouched on a mismatch. Returns the checksum read.
    pub(crate) fn deliver(&self, slot: &[u8], expected: u64, dst: &mut [IoSliceMut<'_>]) -> u64 {
        let image = &slot[..self.layout.bytes_per_block().min(slot.len())];
        let actual = xxhash_rust::xxh3::xxh3_64(image);
        if actual == expected {
            copy_segments(&[IoSlice::new(image)], dst);
        }
        actual
    }

    /// For a write through a bounce buffer: the image in `src` at the start of `slot`, the rest
    /// zeroed.
    pub(crate) fn fill(&self, slot: &mut [u8], src: &[IoSlice<'_>]) {
        let bytes_per_block = self.layout.bytes_per_block().min(slot.len());
        let (image, padding) = slot.split_at_mut(bytes_per_block);
        copy_segments(src, &mut [IoSliceMut::new(image)]);
        padding.fill(0);
    }
}

/// Checks the options, makes the directory ready (and clears dead processes' files from it), and
/// returns the file's [`geometry`].
fn prepare(
    kind: TierKind,
    dims: LayoutDims,
    num_blocks: usize,
    opts: &DiskTierOptions,
) -> Result<(Layout, usize, u64)> {
    if opts.max_in_flight == 0 {
        return Err(Error::invalid_argument("max_in_flight must be non-zero").with("tier", kind));
    }
    let geometry = geometry(kind, dims, num_blocks)?;
    prepare_dir(&opts.dir).map_err(|e| e.with("tier", kind))?;
    remove_stale_files(&opts.dir);
    Ok(geometry)
}

/// A slot file's layout, slot size and file size for `num_blocks` blocks of `dims`.
fn geometry(kind: TierKind, dims: LayoutDims, num_blocks: usize) -> Result<(Layout, usize, u64)> {
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

    Ok((layout, slot_bytes, file_bytes))
}

/// Turns O_DIRECT on for `file` when asked and accepted (`open_direct` sets and probes it),
/// else leaves buffered I/O on and says why.
fn direct_setup(
    kind: TierKind,
    path: &Path,
    file: &File,
    wanted: bool,
    open_direct: impl FnOnce(&File) -> std::result::Result<(), String>,
) -> Result<(bool, Option<String>)> {
    if !wanted {
        return Ok((false, None));
    }
    match open_direct(file) {
        Ok(()) => Ok((true, None)),
        Err(reason) => {
            set_direct(file, false).map_err(|e| {
                Error::io("fcntl", e)
                    .with("tier", kind)
                    .with("path", path.display())
            })?;
            tracing::warn!(
                tier = %kind,
                path = %path.display(),
                %reason,
                "O_DIRECT unavailable; disk tier falls back to buffered I/O"
            );
            Ok((false, Some(reason)))
        }
    }
}

/// A heap buffer whose usable part starts on a [`DISK_ALIGNMENT`] boundary (safe code: it
/// over-allocates and skips to the first aligned byte).
pub(crate) struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` usable bytes.
    pub(crate) fn new(len: usize) -> Result<Self> {
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

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// The error for a block that was never written (or whose last write failed part-way).
fn never_written(kind: TierKind, block: usize, path: &Path) -> Error {
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
fn verify_checksum(
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

/// Creates a new file with a unique name in `dir` (`O_EXCL | O_NOFOLLOW`, mode 0600, readable
/// and writable) and takes its exclusive `flock`, held as long as the file is open.
fn create_file(kind: TierKind, dir: &Path, persist: bool) -> Result<(PathBuf, File)> {
    let pid = std::process::id();
    let suffix = if persist { ".persist" } else { "" };
    let mut last_err = None;
    for _ in 0..NAME_ATTEMPTS {
        let id = NEXT_FILE_ID.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("kvbm-{kind}-{pid}-{id}{suffix}.blocks"));
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => {
                if let Err(e) = lock(&file, false) {
                    remove_quietly(&path);
                    return Err(Error::io("flock", e)
                        .with("tier", kind)
                        .with("path", path.display()));
                }
                return Ok((path, file));
            }
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

/// `flock(LOCK_EX | LOCK_NB)` on `file`; `Ok(false)` when another open file holds it (only
/// when `try_only`; otherwise that is an error too).
fn lock(file: &File, try_only: bool) -> io::Result<bool> {
    loop {
        // SAFETY: plain syscall on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if try_only => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// The error for a disk directory that cannot be used safely or at all.
fn dir_error(dir: &Path, what: impl std::fmt::Display) -> Error {
    Error::invalid_argument(format!("disk directory {}: {what}", dir.display()))
        .with("path", dir.display())
}

/// Makes `dir` ready for a tier's file: creates its last component (mode `0700`; the parent must
/// exist, nothing else is created) when missing, and checks that the directory is owned by this
/// user or root and is not writable by others unless sticky.
///
/// Errors ([`ErrorKind::InvalidArgument`] naming the path): an empty path, a missing parent, a
/// path that is not a directory, a foreign owner, a group- or world-writable non-sticky
/// directory; [`ErrorKind::Io`] for another failure to create it.
pub(crate) fn prepare_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if dir.as_os_str().is_empty() {
        return Err(Error::invalid_argument(
            "the disk directory is an empty path",
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    // A symlink in the directory's place is followed only when this user or root made it (a
    // stranger's link in a shared /tmp must not redirect the tier).
    if let Ok(link) = std::fs::symlink_metadata(dir) {
        if link.file_type().is_symlink() && link.uid() != me && link.uid() != 0 {
            return Err(dir_error(
                dir,
                format_args!(
                    "a symbolic link owned by uid {}; refusing to follow it",
                    link.uid()
                ),
            ));
        }
    }
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let parent = match dir.parent() {
                Some(p) if p.as_os_str().is_empty() => Path::new("."),
                Some(p) => p,
                None => Path::new("/"),
            };
            if !parent.is_dir() {
                return Err(dir_error(
                    dir,
                    format_args!(
                        "its parent {} is not an existing directory (only the last component \
                         is created)",
                        parent.display()
                    ),
                ));
            }
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(Error::io("create_dir", e).with("path", dir.display()));
                }
            }
            std::fs::metadata(dir).map_err(|e| Error::io("stat", e).with("path", dir.display()))?
        }
        Err(e) => return Err(Error::io("stat", e).with("path", dir.display())),
    };
    if !meta.is_dir() {
        return Err(dir_error(dir, "not a directory"));
    }
    if meta.uid() != me && meta.uid() != 0 {
        return Err(dir_error(
            dir,
            format_args!(
                "owned by uid {}, not by this user (uid {me}) or root; refusing to keep the disk \
                 tier's file where another user controls it",
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(dir_error(
            dir,
            format_args!(
                "writable by other users (mode {:o}) and not sticky; they could replace the disk \
                 tier's file (use a directory of mode 0700)",
                mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// The process id in a non-persisted tier file's name (`kvbm-<tier>-<pid>-<n>.blocks`).
fn stale_candidate_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("kvbm-")?.strip_suffix(".blocks")?;
    let mut parts = rest.rsplitn(3, '-');
    let n = parts.next()?;
    let pid = parts.next()?;
    let kind = parts.next()?;
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if kind.is_empty() || !numeric(n) || !numeric(pid) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` exists (as far as this pid namespace can tell).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 only checks for the process; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the files of dead processes from `dir` (see the [module docs](self)): named like a
/// non-persisted tier file, a regular file of this user, its process gone and its lock free.
/// Failures are logged, never returned: a leftover file only costs space.
fn remove_stale_files(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let own = std::process::id();
    for entry in entries.take(MAX_STALE_SCAN).flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(stale_candidate_pid) else {
            continue;
        };
        if pid == own || process_alive(pid) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        let ours = file.metadata().is_ok_and(|m| m.is_file() && m.uid() == me);
        if ours && matches!(lock(&file, true), Ok(true)) {
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::info!(
                    path = %path.display(),
                    pid,
                    "removed a disk tier file left by a process that is gone"
                ),
                Err(e) => tracing::warn!(
                    path = %path.display(),
                    error = %e,
                    "cannot remove a disk tier file left by a process that is gone"
                ),
            }
        }
    }
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

/// Sets (or clears) O_DIRECT on the open `file` with `fcntl(F_SETFL)`: the file is never
/// reopened by path.
fn set_direct(file: &File, on: bool) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain syscalls on a descriptor we own; no memory is passed.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, on);
        Ok(())
    }
}

/// Turns O_DIRECT on for `file` and checks that an aligned write and read at slot 0 work. `Err`
/// carries the reason to report (the caller clears O_DIRECT again).
pub(crate) fn open_direct(file: &File) -> std::result::Result<(), String> {
    probe_direct(file, false)
}

/// As [`open_direct`], for a file whose first slot may hold data (a persisted file): the probe
/// writes back the bytes it read there, so what was there stays.
pub(crate) fn open_direct_preserving(file: &File) -> std::result::Result<(), String> {
    probe_direct(file, true)
}

/// Sets O_DIRECT and checks it with an aligned write and read of the first
/// [`DISK_ALIGNMENT`] bytes: a fixed pattern, or (`keep`) the bytes read there first.
fn probe_direct(file: &File, keep: bool) -> std::result::Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        set_direct(file, true).map_err(|e| format!("setting O_DIRECT failed: {e}"))?;
        let mut out = AlignedBuf::new(DISK_ALIGNMENT).map_err(|e| e.to_string())?;
        if keep {
            preadv_all(file, &mut [IoSliceMut::new(out.as_mut_slice())], 0)
                .map_err(|e| format!("O_DIRECT probe read failed: {e}"))?;
        } else {
            for (i, b) in out.as_mut_slice().iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
        }
        let mut back = AlignedBuf::new(DISK_ALIGNMENT).map_err(|e| e.to_string())?;
        pwritev_all(file, &[IoSlice::new(out.as_slice())], 0)
            .map_err(|e| format!("O_DIRECT probe write failed: {e}"))?;
        preadv_all(file, &mut [IoSliceMut::new(back.as_mut_slice())], 0)
            .map_err(|e| format!("O_DIRECT probe read failed: {e}"))?;
        if out.as_slice() != back.as_slice() {
            return Err("O_DIRECT probe read back different bytes".to_owned());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, keep);
        Err("O_DIRECT is only used on Linux".to_owned())
    }
}

fn to_off_t(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset overflows off_t"))
}

/// Writes all of `src` at `offset`: `pwritev` at most [`IOV_MAX`] segments at a time, resuming
/// after short writes and `EINTR`.
pub(crate) fn pwritev_all(file: &File, src: &[IoSlice<'_>], mut offset: u64) -> io::Result<()> {
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
pub(crate) fn preadv_all(
    file: &File,
    dst: &mut [IoSliceMut<'_>],
    mut offset: u64,
) -> io::Result<()> {
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
