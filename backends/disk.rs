//! The `disk` backend (G3): blocks in one preallocated file, O_DIRECT where the filesystem allows.
//!
//! A [`DiskTier`] owns exactly one file in its configured directory, created with a unique name
//! (process id + counter), mode `0600` and `O_EXCL | O_NOFOLLOW`, opened once, preallocated to
//! its full size, and removed when the tier is dropped (unless [`DiskTierOptions::persist`] is
//! set) or, after a SIGKILL, by the next tier created in that directory. The directory is kept
//! private (see `slot_file.rs`: created `0700`, owner and mode checked). The file holds canonical
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
//! This module owns the I/O (`preadv`/`pwritev`, bounce buffers). The file itself (creation,
//! slots, the checksum table and the read/write protocol below) is the slot file shared with the
//! NIXL disk tier (`slot_file.rs`).
//!
//! Invariants:
//! * every block written carries an xxh3-64 checksum of its canonical image, kept in memory (not in
//!   the file); every read verifies it and answers [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) on a mismatch;
//! * a block that was never written (or whose last write failed part-way) is
//!   [`ErrorKind::NotFound`](crate::ErrorKind::NotFound), never a block of zeros;
//! * the per-block lock guarding the checksum serialises writers of a block against its readers;
//!   different blocks never share bytes of the file, so they need no mutual exclusion;
//! * a bad block id or segment length is refused before any I/O: nothing on disk changes.
//!
//! Nothing is `fsync`ed for a tier made by [`DiskTier::create`]: a cache whose checksums live in
//! memory, so its contents do not outlive the process in any usable form. A tier opened with
//! [`DiskTier::open_persistent`] outlives it: its owner saves which key each block holds
//! ([`crate::tier::Persistent`]); the file's data is synced and the index (checksums included)
//! written beside it (`persist.rs`), and the next process that opens it serves those blocks,
//! each still verified on read.

use std::io::{IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::slot_file::{hash_segments, preadv_all, pwritev_all, AlignedBuf, SlotFile};
use crate::error::Result;
use crate::layout::{Layout, LayoutDims};
use crate::tier::{Capability, StorageTier, TierKind};

pub use super::slot_file::{DISK_ALIGNMENT, INDEX_SAVE_WITHIN};

/// Default for [`DiskTierOptions::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;

/// How to create a [`DiskTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierOptions {
    /// Directory for the tier's file. When missing, its last component is created (mode `0700`;
    /// the parent must exist); it must be owned by this user or root and not writable by others
    /// unless sticky. Files of dead processes found in it are removed (see the module docs).
    pub dir: PathBuf,
    /// Use O_DIRECT when the filesystem accepts it. Default `true`; when refused the tier falls
    /// back to buffered I/O (see [`DiskTier::direct_io_fallback_reason`]).
    pub direct_io: bool,
    /// Keep the file when the tier is dropped (or its process is killed). Default `false`. A file
    /// kept by [`DiskTier::create`] is named `kvbm-<tier>-<pid>-<n>.persist.blocks` and is for
    /// inspection only (its checksums were in memory); [`DiskTier::open_persistent`] (what the
    /// page store uses with `disk.persist`) keeps a file a later process reopens, with an index
    /// of its blocks and their checksums (`persist.rs`).
    pub persist: bool,
    /// Blocking calls the tier serves well in parallel, reported in [`Capability::max_in_flight`];
    /// also the number of bounce buffers kept for reuse. Default [`DEFAULT_MAX_IN_FLIGHT`] (4);
    /// must be non-zero.
    pub max_in_flight: usize,
    /// How soon after a change a persisted tier's index is saved, whether or not more writes come
    /// (a background thread; also saved when the tier is closed and on SIGTERM, SIGHUP or SIGINT
    /// where the process leaves them to their default action). Default [`INDEX_SAVE_WITHIN`]
    /// (2 s): a process killed outright loses at most the blocks stored in that time.
    pub index_save_within: std::time::Duration,
    /// A persisted tier's reset marker: a file holding how many cache resets the deployment has
    /// had (written by the scheduler side, `persist::bump_reset_marker`, before a reset returns).
    /// An index saved before the latest reset is not used when the tier opens, and a save that
    /// finds a newer count forgets every block first. `None` (the default): no marker.
    pub reset_marker: Option<PathBuf>,
}

impl DiskTierOptions {
    /// Options for a tier in `dir`, with every other field at its default.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            direct_io: true,
            persist: false,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            index_save_within: INDEX_SAVE_WITHIN,
            reset_marker: None,
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

    /// Sets [`Self::index_save_within`].
    #[must_use]
    pub fn with_index_save_within(mut self, within: std::time::Duration) -> Self {
        self.index_save_within = within;
        self
    }

    /// Sets [`Self::reset_marker`].
    #[must_use]
    pub fn with_reset_marker(mut self, marker: impl Into<PathBuf>) -> Self {
        self.reset_marker = Some(marker.into());
        self
    }

    /// Sets [`Self::max_in_flight`].
    #[must_use]
    pub fn with_max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }
}

/// Blocks in one preallocated file; see the [module docs](self).
pub struct DiskTier {
    /// The file, its slots and checksums.
    slots: SlotFile,
    max_in_flight: usize,
    /// Reusable slot-sized bounce buffers (at most `max_in_flight` kept).
    bounce: Mutex<Vec<AlignedBuf>>,
    /// What a persisted file's blocks are ([`DiskTier::open_persistent`]); `None` otherwise.
    identity: Option<String>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("slots", &self.slots)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl DiskTier {
    /// Creates one preallocated file for `num_blocks` blocks of `dims` in `opts.dir` (created if
    /// missing). `kind` is normally [`TierKind::Disk`].
    ///
    /// Errors: invalid dimensions or a file size that does not fit an `off_t`
    /// ([`ErrorKind::InvalidLayout`](crate::ErrorKind::InvalidLayout)), `max_in_flight == 0`
    /// ([`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)), no room to
    /// preallocate ([`ErrorKind::NoSpace`](crate::ErrorKind::NoSpace)), any other file-system
    /// failure ([`ErrorKind::Io`](crate::ErrorKind::Io), naming the path). On error no file is
    /// left behind.
    pub fn create(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
    ) -> Result<Self> {
        Self::from_slots(SlotFile::create(kind, dims, num_blocks, &opts)?, &opts)
    }

    /// [`Self::create`] with the O_DIRECT opener (open + probe) passed in, so tests can force a
    /// fallback.
    #[cfg(test)]
    fn create_with(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
        open_direct: impl FnOnce(&std::fs::File) -> std::result::Result<(), String>,
    ) -> Result<Self> {
        let slots = SlotFile::create_with(kind, dims, num_blocks, &opts, open_direct)?;
        Self::from_slots(slots, &opts)
    }

    fn from_slots(slots: SlotFile, opts: &DiskTierOptions) -> Result<Self> {
        Ok(Self {
            slots,
            max_in_flight: opts.max_in_flight,
            bounce: Mutex::new(Vec::new()),
            identity: None,
        })
    }

    /// Opens the tier's persisted file for `identity` (what its blocks are: a store's namespace)
    /// in `opts.dir`, created when there is none, and returns the `(block, key)` pairs its saved
    /// index names ([`crate::tier::Persistent::bind`]); each of those blocks is verified
    /// against its saved checksum when read, so a block rewritten after the save is
    /// [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt), never the old key's bytes. The file
    /// outlives the tier. One process at a time holds a file; a second process with the same
    /// identity (another replica of the same shard: the same bytes under the same keys) takes
    /// the identity's next file (`….r1.persist.blocks`, up to 64), and a restart reopens any
    /// free one.
    ///
    /// Errors: as [`Self::create`]; all of the identity's files held by other processes, not a regular file of
    /// this user, or saved for another identity, block size or block count
    /// ([`ErrorKind::InvalidConfig`](crate::ErrorKind::InvalidConfig) naming the path and the
    /// field).
    pub fn open_persistent(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: DiskTierOptions,
        identity: &str,
    ) -> Result<(Self, Vec<(usize, u128)>)> {
        let (slots, entries) = SlotFile::open_persistent(kind, dims, num_blocks, &opts, identity)?;
        let mut tier = Self::from_slots(slots, &opts)?;
        tier.identity = Some(identity.to_string());
        Ok((tier, entries.iter().map(|e| (e.slot, e.key)).collect()))
    }

    /// The tier's file.
    pub fn path(&self) -> &Path {
        self.slots.path()
    }

    /// Whether O_DIRECT is in use.
    pub fn direct_io(&self) -> bool {
        self.slots.direct_io()
    }

    /// Why O_DIRECT was requested but is not in use (the failed open or probe); `None` when it is
    /// in use or was not requested.
    pub fn direct_io_fallback_reason(&self) -> Option<&str> {
        self.slots.direct_io_fallback_reason()
    }

    /// Bytes of one block's slot in the file (`bytes_per_block` rounded up to [`DISK_ALIGNMENT`]).
    pub fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }

    /// Whether `segments` can be handed to the kernel as they are.
    fn usable_directly<T: std::ops::Deref<Target = [u8]>>(&self, segments: &[T]) -> bool {
        self.slots.aligned(segments)
    }

    fn take_bounce(&self) -> Result<AlignedBuf> {
        match self.bounce.lock().pop() {
            Some(buf) => Ok(buf),
            None => AlignedBuf::new(self.slots.slot_bytes()),
        }
    }

    fn return_bounce(&self, buf: AlignedBuf) {
        let mut pool = self.bounce.lock();
        if pool.len() < self.max_in_flight {
            pool.push(buf);
        }
    }

    /// Reads `block`'s slot through a bounce buffer, verifies it against `expected` and only then
    /// copies it into `dst` (so `dst` is untouched on a mismatch). Returns the checksum read.
    fn read_bounced(&self, block: usize, dst: &mut [IoSliceMut<'_>], expected: u64) -> Result<u64> {
        let mut buf = self.take_bounce()?;
        let result = preadv_all(
            self.slots.file(),
            &mut [IoSliceMut::new(buf.as_mut_slice())],
            self.slots.offset(block),
        )
        .map_err(|e| self.slots.io_error("preadv", block, e))
        .map(|()| self.slots.deliver(buf.as_slice(), expected, dst));
        self.return_bounce(buf);
        result
    }

    /// Writes the image in `src` to `block`'s slot through a bounce buffer (padding zeroed).
    fn write_bounced(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        let mut buf = self.take_bounce()?;
        self.slots.fill(buf.as_mut_slice(), src);
        let result = pwritev_all(
            self.slots.file(),
            &[IoSlice::new(buf.as_slice())],
            self.slots.offset(block),
        )
        .map_err(|e| self.slots.io_error("pwritev", block, e));
        self.return_bounce(buf);
        result
    }
}

impl crate::tier::Persistent for DiskTier {
    fn checksum(&self, block: usize) -> Option<u64> {
        self.slots.checksum(block)
    }

    fn bind(&self, entries: &[(usize, u128, u64)]) {
        self.slots.bind(entries);
    }

    fn unbind(&self, blocks: &[usize]) {
        self.slots.unbind(blocks);
    }

    fn prepare_rewrite(&self, blocks: &[usize]) -> Result<()> {
        self.slots.prepare_rewrite(blocks)
    }

    fn clear(&self) -> Result<()> {
        self.slots.clear_index()
    }

    fn flush(&self) -> Result<()> {
        self.slots.flush_index()
    }
}

impl StorageTier for DiskTier {
    fn persistent(&self) -> Option<&dyn crate::tier::Persistent> {
        self.identity
            .as_ref()
            .map(|_| self as &dyn crate::tier::Persistent)
    }

    fn kind(&self) -> TierKind {
        self.slots.kind()
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: false,
            direct_io_alignment: if self.direct_io() { DISK_ALIGNMENT } else { 1 },
            checksummed: true,
            max_in_flight: self.max_in_flight,
        }
    }

    fn layout(&self) -> &Layout {
        self.slots.layout()
    }

    /// Reads and verifies `block`. A block never written is
    /// [`ErrorKind::NotFound`](crate::ErrorKind::NotFound); a checksum mismatch is
    /// [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) naming the block and the file, and then
    /// the contents of `dst` are unspecified and must not be trusted (with aligned buffers the
    /// corrupt bytes were read straight into them).
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        self.slots.read_verified(block, dst, |dst, expected| {
            if self.usable_directly(dst) {
                preadv_all(self.slots.file(), dst, self.slots.offset(block))
                    .map_err(|e| self.slots.io_error("preadv", block, e))?;
                Ok(hash_segments(dst))
            } else {
                self.read_bounced(block, dst, expected)
            }
        })
    }

    /// Writes `block` and records its checksum. If the write fails part-way the block counts as
    /// never written until it is written again.
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        self.slots.write_recorded(block, src, |src| {
            if self.usable_directly(src) {
                pwritev_all(self.slots.file(), src, self.slots.offset(block))
                    .map_err(|e| self.slots.io_error("pwritev", block, e))
            } else {
                self.write_bounced(block, src)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::slot_file::IOV_MAX;
    use crate::error::ErrorKind;
    use crate::tier::StorageTierExt;
    use std::fs::OpenOptions;
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
        let created = dir.path().join("a");
        let a = tier_in(&created, false);
        let b = tier_in(&created, false);
        assert_ne!(a.path(), b.path());
        let mode = std::fs::metadata(&created).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "created {mode:o}");
    }

    /// Issue 13, item 11: only the last component of the directory is created.
    #[test]
    fn only_the_last_component_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a/b");
        let err =
            DiskTier::create(TierKind::Disk, dims(), 2, DiskTierOptions::new(&nested)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("only the last component"), "{err}");
        assert!(!dir.path().join("a").exists());
        let err =
            DiskTier::create(TierKind::Disk, dims(), 2, DiskTierOptions::new("")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    }

    /// Issue 13, item 8: a directory another user controls is refused, naming the path.
    #[test]
    fn foreign_or_insecure_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err =
            DiskTier::create(TierKind::Disk, dims(), 2, DiskTierOptions::new(&open)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("writable by other users"), "{err}");
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
        // Sticky (like /tmp) is fine.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        drop(tier_in(&open, false));

        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped the foreign-owner case: needs root to chown");
            return;
        }
        let foreign = dir.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::os::unix::fs::chown(&foreign, Some(54_321), Some(54_321)).unwrap();
        let err = DiskTier::create(TierKind::Disk, dims(), 2, DiskTierOptions::new(&foreign))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(err.to_string().contains("owned by uid 54321"), "{err}");
        assert!(
            err.to_string().contains(&*foreign.to_string_lossy()),
            "{err}"
        );
        // A stranger's symlink in the directory's place (as in a shared /tmp) is not followed.
        let mine = dir.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&mine, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(54_321), Some(54_321)).unwrap();
        let err =
            DiskTier::create(TierKind::Disk, dims(), 2, DiskTierOptions::new(&link)).unwrap_err();
        assert!(
            err.to_string().contains("symbolic link owned by uid 54321"),
            "{err}"
        );
        assert_eq!(std::fs::read_dir(&mine).unwrap().count(), 0);
    }

    /// Issue 13, item 8: the file is opened once. Replacing its path with a symlink after
    /// creation (where O_DIRECT used to reopen it by path) changes nothing: the tier keeps
    /// writing the inode it created and the symlink's target is untouched.
    #[test]
    fn a_swapped_path_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let tier = DiskTier::create_with(
            TierKind::Disk,
            dims(),
            2,
            DiskTierOptions::new(dir.path()),
            |file| {
                let created = std::fs::read_dir(dir.path())
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .find(|p| p.extension().is_some_and(|x| x == "blocks"))
                    .unwrap();
                std::fs::rename(&created, dir.path().join("moved")).unwrap();
                std::os::unix::fs::symlink(&victim, &created).unwrap();
                crate::backends::slot_file::open_direct(file)
            },
        )
        .unwrap();
        let bpb = tier.bytes_per_block();
        tier.write_block_from_slice(1, &image(1, bpb)).unwrap();
        assert_eq!(tier.read_block_to_vec(1).unwrap(), image(1, bpb));
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let moved = std::fs::read(dir.path().join("moved")).unwrap();
        assert_eq!(
            &moved[tier.slot_bytes()..tier.slot_bytes() + bpb],
            &image(1, bpb)[..]
        );
    }

    /// Issue 13, item 8: a run killed with SIGKILL leaves its file, and the next tier created in
    /// that directory removes it; a persisted file is kept. The killed run is this test binary
    /// run again as a child (`KVBM_TEST_SIGKILL_CHILD` set), which creates a tier and waits.
    #[test]
    fn files_of_killed_processes_are_removed() {
        use std::io::BufRead;
        const CHILD: &str = "KVBM_TEST_SIGKILL_CHILD";
        if let Some(dir) = std::env::var_os(CHILD) {
            for persist in [false, true] {
                let tier = DiskTier::create(
                    TierKind::Disk,
                    dims(),
                    4,
                    DiskTierOptions::new(&dir).with_persist(persist),
                )
                .unwrap();
                println!("FILE {}", tier.path().display());
                std::mem::forget(tier);
            }
            std::thread::sleep(std::time::Duration::from_secs(60));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "backends::disk::tests::files_of_killed_processes_are_removed",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, dir.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut files = Vec::new();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        while files.len() < 2 {
            let line = lines.next().expect("the child printed its files").unwrap();
            // libtest may print its "test ... " prefix on the same line.
            if let Some(at) = line.find("FILE ") {
                files.push(PathBuf::from(&line[at + 5..]));
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        assert!(files.iter().all(|f| f.exists()), "the killed child's files");
        let tier = tier_in(dir.path(), false);
        assert!(
            !files[0].exists(),
            "the killed child's file was left behind"
        );
        assert!(files[1].exists(), "a persisted file was removed");
        assert!(tier.path().exists());
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
