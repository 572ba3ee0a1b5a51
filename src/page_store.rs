//! A key-value store of fixed-size pages over the connector's tiers, for engines that keep their
//! own prefix tree and host pool and want only a storage backend (SGLang's HiCache L3).
//!
//! An engine names a page by its own key (SGLang: a page hash, as text); [`PageStore::key`] turns
//! it into a 128-bit block key under the store's *namespace* (the model, the rank's share, the
//! page layout — whatever makes two instances' pages different bytes), so two namespaces never
//! share a page. Pages go to every configured level: the host tier (optional), the disk tier
//! (checksummed), and the shared remote store; a read tries them in that order.
//!
//! Invariants:
//! * a page is served only from a tier that verified it (the disk tier's checksum, the remote
//!   store's key/length/checksum check): a corrupt or truncated page is a miss, and its local
//!   copy is withdrawn so it is not tried again; never wrong bytes;
//! * every page of a call is checked for its size before anything is written or read: a wrong
//!   size is an [`ErrorKind::InvalidArgument`] naming the page, and nothing changes;
//! * a local tier that is full evicts by its pool's policy; a page being read is held, so it is
//!   never evicted or rewritten under a reader;
//! * the remote store is bounded by its deadlines: a slow or failing store costs its own hits
//!   (its pages are misses, its writes are dropped and counted), never an error of the call.

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::connector::remote::{
    log_state_change, CallKind, CallOutcome, RemoteRead, RemoteStore, StoreHealth, StoreState,
};
use crate::error::{Error, ErrorKind, Result};
use crate::identity::SequenceHash;
use crate::pool::{BlockPool, EvictionPolicy, FrequencyFilter};
use crate::tier::{StorageTier, TierKind};

/// The most pages one call may name (bounds the work and the buffers of one call).
pub const MAX_PAGES_PER_CALL: usize = 65_536;

/// The tiers a [`PageStore`] is built over (what a storage backend factory hands it). Every
/// local tier's blocks are exactly one page.
#[derive(Debug, Default, Clone)]
pub struct PageStoreTiers {
    /// Host memory (G2), if any.
    pub host: Option<Arc<dyn StorageTier>>,
    /// Local disk (G3), if any.
    pub disk: Option<Arc<dyn StorageTier>>,
    /// The shared store (G4), if any; its scope's `bytes_per_block` must be the page size.
    pub remote: Option<Arc<dyn RemoteStore>>,
    /// `(block, key)` of the pages a persisted disk tier already holds (what it was reopened
    /// with): the store serves them again. Blocks out of range are ignored.
    pub disk_index: Vec<(usize, u128)>,
}

/// How a [`PageStore`] talks to its remote store.
#[derive(Debug, Clone, Copy)]
pub struct PageStoreOptions {
    /// The eviction policy of each local tier.
    pub eviction: EvictionPolicy,
    /// Deadline of one remote lookup.
    pub lookup_timeout: Duration,
    /// Deadline of one remote read or write batch.
    pub io_timeout: Duration,
    /// The remote store's median latency above which it is slow (`remote.slow_ms`): a slow or
    /// failing store is left alone for its back-off (see [`StoreHealth`]).
    pub slow: Duration,
    /// The first back-off of a slow or failing remote store (`remote.backoff_secs`).
    pub backoff: Duration,
    /// Sightings (puts and lookups) of a page before it is written to the disk tier
    /// (`disk.min_frequency`; 1 admits every page).
    pub disk_min_frequency: u32,
    /// Sightings of a page before it is written to the remote store (`remote.min_frequency`).
    pub remote_min_frequency: u32,
    /// Threads that read or write one call's pages of the local tiers at once (the calling
    /// thread and up to this many − 1 more; `transfer.max_concurrency`). Bounded by the
    /// machine's cores and by [`PARALLEL_MIN_BYTES`] of pages per thread; 1 keeps every call on
    /// the calling thread.
    pub io_threads: usize,
}

/// The fewest bytes of pages a [`PageStore`] call gives each of its I/O threads: below it a
/// thread costs more to start than it saves.
pub const PARALLEL_MIN_BYTES: usize = 1 << 20;

impl Default for PageStoreOptions {
    fn default() -> Self {
        Self {
            eviction: EvictionPolicy::default(),
            lookup_timeout: Duration::from_millis(5),
            io_timeout: Duration::from_secs(2),
            slow: Duration::from_millis(50),
            backoff: Duration::from_secs(1),
            disk_min_frequency: 1,
            remote_min_frequency: 1,
            io_threads: 4,
        }
    }
}

/// Counters of a [`PageStore`] since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PageStoreStats {
    /// Pages asked to be stored.
    pub put_pages: u64,
    /// Of those, pages that at least one level now holds.
    pub put_stored: u64,
    /// Pages asked to be read.
    pub get_pages: u64,
    /// Pages served from the host tier.
    pub host_hits: u64,
    /// Pages served from the disk tier.
    pub disk_hits: u64,
    /// Pages served from the remote store.
    pub remote_hits: u64,
    /// Pages found nowhere (or found only damaged).
    pub misses: u64,
    /// Local copies that failed verification (withdrawn, not served).
    pub corrupt: u64,
    /// Remote values that failed verification (not served).
    pub remote_invalid: u64,
    /// Remote calls that failed or missed their deadline.
    pub remote_errors: u64,
    /// Remote calls not made: the store was out of the path (slow or unavailable, backing off).
    pub remote_skipped: u64,
    /// Pages the admission filter kept off the disk tier (not seen often enough yet).
    pub disk_not_admitted: u64,
    /// The remote store's verdict (healthy, slow, unavailable), if there is one.
    pub remote_state: Option<StoreState>,
    /// Pages the host tier holds now.
    pub host_pages: u64,
    /// Pages the disk tier holds now.
    pub disk_pages: u64,
}

#[derive(Default)]
struct Counters {
    put_pages: AtomicU64,
    put_stored: AtomicU64,
    get_pages: AtomicU64,
    host_hits: AtomicU64,
    disk_hits: AtomicU64,
    remote_hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    remote_invalid: AtomicU64,
    remote_errors: AtomicU64,
    remote_skipped: AtomicU64,
    disk_not_admitted: AtomicU64,
}

fn bump(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::Relaxed);
}

/// One local level: a tier and the pool that says which of its blocks holds which page.
struct Level {
    tier: Arc<dyn StorageTier>,
    pool: BlockPool,
}

/// The remote store and its health verdict.
struct Remote {
    store: Arc<dyn RemoteStore>,
    health: StoreHealth,
}

impl Remote {
    /// Runs one call unless the store is out of the path (then `None`), recording its outcome.
    fn call<T>(
        &self,
        kind: CallKind,
        f: impl FnOnce(&dyn RemoteStore) -> Result<T>,
    ) -> Option<Result<T>> {
        if !self.health.in_path() {
            return None;
        }
        let started = Instant::now();
        let out = f(self.store.as_ref());
        let outcome = if out.is_ok() {
            CallOutcome::Answered
        } else {
            CallOutcome::Failed
        };
        if let Some((from, to)) = self.health.record(kind, started.elapsed(), outcome) {
            log_state_change(&self.store.describe(), from, to, self.health.slow());
        }
        Some(out)
    }
}

/// Runs `work` on every item, on the calling thread and up to `workers − 1` scoped threads that
/// take the next item from a shared queue until none is left (so a slow item holds up only its
/// own thread). A thread the system cannot start leaves its share to the others; the calling
/// thread always drains the queue, so every item is worked on exactly once.
fn for_each_shared<T: Send>(items: &mut [T], workers: usize, work: impl Fn(&mut T) + Sync) {
    if workers <= 1 || items.len() <= 1 {
        items.iter_mut().for_each(work);
        return;
    }
    let queue = parking_lot::Mutex::new(items.iter_mut());
    let drain = || loop {
        let Some(item) = queue.lock().next() else {
            break;
        };
        work(item);
    };
    std::thread::scope(|s| {
        for _ in 1..workers {
            let spawned = std::thread::Builder::new()
                .name("kvbm-page-io".into())
                .spawn_scoped(s, drain);
            if let Err(e) = spawned {
                tracing::debug!(error = %e, "page store: an I/O thread did not start; fewer run");
                break;
            }
        }
        drain();
    });
}

/// A key-value store of fixed-size pages; see the [module docs](self). Shared between threads
/// (`&self` everywhere).
pub struct PageStore {
    namespace: String,
    page_bytes: usize,
    levels: Vec<Level>,
    remote: Option<Remote>,
    options: PageStoreOptions,
    /// Sightings of pages, for the disk and remote admission.
    filter: parking_lot::Mutex<FrequencyFilter>,
    counters: Counters,
    /// The machine's cores (the most I/O threads a call uses).
    cores: usize,
}

impl PageStore {
    /// Its counters in Prometheus text format, every sample labelled `engine="<engine>"`
    /// (`kvbm_page_store_*`: pages put and stored, pages read, hits by tier, misses, corrupt
    /// pages, remote errors and invalid values; gauges: pages held by tier).
    pub fn render_prometheus(&self, engine: &str) -> String {
        use std::fmt::Write;
        let s = self.stats();
        let engine: String = engine
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
            .collect();
        let one = |st: StoreState| u64::from(s.remote_state == Some(st));
        let tiers = |h, d, r: Option<u64>| {
            let mut v = vec![(",tier=\"host\"", h), (",tier=\"disk\"", d)];
            v.extend(r.map(|r| (",tier=\"remote\"", r)));
            v
        };
        type Metric<'a> = (&'a str, &'a str, &'a str, Vec<(&'a str, u64)>);
        let mut table: Vec<Metric<'_>> = vec![
            ("put_pages_total", "counter", "Pages asked to be stored.", vec![("", s.put_pages)]),
            ("stored_pages_total", "counter", "Pages some tier held after a put.", vec![("", s.put_stored)]),
            ("get_pages_total", "counter", "Pages asked to be read.", vec![("", s.get_pages)]),
            ("hits_total", "counter", "Pages served, by the tier that served them.", tiers(s.host_hits, s.disk_hits, Some(s.remote_hits))),
            ("misses_total", "counter", "Pages found nowhere (or only damaged).", vec![("", s.misses)]),
            ("corrupt_total", "counter", "Local pages that failed verification (not served, withdrawn).", vec![("", s.corrupt)]),
            ("remote_invalid_total", "counter", "Remote values that failed verification (not served).", vec![("", s.remote_invalid)]),
            ("remote_errors_total", "counter", "Remote calls that failed or missed their deadline.", vec![("", s.remote_errors)]),
            ("remote_skipped_total", "counter", "Remote calls not made: the store was out of the path (slow or unavailable, backing off).", vec![("", s.remote_skipped)]),
            ("disk_not_admitted_total", "counter", "Pages kept off the disk tier by its admission filter.", vec![("", s.disk_not_admitted)]),
            ("pages", "gauge", "Pages a local tier holds now.", tiers(s.host_pages, s.disk_pages, None)),
        ];
        if s.remote_state.is_some() {
            table.push((
                "remote_state",
                "gauge",
                "The remote store's verdict: 1 for the current state.",
                vec![
                    (",state=\"healthy\"", one(StoreState::Healthy)),
                    (",state=\"slow\"", one(StoreState::Slow)),
                    (",state=\"unavailable\"", one(StoreState::Unavailable)),
                ],
            ));
        }
        let mut out = String::new();
        for (name, kind, help, samples) in table {
            let _ = writeln!(out, "# HELP kvbm_page_store_{name} {help}");
            let _ = writeln!(out, "# TYPE kvbm_page_store_{name} {kind}");
            for (extra, v) in samples {
                let _ = writeln!(
                    out,
                    "kvbm_page_store_{name}{{engine=\"{engine}\"{extra}}} {v}"
                );
            }
        }
        out
    }
}

impl Drop for PageStore {
    /// Saves the persisted tiers' indexes, so a clean shutdown keeps every page.
    fn drop(&mut self) {
        if self.levels.iter().any(|l| l.tier.persistent().is_some()) {
            if let Err(e) = self.flush() {
                tracing::warn!(error = %e, "page store: the persisted index was not saved");
            }
        }
    }
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("namespace", &self.namespace)
            .field("page_bytes", &self.page_bytes)
            .field(
                "levels",
                &self
                    .levels
                    .iter()
                    .map(|l| l.tier.kind())
                    .collect::<Vec<_>>(),
            )
            .field("remote", &self.remote.as_ref().map(|r| r.store.describe()))
            .finish()
    }
}

impl PageStore {
    /// A store of `page_bytes`-byte pages named within `namespace`, over `tiers`.
    ///
    /// Errors: `page_bytes` is 0; a local tier whose blocks are not `page_bytes` long; a remote
    /// store whose values are not (invalid argument, naming the tier); no tier at all
    /// (invalid config: nothing would be stored).
    pub fn new(
        namespace: impl Into<String>,
        page_bytes: usize,
        tiers: PageStoreTiers,
        options: PageStoreOptions,
    ) -> Result<Self> {
        if page_bytes == 0 {
            return Err(Error::invalid_argument(
                "a page store needs pages of at least one byte",
            ));
        }
        let mut levels = Vec::new();
        let disk_index = tiers.disk_index;
        for tier in [tiers.host, tiers.disk].into_iter().flatten() {
            if tier.bytes_per_block() != page_bytes {
                return Err(Error::invalid_argument(format!(
                    "the {} tier's blocks are {} bytes but a page is {page_bytes}",
                    tier.kind(),
                    tier.bytes_per_block()
                ))
                .with("tier", tier.kind()));
            }
            let pool = BlockPool::with_policy(tier.kind(), tier.num_blocks(), options.eviction)?;
            if tier.kind() == TierKind::Disk && !disk_index.is_empty() {
                pool.adopt(&disk_index);
            }
            levels.push(Level { tier, pool });
        }
        if let Some(remote) = &tiers.remote {
            let bytes = remote.scope().bytes_per_block;
            if bytes != page_bytes || remote.scope().world_size != 1 {
                return Err(Error::invalid_argument(format!(
                    "the remote store's values are {bytes} bytes over {} ranks but a page is \
                     {page_bytes} bytes of one rank",
                    remote.scope().world_size
                ))
                .with("tier", TierKind::Remote));
            }
        }
        if levels.is_empty() && tiers.remote.is_none() {
            return Err(Error::invalid_config(
                "host.cache_gb / disk.cache_gb / remote.url",
                "unset",
                "a page store needs a host tier, a disk tier or a remote store",
            ));
        }
        let disk_pages = levels
            .iter()
            .filter(|l| l.tier.kind() == TierKind::Disk)
            .map(|l| l.tier.num_blocks())
            .sum::<usize>();
        let filter = FrequencyFilter::new(
            options
                .disk_min_frequency
                .min(options.remote_min_frequency)
                .max(1),
            disk_pages.saturating_mul(4).max(1024),
        )?;
        Ok(Self {
            namespace: namespace.into(),
            page_bytes,
            levels,
            remote: tiers.remote.map(|store| Remote {
                store,
                health: StoreHealth::new(options.slow, options.backoff),
            }),
            filter: parking_lot::Mutex::new(filter),
            options,
            counters: Counters::default(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }

    /// Saves the index of every persisted tier now (see [`crate::tier::Persistent`]): the pages
    /// they hold are found again by the next process that opens them. (A persisted tier also
    /// saves on its own within its bound of a change, and when it is closed.)
    pub fn flush(&self) -> Result<()> {
        for level in &self.levels {
            if let Some(p) = level.tier.persistent() {
                p.flush().map_err(|e| e.with("tier", level.tier.kind()))?;
            }
        }
        Ok(())
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// The namespace pages are named in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The tiers that hold pages, in the order a read tries them.
    pub fn tiers(&self) -> Vec<TierKind> {
        let mut v: Vec<TierKind> = self.levels.iter().map(|l| l.tier.kind()).collect();
        if self.remote.is_some() {
            v.push(TierKind::Remote);
        }
        v
    }

    /// The block key of the engine's page key `name` in this store's namespace: the first 16
    /// bytes (little-endian) of SHA-256 over the length-prefixed namespace and name, so no
    /// choice of names makes two namespaces' keys meet.
    pub fn key(&self, name: &[u8]) -> SequenceHash {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"kvbm-page-v1");
        for part in [self.namespace.as_bytes(), name] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let d = h.finalize();
        let mut b = [0u8; 16];
        b.copy_from_slice(&d[..16]);
        SequenceHash(u128::from_le_bytes(b))
    }

    fn check_call(&self, op: &'static str, keys: usize, pages: &[usize]) -> Result<()> {
        if keys > MAX_PAGES_PER_CALL {
            return Err(Error::invalid_argument(format!(
                "{keys} pages in one call; at most {MAX_PAGES_PER_CALL}"
            ))
            .with("op", op));
        }
        if pages.len() != keys {
            return Err(
                Error::invalid_argument(format!("{keys} keys but {} pages", pages.len()))
                    .with("op", op),
            );
        }
        if let Some((i, len)) = pages
            .iter()
            .enumerate()
            .find(|(_, &len)| len != self.page_bytes)
        {
            return Err(Error::invalid_argument(format!(
                "page {i} is {len} bytes but this store's pages are {}",
                self.page_bytes
            ))
            .with("op", op)
            .with("page", i));
        }
        Ok(())
    }

    /// Threads for `pages` pages of one call: at most `io_threads`, the machine's cores, the
    /// pages, and one per [`PARALLEL_MIN_BYTES`] of them; at least 1.
    fn io_workers(&self, pages: usize) -> usize {
        let by_bytes = pages.saturating_mul(self.page_bytes) / PARALLEL_MIN_BYTES;
        self.options
            .io_threads
            .min(self.cores)
            .min(pages)
            .min(by_bytes)
            .max(1)
    }

    /// Stores each page under its key in every level that does not hold it yet. `pages[i]` is
    /// the page of `keys[i]` as segments adding up to the page size. Returns, per page, whether
    /// some level holds it now.
    ///
    /// Errors (nothing stored): more than [`MAX_PAGES_PER_CALL`] pages, a page of the wrong
    /// size, or a different number of keys and pages (invalid argument).
    pub fn put(&self, keys: &[SequenceHash], pages: &[Vec<IoSlice<'_>>]) -> Result<Vec<bool>> {
        let lens: Vec<usize> = pages
            .iter()
            .map(|p| p.iter().map(|s| s.len()).sum())
            .collect();
        self.check_call("put", keys.len(), &lens)?;
        bump(&self.counters.put_pages, keys.len());
        let seen: Vec<u32> = {
            let mut f = self.filter.lock();
            keys.iter().map(|k| f.record(*k)).collect()
        };
        let mut held = vec![false; keys.len()];
        for level in &self.levels {
            let admit: Vec<bool> = if level.tier.kind() == TierKind::Disk {
                seen.iter()
                    .map(|&n| n >= self.options.disk_min_frequency)
                    .collect()
            } else {
                vec![true; keys.len()]
            };
            let refused = admit.iter().filter(|a| !**a).count();
            bump(&self.counters.disk_not_admitted, refused);
            self.put_level(level, keys, pages, &admit, &mut held);
        }
        if let Some(remote) = &self.remote {
            let admit: Vec<usize> = (0..keys.len())
                .filter(|&i| seen[i] >= self.options.remote_min_frequency)
                .collect();
            self.put_remote(remote, keys, pages, &admit, &mut held);
        }
        bump(
            &self.counters.put_stored,
            held.iter().filter(|h| **h).count(),
        );
        Ok(held)
    }

    fn put_level(
        &self,
        level: &Level,
        keys: &[SequenceHash],
        pages: &[Vec<IoSlice<'_>>],
        admit: &[bool],
        held: &mut [bool],
    ) {
        // Pages the level holds already count as held; the others (first occurrence of a key,
        // admitted) are written into blocks taken (evicting) from its pool.
        let mut todo: Vec<usize> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if level.pool.contains(*key) {
                held[i] = true;
            } else if admit[i] && !keys[..i].contains(key) {
                todo.push(i);
            }
        }
        let blocks = level.pool.allocate_up_to(todo.len());
        let persistent = level.tier.persistent();
        if let Some(p) = persistent {
            // Withdrawn from the index on disk in one sync, before any of them is rewritten.
            let ids: Vec<usize> = blocks.iter().map(|b| b.block_id()).collect();
            if let Err(e) = p.prepare_rewrite(&ids) {
                tracing::warn!(tier = %level.tier.kind(), error = %e,
                    "page store: pages not written (the persisted index could not withdraw their blocks)");
                return;
            }
        }
        // (block, page, the block's checksum right after the write: None until it succeeds)
        let mut jobs: Vec<_> = blocks
            .into_iter()
            .zip(&todo)
            .map(|(block, &i)| (block, i, None::<Option<u64>>))
            .collect();
        let workers = self.io_workers(jobs.len());
        for_each_shared(&mut jobs, workers, |(block, i, ok)| {
            match level.tier.write_block(block.block_id(), &pages[*i]) {
                // Taken while the block is still ours: it describes this write.
                Ok(()) => *ok = Some(persistent.and_then(|p| p.checksum(block.block_id()))),
                Err(e) => tracing::warn!(
                    tier = %level.tier.kind(), error = %e, "page store: a page write failed"
                ),
            }
        });
        // A block whose write failed goes back to the free list when dropped here.
        let mut bind = Vec::new();
        let written: Vec<_> = jobs
            .into_iter()
            .filter_map(|(block, i, ok)| {
                let checksum = ok?;
                if let Some(c) = checksum {
                    bind.push((block.block_id(), keys[i].0, c));
                }
                Some((block, keys[i]))
            })
            .collect();
        let (_, errors) = level.pool.register_all(written);
        for e in errors {
            tracing::warn!(tier = %level.tier.kind(), error = %e, "page store: a page was not registered");
        }
        if let Some(p) = persistent {
            // A block registered and evicted again meanwhile was rewritten: its entry is
            // dropped by the tier (the checksum no longer matches). One whose registration
            // failed holds nothing the pool knows: not bound.
            bind.retain(|&(b, k, _)| level.pool.holds(SequenceHash(k), b));
            p.bind(&bind);
        }
        // A key is held wherever a copy of it is (duplicates within the call included).
        for (i, key) in keys.iter().enumerate() {
            if !held[i] && level.pool.contains(*key) {
                held[i] = true;
            }
        }
    }

    fn put_remote(
        &self,
        remote: &Remote,
        keys: &[SequenceHash],
        pages: &[Vec<IoSlice<'_>>],
        admit: &[usize],
        held: &mut [bool],
    ) {
        if admit.is_empty() {
            return;
        }
        let bufs: Vec<Vec<u8>> = admit
            .iter()
            .map(|&i| {
                let mut b = Vec::with_capacity(self.page_bytes);
                pages[i].iter().for_each(|s| b.extend_from_slice(s));
                b
            })
            .collect();
        let blocks: Vec<(u128, &[u8])> = admit
            .iter()
            .zip(&bufs)
            .map(|(&i, b)| (keys[i].0, b.as_slice()))
            .collect();
        let deadline = Instant::now() + self.options.io_timeout;
        match remote.call(CallKind::Write, |r| r.put(0, &blocks, deadline)) {
            Some(Ok(_)) => admit.iter().for_each(|&i| held[i] = true),
            Some(Err(e)) => {
                bump(&self.counters.remote_errors, 1);
                tracing::debug!(store = %remote.store.describe(), error = %e, "page store: remote write dropped");
            }
            None => bump(&self.counters.remote_skipped, 1),
        }
    }

    /// Reads each page of `keys` into its destination (`pages[i]`: segments adding up to the
    /// page size), from the first level that holds a verified copy. Returns, per page, the tier
    /// that served it, or `None` (a miss: its destination bytes must not be used).
    ///
    /// Errors (nothing read): as [`PageStore::put`].
    pub fn get(
        &self,
        keys: &[SequenceHash],
        pages: &mut [Vec<IoSliceMut<'_>>],
    ) -> Result<Vec<Option<TierKind>>> {
        let lens: Vec<usize> = pages
            .iter()
            .map(|p| p.iter().map(|s| s.len()).sum())
            .collect();
        self.check_call("get", keys.len(), &lens)?;
        bump(&self.counters.get_pages, keys.len());
        // Each page from the first local level that holds a verified copy, several pages at
        // once: a read is a copy and a checksum pass, which one thread cannot overlap.
        // Only pages some level holds become jobs (the threads are for reads, not misses).
        let mut jobs: Vec<(usize, &mut Vec<IoSliceMut<'_>>, Option<TierKind>)> = pages
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| self.levels.iter().any(|l| l.pool.contains(keys[*i])))
            .map(|(i, p)| (i, p, None))
            .collect();
        let workers = self.io_workers(jobs.len());
        for_each_shared(&mut jobs, workers, |(i, page, served)| {
            for level in &self.levels {
                if self.read_level(level, keys[*i], page) {
                    *served = Some(level.tier.kind());
                    break;
                }
            }
        });
        let mut served: Vec<Option<TierKind>> = vec![None; keys.len()];
        for (i, _, tier) in jobs {
            served[i] = tier;
        }
        if let Some(remote) = &self.remote {
            self.get_remote(remote, keys, pages, &mut served);
        }
        for s in &served {
            match s {
                Some(TierKind::Host) => bump(&self.counters.host_hits, 1),
                Some(TierKind::Disk) => bump(&self.counters.disk_hits, 1),
                Some(_) => bump(&self.counters.remote_hits, 1),
                None => bump(&self.counters.misses, 1),
            }
        }
        Ok(served)
    }

    /// One page from one level: held while it is read; a copy that fails verification (or that
    /// the tier no longer has) is withdrawn.
    fn read_level(&self, level: &Level, key: SequenceHash, dst: &mut [IoSliceMut<'_>]) -> bool {
        let Some(block) = level.pool.match_prefix(&[key]).pop() else {
            return false;
        };
        match level.tier.read_block(block.block_id(), dst) {
            Ok(()) => true,
            Err(e) => {
                if e.kind() == ErrorKind::Corrupt {
                    bump(&self.counters.corrupt, 1);
                }
                tracing::warn!(tier = %level.tier.kind(), block = block.block_id(), error = %e,
                    "page store: a stored page was not served and is withdrawn");
                if let Some(p) = level.tier.persistent() {
                    p.unbind(&[block.block_id()]);
                }
                level.pool.unregister(&block);
                false
            }
        }
    }

    fn get_remote(
        &self,
        remote: &Remote,
        keys: &[SequenceHash],
        pages: &mut [Vec<IoSliceMut<'_>>],
        served: &mut [Option<TierKind>],
    ) {
        let missing: Vec<usize> = (0..keys.len()).filter(|&i| served[i].is_none()).collect();
        if missing.is_empty() {
            return;
        }
        let ks: Vec<u128> = missing.iter().map(|&i| keys[i].0).collect();
        let mut bufs: Vec<Vec<u8>> = missing.iter().map(|_| vec![0u8; self.page_bytes]).collect();
        let outcomes = {
            let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let deadline = Instant::now() + self.options.io_timeout;
            remote.call(CallKind::Load, |r| r.get(0, &ks, &mut dst, deadline))
        };
        let outcomes = match outcomes {
            Some(Ok(o)) if o.len() == missing.len() => o,
            Some(_) => {
                bump(&self.counters.remote_errors, 1);
                return;
            }
            None => {
                bump(&self.counters.remote_skipped, 1);
                return;
            }
        };
        for ((&i, outcome), buf) in missing.iter().zip(outcomes).zip(&bufs) {
            match outcome {
                RemoteRead::Hit => {
                    crate::tier::copy_segments(&[IoSlice::new(buf)], &mut pages[i]);
                    served[i] = Some(TierKind::Remote);
                }
                RemoteRead::Missing => {}
                RemoteRead::Invalid(why) => {
                    bump(&self.counters.remote_invalid, 1);
                    tracing::warn!(store = %remote.store.describe(), %why, "page store: remote page not served");
                }
            }
        }
    }

    /// How many of `keys`, from the first, some level holds (SGLang's `batch_exists`). The
    /// remote store is asked only for what the local levels lack, within its lookup deadline;
    /// a store that does not answer in time counts as holding nothing.
    pub fn prefix_len(&self, keys: &[SequenceHash]) -> Result<usize> {
        if keys.len() > MAX_PAGES_PER_CALL {
            return Err(Error::invalid_argument(format!(
                "{} pages in one call; at most {MAX_PAGES_PER_CALL}",
                keys.len()
            ))
            .with("op", "exists"));
        }
        {
            // A lookup is demand: it counts toward the pages' admission.
            let mut f = self.filter.lock();
            keys.iter().for_each(|k| {
                f.record(*k);
            });
        }
        let local = |k: &SequenceHash| self.levels.iter().any(|l| l.pool.contains(*k));
        let mut n = keys.iter().take_while(|k| local(k)).count();
        if let Some(remote) = &self.remote {
            let deadline = Instant::now() + self.options.lookup_timeout;
            while n < keys.len() {
                let rest: Vec<u128> = keys[n..].iter().map(|k| k.0).collect();
                match remote.call(CallKind::Lookup, |r| r.lookup_prefix(&rest, deadline)) {
                    Some(Ok(0)) => break,
                    Some(Ok(r)) => n += r.min(rest.len()),
                    Some(Err(_)) => {
                        bump(&self.counters.remote_errors, 1);
                        break;
                    }
                    None => {
                        bump(&self.counters.remote_skipped, 1);
                        break;
                    }
                }
                n += keys[n..].iter().take_while(|k| local(k)).count();
            }
        }
        Ok(n)
    }

    /// Forgets every page of the local levels (their blocks are reused); pages being read finish
    /// first. A persisted tier's index is emptied on disk before this returns, so no page
    /// stored before the clear comes back after a crash or restart. The shared store is not
    /// cleared: other instances use it.
    ///
    /// Errors: a persisted tier's empty index could not be written ([`ErrorKind::Io`]); its
    /// pages are forgotten in this process all the same, and the index is saved again later.
    pub fn clear(&self) -> Result<()> {
        let mut first = None;
        for level in &self.levels {
            for (key, _) in level.pool.registered() {
                if let Some(block) = level.pool.match_prefix(&[key]).pop() {
                    level.pool.unregister(&block);
                }
            }
            if let Some(p) = level.tier.persistent() {
                if let Err(e) = p.clear() {
                    first.get_or_insert(e.with("tier", level.tier.kind()));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Its counters.
    pub fn stats(&self) -> PageStoreStats {
        let c = &self.counters;
        let held = |kind| {
            self.levels
                .iter()
                .filter(|l| l.tier.kind() == kind)
                .map(|l| l.pool.stats().registered as u64)
                .sum()
        };
        PageStoreStats {
            put_pages: c.put_pages.load(Ordering::Relaxed),
            put_stored: c.put_stored.load(Ordering::Relaxed),
            get_pages: c.get_pages.load(Ordering::Relaxed),
            host_hits: c.host_hits.load(Ordering::Relaxed),
            disk_hits: c.disk_hits.load(Ordering::Relaxed),
            remote_hits: c.remote_hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            remote_invalid: c.remote_invalid.load(Ordering::Relaxed),
            remote_errors: c.remote_errors.load(Ordering::Relaxed),
            remote_skipped: c.remote_skipped.load(Ordering::Relaxed),
            disk_not_admitted: c.disk_not_admitted.load(Ordering::Relaxed),
            remote_state: self.remote.as_ref().map(|r| r.health.state()),
            host_pages: held(TierKind::Host),
            disk_pages: held(TierKind::Disk),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::for_each_shared;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn each_item_is_worked_on_exactly_once_at_any_thread_count() {
        for workers in [0, 1, 2, 3, 8, 100] {
            for n in [0, 1, 2, 7, 64] {
                let mut items: Vec<(usize, usize)> = (0..n).map(|i| (i, 0)).collect();
                let calls = AtomicUsize::new(0);
                for_each_shared(&mut items, workers, |(i, seen)| {
                    *seen += 1 + *i;
                    calls.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(calls.load(Ordering::Relaxed), n, "workers {workers}, n {n}");
                assert!(items.iter().all(|&(i, seen)| seen == i + 1));
            }
        }
    }

    /// Two items are in flight at once: the first waits for a message the second sends, which
    /// only another thread can do while the first waits (one thread would wait out the minute).
    #[test]
    fn items_are_worked_on_by_more_than_one_thread() {
        let (tx, rx) = mpsc::channel::<()>();
        let tx = std::sync::Mutex::new(tx);
        let rx = std::sync::Mutex::new(rx);
        let mut items = vec![0u8, 1u8];
        let got = AtomicUsize::new(0);
        for_each_shared(&mut items, 2, |item| {
            if *item == 0 {
                if let Ok(rx) = rx.lock() {
                    if rx.recv_timeout(Duration::from_secs(60)).is_ok() {
                        got.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if let Ok(tx) = tx.lock() {
                let _ = tx.send(());
            }
        });
        assert_eq!(
            got.load(Ordering::Relaxed),
            1,
            "the items ran one after the other"
        );
    }
}
