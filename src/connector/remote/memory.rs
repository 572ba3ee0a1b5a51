//! [`MemoryRemoteStore`]: an in-process [`RemoteStore`] with injectable faults, the reference
//! implementation and test double of the trait (as object_store keeps its `InMemory` beside its
//! trait), and the store of `memory://NAME` URLs (e.g. `kvbm replay --remote-url memory://plan`).

use super::*;

/// Faults a [`MemoryRemoteStore`] injects (each can be changed while it runs).
#[derive(Debug, Default)]
pub struct MemoryFaults {
    /// Every call fails at once (connection refused) while set.
    pub down: AtomicBool,
    /// Every call first sleeps this many milliseconds (0: none), then answers
    /// [`ErrorKind::Timeout`] if that passed its deadline.
    pub delay_ms: AtomicU64,
    /// Reads of stored values answer [`RemoteRead::Invalid`] while set (a planted or damaged
    /// value).
    pub invalid: AtomicBool,
}

/// An in-process [`RemoteStore`]: values in a map under `(scope, rank, key)`, with injectable
/// [`MemoryFaults`]. Cloning the `Arc` of its map lets several instances (in one process)
/// share one store, as instances share a Redis. The test double of the trait; also the store
/// of `memory://NAME` URLs.
#[derive(Debug, Clone)]
pub struct MemoryRemoteStore {
    scope: RemoteScope,
    data: MemoryRemoteData,
    /// The faults in effect.
    pub faults: Arc<MemoryFaults>,
    counters: Arc<MemoryCounters>,
}

#[derive(Debug, Default)]
struct MemoryCounters {
    errors: AtomicU64,
    timeouts: AtomicU64,
    invalid: AtomicU64,
    available: AtomicBool,
    gets: AtomicU64,
    puts: AtomicU64,
    lookups: AtomicU64,
}

/// The values of [`MemoryRemoteStore`]s that share them.
pub type MemoryRemoteData = Arc<Mutex<HashMap<(String, usize, u128), Vec<u8>>>>;

impl MemoryRemoteStore {
    /// An empty store for `scope`.
    pub fn new(scope: RemoteScope) -> Self {
        Self::shared(scope, MemoryRemoteData::default(), Arc::default())
    }

    /// A store for `scope` over `data` (shared with other stores) and `faults`.
    pub fn shared(scope: RemoteScope, data: MemoryRemoteData, faults: Arc<MemoryFaults>) -> Self {
        let counters = Arc::new(MemoryCounters::default());
        counters.available.store(true, Ordering::Relaxed);
        Self {
            scope,
            data,
            faults,
            counters,
        }
    }

    /// Values held (all scopes and ranks).
    pub fn len(&self) -> usize {
        self.data.lock().len()
    }

    /// True when it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(lookups, gets, puts)` calls so far.
    pub fn calls(&self) -> (u64, u64, u64) {
        (
            self.counters.lookups.load(Ordering::Relaxed),
            self.counters.gets.load(Ordering::Relaxed),
            self.counters.puts.load(Ordering::Relaxed),
        )
    }

    /// Replaces the value of `key` for `rank` (tests: plant a value).
    pub fn plant(&self, rank: usize, key: u128, bytes: Vec<u8>) {
        self.data
            .lock()
            .insert((self.scope.fingerprint.clone(), rank, key), bytes);
    }

    /// Empties the store (a restarted server).
    pub fn clear(&self) {
        self.data.lock().clear();
    }

    /// Applies the faults before a call: down, then the delay against `deadline`.
    fn enter(&self, deadline: Instant) -> Result<()> {
        if self.faults.down.load(Ordering::Relaxed) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            self.counters.available.store(false, Ordering::Relaxed);
            return Err(Error::io(
                "reach the remote store",
                std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            ));
        }
        let delay = self.faults.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            let now = Instant::now();
            let wait = Duration::from_millis(delay);
            if now + wait > deadline {
                std::thread::sleep(deadline.saturating_duration_since(now));
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "the remote store did not answer before the deadline",
                ));
            }
            std::thread::sleep(wait);
        }
        self.counters.available.store(true, Ordering::Relaxed);
        Ok(())
    }
}

impl RemoteStore for MemoryRemoteStore {
    fn describe(&self) -> String {
        "memory".to_string()
    }

    fn scope(&self) -> &RemoteScope {
        &self.scope
    }

    fn lookup_prefix(&self, keys: &[u128], deadline: Instant) -> Result<usize> {
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        self.enter(deadline)?;
        let data = self.data.lock();
        let fp = &self.scope.fingerprint;
        Ok(keys
            .iter()
            .take_while(|k| {
                (0..self.scope.world_size).all(|r| data.contains_key(&(fp.clone(), r, **k)))
            })
            .count())
    }

    fn get(
        &self,
        rank: usize,
        keys: &[u128],
        dst: &mut [&mut [u8]],
        deadline: Instant,
    ) -> Result<Vec<RemoteRead>> {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        if keys.len() != dst.len() {
            return Err(Error::invalid_argument(format!(
                "{} keys but {} buffers",
                keys.len(),
                dst.len()
            )));
        }
        if let Some((i, b)) = dst
            .iter()
            .enumerate()
            .find(|(_, b)| b.len() != self.scope.bytes_per_block)
        {
            return Err(Error::invalid_argument(format!(
                "buffer {i} holds {} bytes; a block is {}",
                b.len(),
                self.scope.bytes_per_block
            )));
        }
        self.enter(deadline)?;
        let data = self.data.lock();
        let invalid = self.faults.invalid.load(Ordering::Relaxed);
        let mut out = Vec::with_capacity(keys.len());
        for (k, buf) in keys.iter().zip(dst.iter_mut()) {
            match data.get(&(self.scope.fingerprint.clone(), rank, *k)) {
                None => out.push(RemoteRead::Missing),
                Some(_) if invalid => {
                    self.counters.invalid.fetch_add(1, Ordering::Relaxed);
                    out.push(RemoteRead::Invalid("checksum mismatch (injected)".into()));
                }
                Some(v) if v.len() != buf.len() => {
                    self.counters.invalid.fetch_add(1, Ordering::Relaxed);
                    out.push(RemoteRead::Invalid(format!(
                        "value holds {} bytes, expected {}",
                        v.len(),
                        buf.len()
                    )));
                }
                Some(v) => {
                    buf.copy_from_slice(v);
                    out.push(RemoteRead::Hit);
                }
            }
        }
        Ok(out)
    }

    fn put(&self, rank: usize, blocks: &[(u128, &[u8])], deadline: Instant) -> Result<RemotePut> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.enter(deadline)?;
        let mut data = self.data.lock();
        let mut done = RemotePut::default();
        for (k, bytes) in blocks {
            if bytes.len() != self.scope.bytes_per_block {
                return Err(Error::invalid_argument(format!(
                    "a value of {} bytes for blocks of {}",
                    bytes.len(),
                    self.scope.bytes_per_block
                )));
            }
            let e = data.entry((self.scope.fingerprint.clone(), rank, *k));
            match e {
                std::collections::hash_map::Entry::Occupied(_) => done.present += 1,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(bytes.to_vec());
                    done.written += 1;
                }
            }
        }
        Ok(done)
    }

    fn stats(&self) -> RemoteStoreStats {
        RemoteStoreStats {
            available: self.counters.available.load(Ordering::Relaxed),
            errors: self.counters.errors.load(Ordering::Relaxed),
            timeouts: self.counters.timeouts.load(Ordering::Relaxed),
            reconnects: 0,
            invalid: self.counters.invalid.load(Ordering::Relaxed),
        }
    }

    fn leaves_the_process(&self) -> bool {
        false
    }
}
