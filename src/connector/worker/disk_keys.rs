//! A persisted disk tier's index as this worker keeps it (`disk.persist`; see
//! docs/deployment.md): which key each block holds, recorded with the block's checksum.

use super::*;

/// A persisted disk tier's index as this worker wrote it (`disk.persist`): which key each block
/// holds, with the checksum taken right after that write (before the leader learns the write
/// completed, so before it can reuse the block): always a true description of the bytes written.
#[derive(Debug)]
pub(crate) struct DiskKeys {
    tier: Arc<dyn StorageTier>,
    map: Mutex<HashMap<usize, (u128, u64)>>,
    last_save: Mutex<Instant>,
    /// Held while the index is written: the copies' threads complete concurrently, and two
    /// saves at once would write the same temporary file.
    saving: Mutex<()>,
}

impl DiskKeys {
    /// The index of `tier` (persisted, else `None`) starting from what it was reopened with.
    pub(super) fn new(tier: Arc<dyn StorageTier>, index: &[(usize, u128)]) -> Option<Self> {
        let p = tier.persistent()?;
        let map = index
            .iter()
            .filter_map(|&(b, k)| Some((b, (k, p.checksum(b)?))))
            .collect();
        Some(Self {
            tier,
            map: Mutex::new(map),
            last_save: Mutex::new(Instant::now()),
            saving: Mutex::new(()),
        })
    }

    /// Records a keyed store's outcome: `written` `(block, key)` pairs, those in `failed` not.
    pub(crate) fn record(&self, written: &[(usize, u128)], failed: &[usize]) {
        let Some(p) = self.tier.persistent() else {
            return;
        };
        let mut map = self.map.lock();
        for &(block, key) in written {
            match p.checksum(block) {
                Some(c) if !failed.contains(&block) => {
                    map.insert(block, (key, c));
                }
                _ => {
                    map.remove(&block);
                }
            }
        }
    }

    /// The first source block of `pairs` whose recorded key is not `keys[i]` (or none recorded).
    pub(crate) fn first_mismatch(&self, pairs: &[(usize, usize)], keys: &[u128]) -> Option<usize> {
        let map = self.map.lock();
        pairs
            .iter()
            .enumerate()
            .find(|(i, p)| map.get(&p.0).map(|e| e.0) != keys.get(*i).copied())
            .map(|(_, p)| p.0)
    }

    /// Saves the index now (after a save in progress, if any).
    pub(super) fn save(&self) -> Result<()> {
        let _saving = self.saving.lock();
        *self.last_save.lock() = Instant::now();
        self.write_index()
    }

    /// Writes the index; the caller holds `saving`.
    fn write_index(&self) -> Result<()> {
        let entries: Vec<(usize, u128, u64)> = self
            .map
            .lock()
            .iter()
            .map(|(&b, &(k, c))| (b, k, c))
            .collect();
        match self.tier.persistent() {
            Some(p) => p.save_entries(&entries),
            None => Ok(()),
        }
    }

    /// Saves the index when [`DISK_INDEX_SAVE_EVERY`] passed since the last save.
    /// One completing thread claims the save (the others go on at once: a save in progress, or
    /// one claimed, is enough).
    pub(crate) fn maybe_save(&self) {
        {
            let mut last = self.last_save.lock();
            if last.elapsed() < DISK_INDEX_SAVE_EVERY {
                return;
            }
            *last = Instant::now();
        }
        let Some(_saving) = self.saving.try_lock() else {
            return;
        };
        if let Err(e) = self.write_index() {
            tracing::warn!(error = %e, "kvbm worker: the persisted disk index was not saved");
        }
    }
}
