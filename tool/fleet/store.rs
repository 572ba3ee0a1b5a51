//! The fleet's shared tier: an in-process [`RemoteStore`] with a capacity bound and its own
//! eviction (least recently used), or a real server (`--remote-url`) seen through a wrapper that
//! counts its traffic; and the [`TierFactory`] that hands every instance of a fleet run the
//! same store.
//!
//! Both count what the instances read and write ([`Traffic`]): the planner reports it as the
//! shared tier's traffic. The in-process store also knows its size (blocks and bytes held) and
//! how many blocks it evicted; a server's size is its own (`INFO memory`).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use kvbm_connector::backends::StandardTiers;
use kvbm_connector::config::Config;
use kvbm_connector::connector::remote::{
    RemotePut, RemoteRead, RemoteScope, RemoteStore, RemoteStoreStats,
};
use kvbm_connector::connector::transport::TierCounts;
use kvbm_connector::connector::worker::{TierFactory, WorkerTiers};
use kvbm_connector::error::{Error, Result};
use kvbm_connector::tier::StorageTier;

/// What the instances of a fleet run did with the shared tier (all ranks, all instances).
#[derive(Debug, Default)]
pub struct Traffic {
    /// Prefix lookups (the leaders').
    pub lookups: AtomicU64,
    /// Blocks read and served (verified hits).
    pub blocks_read: AtomicU64,
    /// Blocks asked for and missing (evicted between the lookup and the read).
    pub blocks_missing: AtomicU64,
    /// Blocks written.
    pub blocks_written: AtomicU64,
    /// Blocks offered that the store already held (not written again).
    pub blocks_present: AtomicU64,
    /// Calls that failed.
    pub errors: AtomicU64,
}

impl Traffic {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> TrafficSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TrafficSnapshot {
            lookups: get(&self.lookups),
            blocks_read: get(&self.blocks_read),
            blocks_missing: get(&self.blocks_missing),
            blocks_written: get(&self.blocks_written),
            blocks_present: get(&self.blocks_present),
            errors: get(&self.errors),
        }
    }
}

/// [`Traffic`]'s counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrafficSnapshot {
    /// Prefix lookups.
    pub lookups: u64,
    /// Blocks read.
    pub blocks_read: u64,
    /// Blocks asked for and missing.
    pub blocks_missing: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// Blocks offered that were already there.
    pub blocks_present: u64,
    /// Calls that failed.
    pub errors: u64,
}

/// A value's key: the scope's fingerprint (hashed), the rank, the block key.
type Key = (u64, usize, u128);

/// The values and their recency order.
#[derive(Debug, Default)]
struct Values {
    /// Value and its last use (a tick of `clock`).
    map: HashMap<Key, (Vec<u8>, u64)>,
    /// Last use → key: the oldest first.
    order: BTreeMap<u64, Key>,
    clock: u64,
    bytes: usize,
    evicted: u64,
}

impl Values {
    fn touch(&mut self, k: &Key) {
        self.clock += 1;
        let now = self.clock;
        if let Some((_, used)) = self.map.get_mut(k) {
            self.order.remove(used);
            *used = now;
            self.order.insert(now, *k);
        }
    }

    fn insert(&mut self, k: Key, v: Vec<u8>, capacity: Option<usize>) {
        self.clock += 1;
        self.bytes += v.len();
        self.map.insert(k, (v, self.clock));
        self.order.insert(self.clock, k);
        let Some(cap) = capacity else { return };
        while self.map.len() > cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some((v, _)) = self.map.remove(&oldest) {
                self.bytes -= v.len();
                self.evicted += 1;
            }
        }
    }
}

/// The in-process shared store of a fleet run: at most `capacity` values (one per block and
/// rank; unlimited when `None`), the least recently used evicted first (a read or a write
/// counts as a use; a lookup does not). Every instance reaches it through a [`SharedView`].
#[derive(Debug)]
pub struct SharedStore {
    values: Mutex<Values>,
    capacity: Option<usize>,
    /// What the instances did with it.
    pub traffic: Traffic,
}

/// The in-process store's size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreSize {
    /// Values (blocks × ranks) held.
    pub blocks: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Values evicted to stay within the capacity.
    pub evicted: u64,
}

impl SharedStore {
    /// An empty store of at most `capacity` values (`None`: unlimited). A capacity of 0 is
    /// refused.
    pub fn new(capacity: Option<usize>) -> Result<Arc<Self>> {
        if capacity == Some(0) {
            return Err(
                Error::invalid_argument("--shared-tokens is less than one block")
                    .with("flag", "--shared-tokens"),
            );
        }
        Ok(Arc::new(Self {
            values: Mutex::new(Values::default()),
            capacity,
            traffic: Traffic::default(),
        }))
    }

    /// Its size now.
    pub fn size(&self) -> StoreSize {
        let v = self.values.lock();
        StoreSize {
            blocks: v.map.len(),
            bytes: v.bytes,
            evicted: v.evicted,
        }
    }
}

/// One instance's view of a [`SharedStore`] for its scope.
#[derive(Debug)]
pub struct SharedView {
    store: Arc<SharedStore>,
    scope: RemoteScope,
    fp: u64,
}

impl SharedView {
    /// The view of `store` for `scope`.
    pub fn new(store: Arc<SharedStore>, scope: RemoteScope) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        scope.fingerprint.hash(&mut h);
        Self {
            store,
            fp: h.finish(),
            scope,
        }
    }
}

impl RemoteStore for SharedView {
    fn describe(&self) -> String {
        "fleet (in-process)".to_string()
    }

    fn scope(&self) -> &RemoteScope {
        &self.scope
    }

    fn lookup_prefix(&self, keys: &[u128], _deadline: Instant) -> Result<usize> {
        Traffic::add(&self.store.traffic.lookups, 1);
        let v = self.store.values.lock();
        Ok(keys
            .iter()
            .take_while(|k| {
                (0..self.scope.world_size).all(|r| v.map.contains_key(&(self.fp, r, **k)))
            })
            .count())
    }

    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        _deadline: Instant,
    ) -> Result<Vec<RemoteRead>> {
        if keys.len() != dst.len() {
            Traffic::add(&self.store.traffic.errors, 1);
            return Err(Error::invalid_argument(format!(
                "{} keys but {} buffers",
                keys.len(),
                dst.len()
            )));
        }
        let mut v = self.store.values.lock();
        let mut out = Vec::with_capacity(keys.len());
        for (k, buf) in keys.iter().zip(dst.iter_mut()) {
            let key = (self.fp, rank, *k);
            let read = match v.map.get(&key) {
                None => RemoteRead::Missing,
                Some((val, _)) if val.len() != buf.len() => RemoteRead::Invalid(format!(
                    "value holds {} bytes, expected {}",
                    val.len(),
                    buf.len()
                )),
                Some((val, _)) => {
                    buf.copy_from_slice(val);
                    RemoteRead::Hit
                }
            };
            if read == RemoteRead::Hit {
                v.touch(&key);
                Traffic::add(&self.store.traffic.blocks_read, 1);
            } else {
                Traffic::add(&self.store.traffic.blocks_missing, 1);
            }
            out.push(read);
        }
        Ok(out)
    }

    fn put(&self, rank: usize, blocks: &[(u128, &[u8])], _deadline: Instant) -> Result<RemotePut> {
        if let Some((_, b)) = blocks
            .iter()
            .find(|(_, b)| b.len() != self.scope.bytes_per_block)
        {
            Traffic::add(&self.store.traffic.errors, 1);
            return Err(Error::invalid_argument(format!(
                "a value of {} bytes for blocks of {}",
                b.len(),
                self.scope.bytes_per_block
            )));
        }
        let mut v = self.store.values.lock();
        let mut done = RemotePut::default();
        for (k, bytes) in blocks {
            let key = (self.fp, rank, *k);
            if v.map.contains_key(&key) {
                v.touch(&key);
                done.present += 1;
            } else {
                v.insert(key, bytes.to_vec(), self.store.capacity);
                done.written += 1;
            }
        }
        Traffic::add(&self.store.traffic.blocks_written, done.written);
        Traffic::add(&self.store.traffic.blocks_present, done.present);
        Ok(done)
    }

    fn stats(&self) -> RemoteStoreStats {
        RemoteStoreStats {
            available: true,
            ..RemoteStoreStats::default()
        }
    }

    fn leaves_the_process(&self) -> bool {
        false
    }
}

/// A real server's store (`--remote-url`) with its traffic counted.
#[derive(Debug)]
pub struct CountedStore {
    inner: Arc<dyn RemoteStore>,
    traffic: Arc<Traffic>,
}

impl RemoteStore for CountedStore {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn scope(&self) -> &RemoteScope {
        self.inner.scope()
    }

    fn lookup_prefix(&self, keys: &[u128], deadline: Instant) -> Result<usize> {
        Traffic::add(&self.traffic.lookups, 1);
        let r = self.inner.lookup_prefix(keys, deadline);
        if r.is_err() {
            Traffic::add(&self.traffic.errors, 1);
        }
        r
    }

    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: Instant,
    ) -> Result<Vec<RemoteRead>> {
        let r = self.inner.get(rank, keys, dst, deadline);
        match &r {
            Ok(reads) => {
                let hits = reads.iter().filter(|x| **x == RemoteRead::Hit).count();
                Traffic::add(&self.traffic.blocks_read, hits);
                Traffic::add(&self.traffic.blocks_missing, reads.len() - hits);
            }
            Err(_) => Traffic::add(&self.traffic.errors, 1),
        }
        r
    }

    fn put(&self, rank: usize, blocks: &[(u128, &[u8])], deadline: Instant) -> Result<RemotePut> {
        let r = self.inner.put(rank, blocks, deadline);
        match &r {
            Ok(p) => {
                Traffic::add(&self.traffic.blocks_written, p.written);
                Traffic::add(&self.traffic.blocks_present, p.present);
            }
            Err(_) => Traffic::add(&self.traffic.errors, 1),
        }
        r
    }

    fn stats(&self) -> RemoteStoreStats {
        self.inner.stats()
    }

    fn leaves_the_process(&self) -> bool {
        self.inner.leaves_the_process()
    }
}

/// The shared tier of one fleet run.
#[derive(Debug, Clone)]
pub enum Shared {
    /// The in-process store.
    InProcess(Arc<SharedStore>),
    /// A real server (the instances' `remote.url`), its traffic counted here.
    Server(Arc<Traffic>),
}

impl Shared {
    /// Its traffic so far.
    pub fn traffic(&self) -> TrafficSnapshot {
        match self {
            Shared::InProcess(s) => s.traffic.snapshot(),
            Shared::Server(t) => t.snapshot(),
        }
    }

    /// The in-process store's size (`None` for a server).
    pub fn size(&self) -> Option<StoreSize> {
        match self {
            Shared::InProcess(s) => Some(s.size()),
            Shared::Server(_) => None,
        }
    }
}

/// The tiers of a fleet's instance: the standard host and disk tiers, and the run's shared store
/// as the remote tier.
#[derive(Debug)]
pub struct FleetTiers {
    /// The run's shared tier.
    pub shared: Shared,
}

impl TierFactory for FleetTiers {
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> Result<WorkerTiers> {
        StandardTiers.build(config, rank, device, counts)
    }

    fn remote_store(
        &self,
        config: &Config,
        scope: &RemoteScope,
    ) -> Result<Option<Arc<dyn RemoteStore>>> {
        Ok(Some(match &self.shared {
            Shared::InProcess(store) => Arc::new(SharedView::new(store.clone(), scope.clone())),
            Shared::Server(traffic) => {
                let Some(inner) = kvbm_connector::backends::remote::connect(config, scope)? else {
                    return Ok(None);
                };
                Arc::new(CountedStore {
                    inner,
                    traffic: traffic.clone(),
                })
            }
        }))
    }
}

/// Checks that the server `config.remote.url` names answers, within `timeout`: a lookup through
/// a store built for a probe scope (a store starts unavailable and connects in the
/// background, so it is asked until it answers). The error names `--remote-url`.
pub fn probe_server(config: &Config, timeout: std::time::Duration) -> Result<()> {
    let url = config.remote.url.clone().unwrap_or_default();
    let redacted = kvbm_connector::config::redact_url(&url);
    let bad = |why: String| {
        Error::invalid_argument(format!("--remote-url {redacted}: {why}"))
            .with("flag", "--remote-url")
    };
    let scope = RemoteScope::new(
        "kvbm-fleet-probe",
        1,
        1,
        1,
        kvbm_connector::identity::HashAlgorithm::Sha256,
    )?;
    let store = kvbm_connector::backends::remote::connect(config, &scope)
        .map_err(|e| bad(e.to_string()))?
        .ok_or_else(|| bad("no store".into()))?;
    let deadline = Instant::now() + timeout;
    loop {
        let call = (Instant::now() + std::time::Duration::from_millis(500)).min(deadline);
        match store.lookup_prefix(&[1], call) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(bad(format!(
                    "cannot be reached within {:.0} s: {e}",
                    timeout.as_secs_f64()
                )))
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_connector::identity::HashAlgorithm;

    fn view(store: &Arc<SharedStore>) -> SharedView {
        let scope = RemoteScope::new("t", 4, 1, 2, HashAlgorithm::Sha256).unwrap();
        SharedView::new(store.clone(), scope)
    }

    #[test]
    fn the_least_recently_used_value_goes_first() {
        let store = SharedStore::new(Some(2)).unwrap();
        let v = view(&store);
        let far = Instant::now() + std::time::Duration::from_secs(5);
        v.put(0, &[(1, &[1, 1]), (2, &[2, 2])], far).unwrap();
        // Reading 1 makes 2 the oldest: writing 3 evicts 2.
        let mut b = [0u8; 2];
        assert_eq!(
            v.get(0, &[1], &mut [&mut b], far).unwrap(),
            [RemoteRead::Hit]
        );
        assert_eq!(b, [1, 1]);
        v.put(0, &[(3, &[3, 3])], far).unwrap();
        assert_eq!(v.lookup_prefix(&[1, 3], far).unwrap(), 2);
        assert_eq!(v.lookup_prefix(&[2], far).unwrap(), 0);
        assert_eq!(
            store.size(),
            StoreSize {
                blocks: 2,
                bytes: 4,
                evicted: 1
            }
        );
        let t = store.traffic.snapshot();
        assert_eq!((t.blocks_written, t.blocks_read, t.lookups), (3, 1, 2));
        assert_eq!(
            v.get(0, &[2], &mut [&mut b], far).unwrap(),
            [RemoteRead::Missing]
        );
        assert_eq!(store.traffic.snapshot().blocks_missing, 1);
    }

    #[test]
    fn an_unlimited_store_keeps_everything_once() {
        let store = SharedStore::new(None).unwrap();
        let v = view(&store);
        let far = Instant::now() + std::time::Duration::from_secs(5);
        for k in 0..100u128 {
            v.put(0, &[(k, &[0, 0])], far).unwrap();
        }
        let again = v.put(0, &[(5, &[9, 9])], far).unwrap();
        assert_eq!((again.written, again.present), (0, 1));
        assert_eq!(store.size().blocks, 100);
        assert_eq!(store.size().evicted, 0);
        assert!(SharedStore::new(Some(0)).is_err());
        // A value of the wrong length is refused, not stored.
        assert!(v.put(0, &[(200, &[1])], far).is_err());
    }
}
