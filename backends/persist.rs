//! The index that lets a disk tier's file outlive its process (`disk.persist`): which slot holds
//! which key, with the checksum of what was written there, saved beside the slot file and read
//! back when a later process opens the same file; and its journal of withdrawn slots.
//!
//! File `<slot file>.index`, written whole to a temporary file, `fsync`ed, renamed over the old
//! one and the directory `fsync`ed (a reader sees the previous index or the new one, never half
//! of one), after the slot file's data is synced (so no entry names bytes that are not on disk):
//!
//! ```text
//! "KVBMIDX2" | u32 header length | header (JSON: identity, kind, bytes_per_block, slot_bytes,
//! num_blocks, generation) | u64 count | count × (u64 slot, u128 key, u64 sealed checksum) |
//! u64 xxh3 of all before
//! ```
//!
//! An entry's checksum is *sealed* with its key (the xxh3-64 of the block's image xor the xxh3-64
//! of the key's 16 bytes): an entry that pairs a key with another key's slot and checksum
//! unseals to a checksum the slot's bytes do not have, so it reads as corrupt, never as the other
//! key's bytes.
//!
//! File `<slot file>.index.drop`, the journal: records of 24 bytes, `(u64 generation, u64 slot,
//! u64 xxh3 of the 16 before)`, each appended and `fdatasync`ed *before* a slot the index on disk
//! names is rewritten. Reading an index drops every entry whose slot a journal record of the same
//! generation names (a record of another generation, or a torn or damaged one, is ignored), so
//! a reopened index never announces a slot that was being rewritten when the process died. Each
//! save writes a new generation and then a journal of only the records that name it.
//!
//! Every integer little-endian. Reading is bounded (the header at most [`MAX_HEADER`] bytes, at
//! most `num_blocks` entries and [`MAX_JOURNAL_RECORDS`] records, the file exactly the length these
//! give) and verified (the trailing checksum); an index that fails either is ignored with a
//! warning (the tier starts empty), never trusted. An entry only says what a slot should hold:
//! each read still verifies the slot's bytes against the entry's checksum.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

const MAGIC: &[u8; 8] = b"KVBMIDX2";
/// The magic of the format before sealed checksums and generations: read as "no index".
const OLD_MAGIC: &[u8; 8] = b"KVBMIDX1";
/// The most bytes of a header read.
pub const MAX_HEADER: usize = 64 * 1024;
const ENTRY: usize = 8 + 16 + 8;
/// Bytes of one journal record.
pub const RECORD: usize = 8 + 8 + 8;
/// The most journal records read (the rest of a longer journal is ignored, with a warning: its
/// entries are then all dropped, see [`load`]).
pub const MAX_JOURNAL_RECORDS: usize = 1 << 24;

/// What a persisted file was written for; a reopening tier must agree on every field but the
/// generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexHeader {
    /// What the blocks are (e.g. a page store's namespace): a tier for something else refuses it.
    pub identity: String,
    /// The tier's kind (`disk`).
    pub kind: String,
    /// Bytes of one block.
    pub bytes_per_block: usize,
    /// Bytes of one slot in the file.
    pub slot_bytes: usize,
    /// Slots in the file.
    pub num_blocks: usize,
    /// Which save this is (each save writes the next one); the journal's records name it.
    #[serde(default)]
    pub generation: u64,
    /// The cache resets of the deployment this index had seen when it was saved (its reset
    /// marker's count, `DiskTierOptions::reset_marker`): an index that saw fewer resets than the
    /// marker now counts predates one, and is not used.
    #[serde(default)]
    pub resets: u64,
}

impl IndexHeader {
    /// Refuses a header that differs from `self` (what this process expects), naming the first
    /// field that differs and both values.
    pub fn check(&self, found: &IndexHeader, path: &Path) -> Result<()> {
        let differs = |field: &str, want: String, got: String| {
            Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "the persisted disk file {} was written with {field} {got}, this instance \
                     has {want}: use another disk.dir, or remove the file (and its .index) to \
                     start empty",
                    path.display()
                ),
            )
            .with("field", field)
            .with("path", path.display()))
        };
        if self.identity != found.identity {
            return differs(
                "identity",
                format!("{:?}", self.identity),
                format!("{:?}", found.identity),
            );
        }
        if self.kind != found.kind {
            return differs("kind", self.kind.clone(), found.kind.clone());
        }
        if self.bytes_per_block != found.bytes_per_block {
            return differs(
                "bytes_per_block",
                self.bytes_per_block.to_string(),
                found.bytes_per_block.to_string(),
            );
        }
        if self.slot_bytes != found.slot_bytes {
            return differs(
                "slot_bytes",
                self.slot_bytes.to_string(),
                found.slot_bytes.to_string(),
            );
        }
        if self.num_blocks != found.num_blocks {
            return differs(
                "num_blocks",
                self.num_blocks.to_string(),
                found.num_blocks.to_string(),
            );
        }
        Ok(())
    }
}

/// One slot's entry: the key it holds and the checksum of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// The slot (block id).
    pub slot: usize,
    /// The key the owner stored there.
    pub key: u128,
    /// xxh3-64 of the block's canonical image (unsealed: as the tier verifies it).
    pub checksum: u64,
}

/// The count a reset marker file holds (see `DiskTierOptions::reset_marker`): 0 when there is
/// none. A marker that cannot be read or parsed is an error (the caller cannot tell whether a
/// reset happened).
pub fn read_reset_marker(path: &Path) -> std::result::Result<u64, String> {
    match std::fs::read(path) {
        Ok(b) if b.len() <= 64 => std::str::from_utf8(&b)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("{}: not a reset count", path.display())),
        Ok(_) => Err(format!("{}: not a reset count (too long)", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Counts one more cache reset in the marker at `path`, durably (written whole, `fsync`ed and
/// renamed, the directory `fsync`ed); returns the new count.
///
/// Errors: the marker exists but cannot be read or parsed ([`ErrorKind::Corrupt`]), or cannot be
/// written ([`ErrorKind::Io`]).
pub fn bump_reset_marker(path: &Path) -> Result<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // Schedulers of one deployment (data-parallel engines) share the marker: one
    // read-increment-write at a time, under an exclusive lock on a file beside it.
    let lock_path = with_suffix(path, ".lock");
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&lock_path)
        .map_err(|e| Error::io("open", e).with("path", lock_path.display()))?;
    loop {
        // SAFETY: flock on a descriptor this function owns; released when it is closed.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("flock", e).with("path", lock_path.display()));
        }
    }
    let n = read_reset_marker(path)
        .map_err(|why| Error::corrupt(why).with("path", path.display()))?
        .saturating_add(1);
    write_atomically(path, format!("{n}\n").as_bytes())?;
    drop(lock);
    Ok(n)
}

/// The seal of `key`: what an entry's checksum is xored with on disk.
fn seal(key: u128) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes())
}

/// The index path of a slot file.
pub fn index_path(slot_file: &Path) -> PathBuf {
    with_suffix(slot_file, ".index")
}

/// The journal path of a slot file.
pub fn journal_path(slot_file: &Path) -> PathBuf {
    with_suffix(slot_file, ".index.drop")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// One journal record: `slot` is withdrawn from the index of `generation`.
pub fn record(generation: u64, slot: usize) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[..8].copy_from_slice(&generation.to_le_bytes());
    r[8..16].copy_from_slice(&(slot as u64).to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&r[..16]);
    r[16..].copy_from_slice(&sum.to_le_bytes());
    r
}

/// Writes `bytes` to `path` durably and atomically: a temporary file beside it, `fsync`ed,
/// renamed over `path`, and the directory `fsync`ed (so the rename itself survives a crash).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_tracked(path, bytes, &mut false)
}

/// [`write_atomically`], setting `renamed` once the rename is tried (an error from then on may
/// leave the new file in place, possibly not yet durable).
fn write_atomically_tracked(path: &Path, bytes: &[u8], renamed: &mut bool) -> Result<()> {
    replace_with(path, bytes, 0, renamed)?;
    sync_dir(path).map_err(|e| Error::io("fsync (directory)", e).with("path", path.display()))
}

/// Replaces the journal at `path` by one holding `bytes` (see [`replace_with`]), opened for
/// appending (`O_APPEND`); returns that file, kept open so nothing is reopened after the
/// rename (which could fail), and whether the directory was synced after the rename. Errors:
/// before or at the rename (the old journal is in place).
pub(crate) fn replace_journal(path: &Path, bytes: &[u8]) -> Result<(std::fs::File, bool)> {
    // (std refuses append with truncate: O_APPEND is a custom flag on a file opened to write.)
    let f = replace_with(path, bytes, libc::O_APPEND, &mut false)?;
    Ok((f, sync_dir(path).is_ok()))
}

/// Writes `bytes` to a temporary file beside `path` (mode 0600, `O_NOFOLLOW`, plus `flags`),
/// `fsync`s it and renames it over `path`, setting `renamed` just before the rename is tried;
/// returns the file. The caller syncs the directory.
fn replace_with(
    path: &Path,
    bytes: &[u8],
    flags: libc::c_int,
    renamed: &mut bool,
) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = with_suffix(path, ".tmp");
    let io = |op: &'static str, e: std::io::Error| Error::io(op, e).with("path", path.display());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | flags)
        .open(&tmp)
        .map_err(|e| io("create", e))?;
    f.write_all(bytes).map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("fsync", e))?;
    // From here the new file may be in place even when the rename reports an error (a lost
    // reply on a network filesystem): counted as renamed.
    *renamed = true;
    std::fs::rename(&tmp, path).map_err(|e| io("rename", e))?;
    Ok(f)
}

/// `fsync`s the directory holding `path`.
pub(crate) fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Writes the index of `slot_file` (see the module docs): `header.generation` is the save's.
/// The caller syncs the slot file first. `renamed` is set once the new index replaced the old
/// one (an error after that leaves it in place).
pub fn save(
    slot_file: &Path,
    header: &IndexHeader,
    entries: &[IndexEntry],
    renamed: &mut bool,
) -> Result<()> {
    let head =
        serde_json::to_vec(header).map_err(|e| Error::internal(format!("index header: {e}")))?;
    let mut buf = Vec::with_capacity(8 + 4 + head.len() + 8 + entries.len() * ENTRY + 8);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(head.len() as u32).to_le_bytes());
    buf.extend_from_slice(&head);
    buf.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for e in entries {
        buf.extend_from_slice(&(e.slot as u64).to_le_bytes());
        buf.extend_from_slice(&e.key.to_le_bytes());
        buf.extend_from_slice(&(e.checksum ^ seal(e.key)).to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&buf);
    buf.extend_from_slice(&sum.to_le_bytes());
    write_atomically_tracked(&index_path(slot_file), &buf, renamed)
}

/// Reads the index of `slot_file`: `None` when there is none, or when it is damaged or of the
/// older format (logged); the header it was written with otherwise, and its entries (each slot
/// below the header's `num_blocks` and named once; others dropped), less those its journal
/// withdrew.
pub fn load(slot_file: &Path, num_blocks_bound: usize) -> Option<(IndexHeader, Vec<IndexEntry>)> {
    let path = index_path(slot_file);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "disk index unreadable; the tier starts empty");
            return None;
        }
    };
    let (header, mut entries) = match parse(&bytes, num_blocks_bound) {
        Ok(v) => v,
        Err(why) => {
            tracing::warn!(path = %path.display(), %why, "disk index damaged; the tier starts empty");
            return None;
        }
    };
    let withdrawn = match withdrawn_slots(slot_file, header.generation, header.num_blocks) {
        Ok(w) => w,
        Err(why) => {
            // Which slots were being rewritten is unknown: no entry can be trusted to be current.
            tracing::warn!(path = %journal_path(slot_file).display(), %why,
                "disk index journal unreadable; the tier starts empty");
            return None;
        }
    };
    if !withdrawn.is_empty() {
        let before = entries.len();
        entries.retain(|e| !withdrawn.get(e.slot).copied().unwrap_or(false));
        tracing::info!(path = %path.display(), withdrawn = before - entries.len(),
            "disk index: slots being rewritten when the index was last saved are not served");
    }
    Some((header, entries))
}

/// The slots the journal withdraws from the index of `generation` (`true` at each), for a file of
/// `num_blocks` slots. No journal: none. A torn last record (a crash while appending) is ignored;
/// a record whose checksum fails, or a journal too long to read, is an error.
fn withdrawn_slots(
    slot_file: &Path,
    generation: u64,
    num_blocks: usize,
) -> std::result::Result<Vec<bool>, String> {
    use std::io::Read;
    let path = journal_path(slot_file);
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.to_string()),
    };
    let limit = (MAX_JOURNAL_RECORDS * RECORD) as u64;
    let mut bytes = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!("more than {MAX_JOURNAL_RECORDS} records"));
    }
    let mut out = Vec::new();
    for r in bytes.chunks_exact(RECORD) {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&r[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        if xxhash_rust::xxh3::xxh3_64(&r[..16]) != word(2) {
            return Err("a damaged record".into());
        }
        if word(0) != generation {
            continue;
        }
        let slot = usize::try_from(word(1)).unwrap_or(usize::MAX);
        if slot < num_blocks {
            if out.len() < num_blocks {
                out.resize(num_blocks, false);
            }
            out[slot] = true;
        }
    }
    Ok(out)
}

fn parse(
    bytes: &[u8],
    num_blocks_bound: usize,
) -> std::result::Result<(IndexHeader, Vec<IndexEntry>), String> {
    let take = |at: usize, n: usize| -> std::result::Result<&[u8], String> {
        at.checked_add(n)
            .and_then(|end| bytes.get(at..end))
            .ok_or_else(|| "truncated".to_string())
    };
    let magic = take(0, 8)?;
    if magic == OLD_MAGIC {
        return Err("written in an older format (KVBMIDX1, checksums not sealed with keys)".into());
    }
    if magic != MAGIC {
        return Err("not an index (magic)".into());
    }
    let body_len = bytes.len().checked_sub(8).ok_or("truncated")?;
    let sum = u64::from_le_bytes(take(body_len, 8)?.try_into().map_err(|_| "truncated")?);
    if xxhash_rust::xxh3::xxh3_64(&bytes[..body_len]) != sum {
        return Err("checksum mismatch".into());
    }
    let head_len = u32::from_le_bytes(take(8, 4)?.try_into().map_err(|_| "truncated")?) as usize;
    if head_len > MAX_HEADER {
        return Err(format!("header of {head_len} bytes"));
    }
    let header: IndexHeader =
        serde_json::from_slice(take(12, head_len)?).map_err(|e| format!("header: {e}"))?;
    let at = 12 + head_len;
    let count = u64::from_le_bytes(take(at, 8)?.try_into().map_err(|_| "truncated")?);
    let bound = header.num_blocks.min(num_blocks_bound) as u64;
    if count > bound {
        return Err(format!("{count} entries for {bound} slots"));
    }
    let count = count as usize;
    if body_len != at + 8 + count * ENTRY {
        return Err("length does not match the entry count".into());
    }
    let mut seen = vec![false; bound as usize];
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let e = &bytes[at + 8 + i * ENTRY..at + 8 + (i + 1) * ENTRY];
        let slot = u64::from_le_bytes(e[..8].try_into().map_err(|_| "entry")?) as usize;
        let key = u128::from_le_bytes(e[8..24].try_into().map_err(|_| "entry")?);
        let sealed = u64::from_le_bytes(e[24..].try_into().map_err(|_| "entry")?);
        if slot < seen.len() && !seen[slot] {
            seen[slot] = true;
            entries.push(IndexEntry {
                slot,
                key,
                checksum: sealed ^ seal(key),
            });
        }
    }
    Ok((header, entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> IndexHeader {
        IndexHeader {
            identity: "ns".into(),
            kind: "disk".into(),
            bytes_per_block: 100,
            slot_bytes: 4096,
            num_blocks: 4,
            generation: 3,
            resets: 1,
        }
    }

    #[test]
    fn round_trip_and_damage_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x.blocks");
        assert!(load(&f, 4).is_none());
        let entries = vec![
            IndexEntry {
                slot: 2,
                key: 7,
                checksum: 9,
            },
            IndexEntry {
                slot: 0,
                key: u128::MAX,
                checksum: 1,
            },
        ];
        save(&f, &header(), &entries, &mut false).unwrap();
        assert_eq!(load(&f, 4), Some((header(), entries.clone())));
        // Bounded by the caller's slot count: entries beyond it are dropped, not trusted.
        assert!(load(&f, 1).is_none(), "two entries for one slot: refused");
        let mut bytes = std::fs::read(index_path(&f)).unwrap();
        for cut in [0, 7, 20, bytes.len() - 1] {
            std::fs::write(index_path(&f), &bytes[..cut]).unwrap();
            assert!(load(&f, 4).is_none(), "cut at {cut}");
        }
        let n = bytes.len();
        bytes[n / 2] ^= 1;
        std::fs::write(index_path(&f), &bytes).unwrap();
        assert!(load(&f, 4).is_none(), "a flipped bit");
    }

    #[test]
    fn a_different_header_is_refused_naming_the_field() {
        let mut other = header();
        other.num_blocks = 8;
        let err = header().check(&other, Path::new("/d/f")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidConfig);
        assert_eq!(err.context_value("field"), Some("num_blocks"));
        assert!(
            err.to_string().contains('8') && err.to_string().contains('4'),
            "{err}"
        );
        let mut other = header();
        other.identity = "other-model".into();
        let err = header().check(&other, Path::new("/d/f")).unwrap_err();
        assert_eq!(err.context_value("field"), Some("identity"));
        assert!(header().check(&header(), Path::new("/d/f")).is_ok());
    }
}
