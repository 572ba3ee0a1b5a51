//! The persisted slot file (`disk.persist`): opened by its identity with the blocks its index
//! names, and its index saved (`persist.rs` is the index's format). A child of `slot_file.rs`,
//! whose file protocol it shares.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::{direct_setup, lock, open_direct_preserving, preallocate, prepare, SlotFile};
use crate::backends::disk::DiskTierOptions;
use crate::backends::persist::{self, IndexEntry, IndexHeader};
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{KvLayout, LayoutDims};
use crate::tier::TierKind;

impl SlotFile {
    /// Opens the persisted slot file for `identity` in `opts.dir` (`kvbm-<tier>-<hash of
    /// identity>.persist.blocks`), creating it when there is none, and returns the entries of its
    /// index that this file can serve (their checksums restored: each is verified on read). See
    /// `persist.rs`.
    ///
    /// Errors: as [`Self::create`]; every replica file of the identity held by another live
    /// process (see [`MAX_REPLICAS`]), the file not a regular file of
    /// this user, or of another size than this tier's with no index to say why
    /// ([`ErrorKind::InvalidConfig`] naming the path); an index written for another identity,
    /// block size or block count ([`ErrorKind::InvalidConfig`] naming the field).
    pub(crate) fn open_persistent(
        kind: TierKind,
        dims: LayoutDims,
        num_blocks: usize,
        opts: &DiskTierOptions,
        identity: &str,
    ) -> Result<(Self, Vec<IndexEntry>)> {
        let (layout, slot_bytes, file_bytes) = prepare(kind, dims, num_blocks, opts)?;
        // Processes with the same identity hold the same bytes under the same keys (replicas
        // of one shard, ranks sharing MLA pages): each takes the first of the identity's files
        // no other process holds, and a restart reopens whichever is free.
        let mut opened = None;
        for replica in 0..MAX_REPLICAS {
            let path = persisted_path(&opts.dir, kind, identity, replica);
            if let Some((file, len)) = open_owned(kind, &path)? {
                opened = Some((path, file, len));
                break;
            }
        }
        let Some((path, file, len)) = opened else {
            return Err(refuse_persisted(
                kind,
                &persisted_path(&opts.dir, kind, identity, 0),
                format!(
                    "it and its {} replica files are all in use by other processes",
                    MAX_REPLICAS - 1
                ),
            ));
        };
        let want = IndexHeader {
            identity: identity.to_string(),
            kind: kind.to_string(),
            bytes_per_block: layout.bytes_per_block(),
            slot_bytes,
            num_blocks,
            generation: 0,
            resets: 0,
        };
        let (mut generation, saw, mut entries) =
            checked_index(kind, &want, &path, len, file_bytes)?;
        // A cache reset since the index was saved (or a marker that cannot be read): its
        // blocks were computed before the reset and are not served.
        let resets = match &opts.reset_marker {
            None => 0,
            Some(m) => {
                let (resets, saw) = match persist::read_reset_marker(m) {
                    Ok(n) => (n, saw),
                    Err(why) => {
                        // Unknown: the index is not used, and the tier counts as having seen no
                        // reset, so the first count it can read (1 or more) forgets what it
                        // bound meanwhile, and its saves fail until the marker reads.
                        tracing::warn!(%why, "persisted disk: reset marker unreadable; the index is not used");
                        (0, 1)
                    }
                };
                if saw != resets {
                    tracing::info!(path = %path.display(), blocks = entries.len(),
                        "persisted disk: a cache reset since the index was saved; its blocks are not served");
                    entries.clear();
                    generation = 0;
                }
                resets
            }
        };
        if len != file_bytes {
            preallocate(&file, file_bytes).map_err(|e| {
                Error::io("fallocate", e)
                    .with("tier", kind)
                    .with("path", path.display())
            })?;
        }
        let (direct_io, fallback_reason) =
            direct_setup(kind, &path, &file, opts.direct_io, open_direct_preserving)?;
        let checksums: Box<[RwLock<Option<u64>>]> =
            (0..num_blocks).map(|_| RwLock::new(None)).collect();
        for e in &entries {
            *checksums[e.slot].write() = Some(e.checksum);
        }
        let durable = Durable::start(
            IndexHeader { resets, ..want },
            path.clone(),
            &file,
            generation,
            &entries,
            (opts.index_save_within, opts.reset_marker.clone()),
        )?;
        tracing::info!(
            tier = %kind,
            path = %path.display(),
            blocks = entries.len(),
            "persisted disk tier reopened"
        );
        Ok((
            Self {
                kind,
                layout,
                path,
                file,
                direct_io,
                fallback_reason,
                persist: true,
                slot_bytes,
                checksums,
                durable: Some(durable),
            },
            entries,
        ))
    }

    /// The checksum recorded for `block`'s last complete write, if any.
    pub(crate) fn checksum(&self, block: usize) -> Option<u64> {
        *self.checksums.get(block)?.read()
    }

    /// The persisted file's durable index, if this file is persisted.
    fn durable(&self) -> Result<&Arc<Durable>> {
        self.durable
            .as_ref()
            .ok_or_else(|| Error::unsupported("the disk tier is not persisted (disk.persist)"))
    }

    /// Records that each `(block, key, checksum)` holds `key`, when the block's last complete write
    /// still has `checksum` (else the entry is dropped: the block was rewritten since). Lock
    /// order: the block's checksum lock, then the index's (as a write).
    pub(crate) fn bind(&self, entries: &[(usize, u128, u64)]) {
        let Some(d) = &self.durable else { return };
        for &(block, key, checksum) in entries {
            let Some(lock) = self.checksums.get(block) else {
                continue;
            };
            let guard = lock.read();
            if *guard == Some(checksum) {
                d.bind(block, key, checksum);
            }
        }
    }

    /// Forgets what `blocks` hold (the owner dropped them).
    pub(crate) fn unbind(&self, blocks: &[usize]) {
        if let Some(d) = &self.durable {
            d.unbind(blocks);
        }
    }

    /// Withdraws `blocks` from the index on disk before they are rewritten (one journal sync for
    /// all; a later write of one of them then costs nothing more).
    pub(crate) fn prepare_rewrite(&self, blocks: &[usize]) -> Result<()> {
        match &self.durable {
            Some(d) => d
                .withdraw(blocks)
                .map_err(|e| e.with("path", self.path.display())),
            None => Ok(()),
        }
    }

    /// Before a write of `block` (its checksum lock held): its entry is withdrawn, durably when
    /// the index on disk names it.
    pub(super) fn before_write(&self, block: usize) -> Result<()> {
        match &self.durable {
            Some(d) => d
                .withdraw(&[block])
                .map_err(|e| e.with("block", block).with("path", self.path.display())),
            None => Ok(()),
        }
    }

    /// Forgets every block durably: the index on disk names none when this returns.
    pub(crate) fn clear_index(&self) -> Result<()> {
        self.durable()?.clear()
    }

    /// Saves the index now.
    pub(crate) fn flush_index(&self) -> Result<()> {
        self.durable()?.save()
    }
}

/// How soon after a change a persisted index is saved by default
/// ([`DiskTierOptions::index_save_within`]).
pub const INDEX_SAVE_WITHIN: Duration = Duration::from_secs(2);

/// A persisted file's index as it is kept durable: which key each block holds (what the owner
/// bound, withdrawn the moment a rewrite starts), saved by a background thread within
/// `save_within` of a change, and, before a block the index on disk names is rewritten, a
/// journal record that withdraws it there (see `persist.rs`). So the index on disk never names
/// a block whose bytes are not the ones it describes, whenever the process dies.
pub(crate) struct Durable {
    /// The index's header (its generation and reset count are set by each save).
    header: IndexHeader,
    /// The deployment's reset marker, if any (`DiskTierOptions::reset_marker`).
    reset_marker: Option<PathBuf>,
    /// The slot file's path (the index and journal sit beside it).
    path: PathBuf,
    /// The slot file, for syncing its data before a save.
    file: File,
    save_within: Duration,
    state: Mutex<State>,
    /// Wakes the saver thread on a change or on close.
    wake: Condvar,
    /// One save at a time.
    saving: Mutex<()>,
    /// The saver thread, joined by [`Durable::close`]: while it runs it holds this `Durable`,
    /// whose `file` (a dup of the slot file) keeps the file's `flock`.
    saver: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct State {
    /// What each block holds: `(key, checksum)`.
    bindings: HashMap<usize, (u128, u64)>,
    /// Each generation whose index may be on disk, with the blocks it names that have not been
    /// withdrawn by a journal record since.
    live: Vec<(u64, HashSet<usize>)>,
    /// The generation of the next save.
    next_generation: u64,
    /// Records appended since the journal was last rewritten, `(generation, block)`.
    records: Vec<(u64, usize)>,
    /// The journal, opened for appending.
    journal: Arc<File>,
    /// When the first change not yet saved was made.
    dirty_since: Option<Instant>,
    /// The owner is gone: the saver thread ends.
    closed: bool,
    /// The reset count the bindings have seen (read and set by `save` only).
    resets_seen: u64,
}

impl State {
    fn changed(&mut self) {
        self.dirty_since.get_or_insert_with(Instant::now);
    }
}

fn open_journal(path: &Path) -> Result<File> {
    let jp = persist::journal_path(path);
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&jp)
        .map_err(|e| Error::io("open", e).with("path", jp.display()))
}

impl Durable {
    /// The durable index of the file at `path` reopened with `entries` from the index of
    /// `generation` (0: none), with its saver thread started.
    fn start(
        header: IndexHeader,
        path: PathBuf,
        file: &File,
        generation: u64,
        entries: &[IndexEntry],
        (save_within, reset_marker): (Duration, Option<PathBuf>),
    ) -> Result<Arc<Self>> {
        let file = file
            .try_clone()
            .map_err(|e| Error::io("dup", e).with("path", path.display()))?;
        if generation == 0 {
            // No usable index (none, damaged, unreadable, or from before a reset): the index and
            // its journal are removed, durably, before anything is written, so no later process
            // can read that index without the journal that withdrew its rewritten blocks, and no
            // old record names a generation this process is about to write.
            for p in [persist::index_path(&path), persist::journal_path(&path)] {
                if let Err(e) = std::fs::remove_file(&p) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        return Err(Error::io("remove", e).with("path", p.display()));
                    }
                }
            }
            persist::sync_dir(&path)
                .map_err(|e| Error::io("fsync (directory)", e).with("path", path.display()))?;
        }
        let journal = open_journal(&path)?;
        // A record torn by a crash while it was appended: cut, so later records stay aligned.
        let len = journal
            .metadata()
            .map_err(|e| Error::io("stat", e).with("path", path.display()))?
            .len();
        let whole = len - len % persist::RECORD as u64;
        if whole != len {
            journal
                .set_len(whole)
                .and_then(|()| journal.sync_data())
                .map_err(|e| Error::io("truncate the journal", e).with("path", path.display()))?;
        }
        let journal = Arc::new(journal);
        let live = if generation == 0 {
            Vec::new()
        } else {
            vec![(generation, entries.iter().map(|e| e.slot).collect())]
        };
        let resets_seen = header.resets;
        let d = Arc::new(Self {
            header,
            reset_marker,
            path,
            file,
            save_within,
            state: Mutex::new(State {
                bindings: entries
                    .iter()
                    .map(|e| (e.slot, (e.key, e.checksum)))
                    .collect(),
                live,
                next_generation: generation + 1,
                records: Vec::new(),
                journal,
                dirty_since: None,
                closed: false,
                resets_seen,
            }),
            wake: Condvar::new(),
            saving: Mutex::new(()),
            saver: Mutex::new(None),
        });
        let weak = Arc::downgrade(&d);
        let saver_thread = std::thread::Builder::new()
            .name("kvbm-index-save".into())
            .spawn(move || saver(weak))
            .map_err(|e| Error::io("spawn the index saver thread", e))?;
        *d.saver.lock() = Some(saver_thread);
        {
            let mut live = LIVE.lock();
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&d));
        }
        crate::backends::shutdown::install();
        Ok(d)
    }

    fn bind(&self, block: usize, key: u128, checksum: u64) {
        let mut st = self.state.lock();
        if st.bindings.insert(block, (key, checksum)) != Some((key, checksum)) {
            st.changed();
            self.wake.notify_one();
        }
    }

    fn unbind(&self, blocks: &[usize]) {
        let mut st = self.state.lock();
        let mut any = false;
        for b in blocks {
            any |= st.bindings.remove(b).is_some();
        }
        if any {
            st.changed();
            self.wake.notify_one();
        }
    }

    /// Withdraws `blocks`: forgets their bindings, and when an index on disk names one, appends a
    /// journal record for it and syncs the journal before returning.
    fn withdraw(&self, blocks: &[usize]) -> Result<()> {
        let mut buf = Vec::new();
        let journal = {
            let mut st = self.state.lock();
            let mut any = false;
            for &b in blocks {
                any |= st.bindings.remove(&b).is_some();
                let gens: Vec<u64> = st
                    .live
                    .iter_mut()
                    .filter_map(|(g, named)| named.remove(&b).then_some(*g))
                    .collect();
                for g in gens {
                    buf.extend_from_slice(&persist::record(g, b));
                    st.records.push((g, b));
                }
            }
            if any {
                st.changed();
                self.wake.notify_one();
            }
            if buf.is_empty() {
                return Ok(());
            }
            let journal = st.journal.clone();
            // Appended under the lock (records never interleave); synced outside it.
            let before = journal.metadata().map(|m| m.len());
            if let Err(e) = (&*journal).write_all(&buf) {
                // A part written would misalign every later record: cut back.
                if let Ok(len) = before {
                    let _ = journal.set_len(len);
                }
                Self::restore(&mut st, buf.len() / persist::RECORD);
                return Err(Error::io("journal write", e));
            }
            journal
        };
        journal.sync_data().map_err(|e| {
            // Not known to be on disk: the blocks stay named, so a retry records them again
            // (a record twice withdraws nothing more).
            Self::restore(&mut self.state.lock(), buf.len() / persist::RECORD);
            Error::io("journal fsync", e)
        })
    }

    /// Puts the blocks of the last `n` records back among those their generations name.
    fn restore(st: &mut State, n: usize) {
        let keep = st.records.len().saturating_sub(n);
        let failed: Vec<(u64, usize)> = st.records.split_off(keep);
        for (g, b) in failed {
            if let Some((_, named)) = st.live.iter_mut().find(|(lg, _)| *lg == g) {
                named.insert(b);
            }
        }
    }

    /// Saves the index now (after a save in progress).
    fn save(&self) -> Result<()> {
        let _one = self.saving.lock();
        // A cache reset since the last look: every block bound so far was computed before it.
        let seen = self.state.lock().resets_seen;
        let resets = match &self.reset_marker {
            None => seen,
            Some(m) => match persist::read_reset_marker(m) {
                Ok(n) if n > seen => {
                    let mut st = self.state.lock();
                    st.bindings.clear();
                    st.resets_seen = n;
                    n
                }
                Ok(_) => seen,
                Err(why) => return Err(Error::corrupt(why).with("path", m.display())),
            },
        };
        let (entries, generation) = {
            let mut st = self.state.lock();
            let generation = st.next_generation;
            st.next_generation += 1;
            let mut entries: Vec<IndexEntry> = st
                .bindings
                .iter()
                .map(|(&slot, &(key, checksum))| IndexEntry {
                    slot,
                    key,
                    checksum,
                })
                .collect();
            entries.sort_unstable_by_key(|e| e.slot);
            st.live
                .push((generation, entries.iter().map(|e| e.slot).collect()));
            st.dirty_since = None;
            (entries, generation)
        };
        let header = IndexHeader {
            generation,
            resets,
            ..self.header.clone()
        };
        let mut renamed = false;
        let result = self
            .file
            .sync_data()
            .map_err(|e| Error::io("fsync", e).with("path", self.path.display()))
            .and_then(|()| persist::save(&self.path, &header, &entries, &mut renamed));
        let mut st = self.state.lock();
        match &result {
            Ok(()) => {
                // This generation's index is the one on disk: older ones are gone.
                st.live.retain(|(g, _)| *g >= generation);
                st.records.retain(|(g, _)| *g >= generation);
                let mut bytes = Vec::with_capacity(st.records.len() * persist::RECORD);
                for &(g, b) in &st.records {
                    bytes.extend_from_slice(&persist::record(g, b));
                }
                let jp = persist::journal_path(&self.path);
                match persist::replace_journal(&jp, &bytes) {
                    Ok((f, durable)) => {
                        // The file now at the path, whatever happens to its directory entry.
                        st.journal = Arc::new(f);
                        if !durable {
                            // The rename may not survive a crash: the records stay in memory
                            // and the next compaction writes them again.
                            tracing::warn!(path = %jp.display(), "persisted disk index: the journal's directory was not synced");
                            return result;
                        }
                    }
                    Err(e) => {
                        // Not renamed: the old journal (a superset of the records) stays in use.
                        tracing::warn!(error = %e, "persisted disk index: the journal was not compacted");
                    }
                }
            }
            Err(_) => {
                if !renamed {
                    // Failed before its rename was tried: never on disk, nothing to withdraw.
                    st.live.retain(|(g, _)| *g != generation);
                }
                st.changed();
            }
        }
        result
    }

    /// Forgets every block and saves that before returning.
    fn clear(&self) -> Result<()> {
        {
            let mut st = self.state.lock();
            st.bindings.clear();
            st.changed();
        }
        self.save()
    }

    /// Saves when something changed since the last save.
    pub(crate) fn save_if_dirty(&self) -> Result<()> {
        if self.state.lock().dirty_since.is_none() {
            return Ok(());
        }
        self.save()
    }

    /// The saver thread ends, and is waited for: once the owner's `SlotFile` is dropped nothing
    /// holds the file, so its lock is free before the drop returns (a reopen in this process
    /// gets the same file, not the identity's next one). The owner saves a last time itself.
    fn close(&self) {
        self.state.lock().closed = true;
        self.wake.notify_all();
        let saver_thread = self.saver.lock().take();
        if let Some(t) = saver_thread {
            // Never the saver thread itself: it holds no `SlotFile`, whose drop calls this.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Every persisted index of the process (dropped ones are skipped and pruned).
static LIVE: Mutex<Vec<Weak<Durable>>> = Mutex::new(Vec::new());

/// Saves every changed persisted index of the process now (a terminating signal's last act).
/// Returns how many were saved and the first error.
pub(crate) fn flush_all_persisted() -> (usize, Option<Error>) {
    let live: Vec<Arc<Durable>> = {
        let mut l = LIVE.lock();
        l.retain(|w| w.strong_count() > 0);
        l.iter().filter_map(Weak::upgrade).collect()
    };
    let mut saved = 0;
    let mut first = None;
    for d in live {
        match d.save_if_dirty() {
            Ok(()) => saved += 1,
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    (saved, first)
}

/// The saver thread: saves a changed index within `save_within` of its first unsaved change, and
/// ends when the file is closed (or dropped).
fn saver(weak: Weak<Durable>) {
    loop {
        let Some(d) = weak.upgrade() else { return };
        let mut st = d.state.lock();
        if st.closed {
            return;
        }
        let due = st.dirty_since.map(|t| {
            t.checked_add(d.save_within)
                .unwrap_or(t + Duration::from_secs(86_400))
        });
        match due {
            Some(due) if Instant::now() >= due => {
                drop(st);
                if let Err(e) = d.save() {
                    tracing::warn!(path = %d.path.display(), error = %e,
                        "persisted disk index not saved; retried");
                    // Not at once again: a failing disk is retried every save_within.
                    let mut st = d.state.lock();
                    st.dirty_since = Some(Instant::now());
                }
            }
            Some(due) => {
                d.wake.wait_until(&mut st, due);
            }
            None => {
                // Wakes up now and then so a dropped owner (no more references) ends the thread.
                d.wake.wait_for(&mut st, Duration::from_secs(1));
            }
        }
    }
}

impl Drop for SlotFile {
    /// Removes the file unless persisted; a persisted file's index is saved a last time.
    fn drop(&mut self) {
        if let Some(d) = &self.durable {
            d.close();
            if let Err(e) = d.save_if_dirty() {
                tracing::warn!(path = %self.path.display(), error = %e,
                    "persisted disk index not saved at close");
            }
        }
        if !self.persist {
            super::remove_quietly(&self.path);
        }
    }
}

/// The most files one identity has in a directory (one per process holding it at once).
pub(crate) const MAX_REPLICAS: usize = 64;

/// Where the persisted file of a tier of `kind` for `identity` lives in `dir`: replica 0 is
/// `kvbm-<kind>-<hash>.persist.blocks`, replica r ≥ 1 `kvbm-<kind>-<hash>.r<r>.persist.blocks`.
pub(crate) fn persisted_path(
    dir: &Path,
    kind: TierKind,
    identity: &str,
    replica: usize,
) -> PathBuf {
    let hash = xxhash_rust::xxh3::xxh3_64(identity.as_bytes());
    if replica == 0 {
        dir.join(format!("kvbm-{kind}-{hash:016x}.persist.blocks"))
    } else {
        dir.join(format!("kvbm-{kind}-{hash:016x}.r{replica}.persist.blocks"))
    }
}

/// The error for a persisted file this tier cannot use.
fn refuse_persisted(kind: TierKind, path: &Path, why: String) -> Error {
    Error::new(
        ErrorKind::InvalidConfig,
        format!("persisted disk file {}: {why}", path.display()),
    )
    .with("tier", kind)
    .with("path", path.display())
}

/// Opens (creating when missing) the persisted file at `path` — `O_NOFOLLOW`, mode 0600 — checks
/// it is a regular file of this user and takes its exclusive lock; returns it and its length,
/// or `None` when another live process holds it.
fn open_owned(kind: TierKind, path: &Path) -> Result<Option<(File, u64)>> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            Error::io("open", e)
                .with("tier", kind)
                .with("path", path.display())
        })?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io("stat", e).with("path", path.display()))?;
    {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: plain syscall, no arguments.
        let me = unsafe { libc::geteuid() };
        if !meta.is_file() || meta.uid() != me {
            return Err(refuse_persisted(
                kind,
                path,
                "not a regular file of this user".into(),
            ));
        }
    }
    match lock(&file, true) {
        Ok(true) => Ok(Some((file, meta.len()))),
        Ok(false) => Ok(None),
        Err(e) => Err(Error::io("flock", e).with("path", path.display())),
    }
}

/// The generation, reset count and entries of the persisted file's index when it was written
/// for `want` (else the difference, named); none (0, 0, []) when there is no usable index —
/// unless the file has data of another size, which nothing then explains (refused).
fn checked_index(
    kind: TierKind,
    want: &IndexHeader,
    path: &Path,
    len: u64,
    file_bytes: u64,
) -> Result<(u64, u64, Vec<IndexEntry>)> {
    match crate::backends::persist::load(path, want.num_blocks) {
        Some((found, entries)) => {
            want.check(&found, path)?;
            Ok((found.generation.max(1), found.resets, entries))
        }
        None if len != 0 && len != file_bytes => Err(refuse_persisted(
            kind,
            path,
            format!(
                "{len} bytes with no usable index; this tier needs {file_bytes}: remove it to \
                 start empty"
            ),
        )),
        None => Ok((0, 0, Vec::new())),
    }
}
