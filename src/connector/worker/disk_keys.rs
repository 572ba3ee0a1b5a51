//! A persisted disk tier's index as this worker keeps it (`disk.persist`; see
//! docs/deployment.md): which key each block holds; the tier keeps it durable (bound with the
//! block's checksum).

use super::*;

/// A persisted disk tier's index as this worker wrote it (`disk.persist`): which key each block
/// holds, bound in the tier with the checksum taken right after that write (before the leader
/// learns the write completed, so before it can reuse the block): always a true description of
/// the bytes written.
#[derive(Debug)]
pub(crate) struct DiskKeys {
    tier: Arc<dyn StorageTier>,
    map: Mutex<HashMap<usize, u128>>,
}

impl DiskKeys {
    /// The index of `tier` (persisted, else `None`) starting from what it was reopened with.
    pub(super) fn new(tier: Arc<dyn StorageTier>, index: &[(usize, u128)]) -> Option<Self> {
        let p = tier.persistent()?;
        let map = index
            .iter()
            .filter(|&&(b, _)| p.checksum(b).is_some())
            .copied()
            .collect();
        Some(Self {
            tier,
            map: Mutex::new(map),
        })
    }

    /// Records a keyed store's outcome: `written` `(block, key)` pairs, those in `failed` not.
    /// The tier saves it on its own (`disk.persist`'s bound).
    pub(crate) fn record(&self, written: &[(usize, u128)], failed: &[usize]) {
        let Some(p) = self.tier.persistent() else {
            return;
        };
        let mut map = self.map.lock();
        let mut bind = Vec::new();
        let mut unbind = Vec::new();
        for &(block, key) in written {
            match p.checksum(block) {
                Some(c) if !failed.contains(&block) => {
                    map.insert(block, key);
                    bind.push((block, key, c));
                }
                _ => {
                    map.remove(&block);
                    unbind.push(block);
                }
            }
        }
        p.bind(&bind);
        p.unbind(&unbind);
    }

    /// The first source block of `pairs` whose recorded key is not `keys[i]` (or none recorded).
    pub(crate) fn first_mismatch(&self, pairs: &[(usize, usize)], keys: &[u128]) -> Option<usize> {
        let map = self.map.lock();
        pairs
            .iter()
            .enumerate()
            .find(|(i, p)| map.get(&p.0).copied() != keys.get(*i).copied())
            .map(|(_, p)| p.0)
    }

    /// Saves the index now.
    pub(super) fn save(&self) -> Result<()> {
        match self.tier.persistent() {
            Some(p) => p.flush(),
            None => Ok(()),
        }
    }
}
