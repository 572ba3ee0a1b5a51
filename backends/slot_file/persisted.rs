//! The persisted slot file (`disk.persist`): opened by its identity with the blocks its index
//! names, and its index saved (`persist.rs` is the index's format). A child of `slot_file.rs`,
//! whose file protocol it shares.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use parking_lot::RwLock;

use super::{direct_setup, lock, open_direct_preserving, preallocate, prepare, SlotFile};
use crate::backends::disk::DiskTierOptions;
use crate::backends::persist::{IndexEntry, IndexHeader};
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
        };
        let entries = checked_index(kind, &want, &path, len, file_bytes)?;
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
            },
            entries,
        ))
    }

    /// The checksum recorded for `block`'s last complete write, if any.
    pub(crate) fn checksum(&self, block: usize) -> Option<u64> {
        *self.checksums.get(block)?.read()
    }

    /// Saves `entries` (slot, key and the checksum the owner recorded with the key) as the
    /// persisted file's index. Syncs the file's data first.
    pub(crate) fn save_entries(&self, identity: &str, entries: &[IndexEntry]) -> Result<()> {
        if !self.persist {
            return Err(Error::unsupported(
                "the disk tier is not persisted (disk.persist)",
            ));
        }
        self.file
            .sync_data()
            .map_err(|e| Error::io("fsync", e).with("path", self.path.display()))?;
        let header = IndexHeader {
            identity: identity.to_string(),
            kind: self.kind.to_string(),
            bytes_per_block: self.layout.bytes_per_block(),
            slot_bytes: self.slot_bytes,
            num_blocks: self.layout.num_blocks(),
        };
        crate::backends::persist::save(&self.path, &header, entries)
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

/// The entries of the persisted file's index when it was written for `want` (else the
/// difference, named); none when there is no usable index — unless the file has data of
/// another size, which nothing then explains (refused).
fn checked_index(
    kind: TierKind,
    want: &IndexHeader,
    path: &Path,
    len: u64,
    file_bytes: u64,
) -> Result<Vec<IndexEntry>> {
    match crate::backends::persist::load(path, want.num_blocks) {
        Some((found, entries)) => {
            want.check(&found, path)?;
            Ok(entries)
        }
        None if len != 0 && len != file_bytes => Err(refuse_persisted(
            kind,
            path,
            format!(
                "{len} bytes with no usable index; this tier needs {file_bytes}: remove it to \
                 start empty"
            ),
        )),
        None => Ok(Vec::new()),
    }
}
