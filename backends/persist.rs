//! The index that lets a disk tier's file outlive its process (`disk.persist`): which slot holds
//! which key, with the checksum of what was written there, saved beside the slot file and read
//! back when a later process opens the same file.
//!
//! File `<slot file>.index`, written whole to a temporary file, `fsync`ed and renamed over the old
//! one (a reader sees the previous index or the new one, never half of one), after the slot file's
//! data is synced (so no entry names bytes that are not on disk):
//!
//! ```text
//! "KVBMIDX1" | u32 header length | header (JSON: identity, kind, bytes_per_block, slot_bytes,
//! num_blocks) | u64 count | count × (u64 slot, u128 key, u64 checksum) | u64 xxh3 of all before
//! ```
//!
//! Every integer little-endian. Reading is bounded (the header at most [`MAX_HEADER`] bytes, at
//! most `num_blocks` entries, the file exactly the length these give) and verified (the trailing
//! checksum); an index that fails either is ignored with a warning (the tier starts empty), never
//! trusted. An entry only says what a slot should hold: each read still verifies the slot's bytes
//! against the entry's checksum, so a slot rewritten after the index was saved reads as corrupt,
//! never as the old key's bytes.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

const MAGIC: &[u8; 8] = b"KVBMIDX1";
/// The most bytes of a header read.
pub const MAX_HEADER: usize = 64 * 1024;
const ENTRY: usize = 8 + 16 + 8;

/// What a persisted file was written for; a reopening tier must agree on every field.
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
    /// xxh3-64 of the block's canonical image.
    pub checksum: u64,
}

/// The index path of a slot file.
pub fn index_path(slot_file: &Path) -> PathBuf {
    let mut p = slot_file.as_os_str().to_owned();
    p.push(".index");
    PathBuf::from(p)
}

/// Writes the index of `slot_file` (see the module docs). The caller syncs the slot file first.
pub fn save(slot_file: &Path, header: &IndexHeader, entries: &[IndexEntry]) -> Result<()> {
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
        buf.extend_from_slice(&e.checksum.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&buf);
    buf.extend_from_slice(&sum.to_le_bytes());
    let path = index_path(slot_file);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let io = |op: &'static str, e: std::io::Error| Error::io(op, e).with("path", path.display());
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| io("create", e))?;
        f.write_all(&buf).map_err(|e| io("write", e))?;
        f.sync_all().map_err(|e| io("fsync", e))?;
    }
    std::fs::rename(&tmp, &path).map_err(|e| io("rename", e))
}

/// Reads the index of `slot_file`: `None` when there is none, or when it is damaged (logged);
/// the header it was written with otherwise, and its entries (each slot below the header's
/// `num_blocks` and named once; others dropped).
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
    match parse(&bytes, num_blocks_bound) {
        Ok(v) => Some(v),
        Err(why) => {
            tracing::warn!(path = %path.display(), %why, "disk index damaged; the tier starts empty");
            None
        }
    }
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
    if take(0, 8)? != MAGIC {
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
        let checksum = u64::from_le_bytes(e[24..].try_into().map_err(|_| "entry")?);
        if slot < seen.len() && !seen[slot] {
            seen[slot] = true;
            entries.push(IndexEntry {
                slot,
                key,
                checksum,
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
        save(&f, &header(), &entries).unwrap();
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
