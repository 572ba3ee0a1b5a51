//! What a stop, a crash and a clear leave behind in a persisted disk tier (`disk.persist`): each
//! scenario runs in a child process (this test binary run again with `KVBM_DURABILITY_CHILD`
//! naming it), which stores pages, says `READY` on stdout and waits; the test then ends it the
//! way an operator or the kernel would (SIGTERM, SIGHUP, SIGKILL) and reopens the directory in
//! this process, where every page announced must read back byte for byte.
//!
//! Each would fail without its part of the fix: an index saved only by a later put or a clean
//! exit (SIGTERM/SIGHUP/idle-then-SIGKILL serve 0), a clear that is not on disk (the cleared
//! pages come back), an index that keeps entries for slots rewritten after its save (announced,
//! then corrupt on read), an entry whose checksum does not bind its key (another key's bytes).

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::persist;
use kvbm_connector::backends::standard::page_store;
use kvbm_connector::page_store::PageStore;
use kvbm_connector::tier::StorageTierExt;
use kvbm_connector::{ErrorKind, LayoutDims, SequenceHash, StorageTier, TierKind};

const CHILD: &str = "KVBM_DURABILITY_CHILD";
const DIR: &str = "KVBM_DURABILITY_DIR";
const PAGE: usize = 6000;
const NS: &str = "model-a;tp0/1";

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 1,
        outer_dim: 1,
        page_size: 1,
        inner_dim: PAGE,
        dtype_bytes: 1,
    }
}

fn page(seed: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

fn names(n: usize, prefix: &str) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn config(dir: &Path, pages: usize) -> kvbm_connector::Config {
    let mut c = kvbm_connector::Config::default();
    c.host.cache_blocks = Some(0);
    c.disk.cache_blocks = Some(pages);
    c.disk.dir = dir.to_path_buf();
    c.disk.persist = true;
    c
}

fn store(dir: &Path, pages: usize) -> PageStore {
    page_store(&config(dir, pages), NS, PAGE).unwrap()
}

fn put(store: &PageStore, names: &[String], seed0: u64) {
    let pages: Vec<Vec<u8>> = (0..names.len()).map(|i| page(seed0 + i as u64)).collect();
    let segs: Vec<Vec<IoSlice<'_>>> = pages.iter().map(|p| vec![IoSlice::new(p)]).collect();
    let keys: Vec<SequenceHash> = names.iter().map(|n| store.key(n.as_bytes())).collect();
    assert!(store.put(&keys, &segs).unwrap().iter().all(|h| *h));
}

/// How many of `names` the store serves, each checked byte for byte against its seed.
fn served(store: &PageStore, names: &[String], seed0: u64) -> usize {
    let keys: Vec<SequenceHash> = names.iter().map(|n| store.key(n.as_bytes())).collect();
    let mut bufs: Vec<Vec<u8>> = names.iter().map(|_| vec![0u8; PAGE]).collect();
    let got = {
        let mut segs: Vec<Vec<IoSliceMut<'_>>> =
            bufs.iter_mut().map(|b| vec![IoSliceMut::new(b)]).collect();
        store.get(&keys, &mut segs).unwrap()
    };
    let mut n = 0;
    for (i, tier) in got.iter().enumerate() {
        if tier.is_some() {
            assert_eq!(bufs[i], page(seed0 + i as u64), "page {i}: wrong bytes");
            n += 1;
        }
    }
    n
}

/// The persisted data files in `dir`.
fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".persist.blocks"))
        .collect();
    v.sort();
    v
}

/// The child's side: runs `scenario` in `dir`, says READY, then waits to be ended.
fn child_main(scenario: &str, dir: &Path) {
    match scenario {
        // 100 pages stored; the index is not saved by anything but the tier itself.
        "store100" => {
            let s = store(dir, 128);
            put(&s, &names(100, "p"), 0);
            ready_and_wait(s);
        }
        // 100 blocks written and bound with the timed save out of reach: only a signal saves.
        "store100_no_timer" => {
            let opts = DiskTierOptions::new(dir).with_index_save_within(Duration::from_secs(3600));
            let (tier, _) =
                DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
            bind_written(&tier, 0..100, 0);
            ready_and_wait(tier);
        }
        // 50 pages stored and saved, then cleared.
        "clear50" => {
            let s = store(dir, 128);
            put(&s, &names(50, "c"), 0);
            s.flush().unwrap();
            s.clear().unwrap();
            ready_and_wait(s);
        }
        // 100 blocks written, bound and saved; then 60 rewritten (other bytes, no key yet: a
        // store in flight) with no save after it.
        "rewrite60" => {
            let opts = DiskTierOptions::new(dir).with_index_save_within(Duration::from_secs(3600));
            let (tier, _) =
                DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
            bind_written(&tier, 0..100, 0);
            tier.persistent().unwrap().flush().unwrap();
            for b in 0..60 {
                tier.write_block_from_slice(b, &page(1000 + b as u64))
                    .unwrap();
            }
            ready_and_wait(tier);
        }
        // A worker's tier with the deployment's reset marker: 10 blocks bound and saved.
        "worker10" => {
            let opts = DiskTierOptions::new(dir)
                .with_index_save_within(Duration::from_secs(3600))
                .with_reset_marker(reset_marker(dir));
            let (tier, _) =
                DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
            bind_written(&tier, 0..10, 0);
            tier.persistent().unwrap().flush().unwrap();
            ready_and_wait(tier);
        }
        // A persisted tier opened (the signal handlers installed), then a fork: the forked child
        // gets SIGTERM and must end by it, and this process must live on.
        "fork" => {
            let opts = DiskTierOptions::new(dir);
            let (_tier, _) =
                DiskTier::open_persistent(TierKind::Disk, dims(), 8, opts, NS).unwrap();
            // SAFETY: the forked child only sleeps and exits (async-signal-safe calls).
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                unsafe {
                    libc::sleep(60);
                    libc::_exit(0);
                }
            }
            assert!(pid > 0);
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let mut status = 0;
            let mut ended = None;
            for _ in 0..2000 {
                // SAFETY: waitpid on our own child with a valid status pointer.
                if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                    ended = Some(status);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if ended.is_none() {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let how = match ended {
                Some(st) if libc::WIFSIGNALED(st) => format!("signal {}", libc::WTERMSIG(st)),
                Some(st) => format!("exit {}", libc::WEXITSTATUS(st)),
                None => "still running".into(),
            };
            // Time for a (wrong) signal byte from the child to reach this process's reader.
            std::thread::sleep(Duration::from_millis(500));
            println!("CHILD {how}");
            ready_and_wait(());
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// Writes blocks `range` (block b gets `page(seed0 + b)`) and binds each to key `b + 1`.
fn bind_written(tier: &DiskTier, range: std::ops::Range<usize>, seed0: u64) {
    let p = tier.persistent().unwrap();
    for b in range {
        tier.write_block_from_slice(b, &page(seed0 + b as u64))
            .unwrap();
        let c = p.checksum(b).unwrap();
        p.bind(&[(b, b as u128 + 1, c)]);
    }
}

fn ready_and_wait<T>(keep: T) {
    println!("READY");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
    drop(keep);
}

/// Starts the child for `scenario` in `dir` and waits for its READY.
fn spawn(scenario: &str, dir: &Path, test: &str) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, scenario)
        .env(DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.trim_end().ends_with("READY") => break,
            Some(Ok(_)) => continue,
            other => {
                let _ = child.kill();
                panic!("the child for {scenario} ended before READY: {other:?}");
            }
        }
    }
    child
}

/// Ends `child` with `signal` and returns the signal that ended it.
fn end_with(mut child: Child, signal: libc::c_int) -> Option<i32> {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
    use std::os::unix::process::ExitStatusExt;
    child.wait().unwrap().signal()
}

/// Runs the child side when this process is one; true then (the test returns at once).
fn as_child() -> bool {
    match (std::env::var(CHILD), std::env::var_os(DIR)) {
        (Ok(scenario), Some(dir)) => {
            child_main(&scenario, Path::new(&dir));
            true
        }
        _ => false,
    }
}

/// Item 1: SIGTERM (systemd, Kubernetes) and SIGHUP leave their default action to a process
/// like a plain Python one: the tier saves its index first and the process still ends by
/// that signal. The timed save is out of reach (an hour), so only the signal can have saved.
#[test]
fn sigterm_and_sighup_save_the_index_and_still_end_the_process() {
    if as_child() {
        return;
    }
    for signal in [libc::SIGTERM, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        let child = spawn(
            "store100_no_timer",
            dir.path(),
            "sigterm_and_sighup_save_the_index_and_still_end_the_process",
        );
        assert_eq!(end_with(child, signal), Some(signal), "ended by the signal");
        let opts = DiskTierOptions::new(dir.path());
        let (tier, index) =
            DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
        assert_eq!(index.len(), 100, "signal {signal}: every block announced");
        for (b, key) in index {
            assert_eq!(key, b as u128 + 1);
            assert_eq!(tier.read_block_to_vec(b).unwrap(), page(b as u64));
        }
    }
}

/// Item 1: an index changed and then left idle is saved within the tier's bound with no
/// further write: a SIGKILL after that keeps every page. (The wait is for the save to appear,
/// at most a minute against a 2-second bound; it is not a measurement.)
#[test]
fn an_idle_index_is_saved_without_more_writes_so_a_sigkill_keeps_the_pages() {
    if as_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let child = spawn(
        "store100",
        dir.path(),
        "an_idle_index_is_saved_without_more_writes_so_a_sigkill_keeps_the_pages",
    );
    let file = data_files(dir.path()).pop().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let saved = persist::load(&file, 128).map_or(0, |(_, e)| e.len());
        if saved == 100 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the index was never saved with the 100 pages ({saved} after a minute idle)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(end_with(child, libc::SIGKILL), Some(libc::SIGKILL));
    let s = store(dir.path(), 128);
    assert_eq!(served(&s, &names(100, "p"), 0), 100);
}

/// Item 2: a clear is on disk before it returns: killed right after it, nothing cleared comes
/// back (KV computed under old weights must never be served again).
#[test]
fn a_clear_survives_a_sigkill() {
    if as_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let child = spawn("clear50", dir.path(), "a_clear_survives_a_sigkill");
    assert_eq!(end_with(child, libc::SIGKILL), Some(libc::SIGKILL));
    let s = store(dir.path(), 128);
    assert_eq!(served(&s, &names(50, "c"), 0), 0, "cleared pages came back");
    assert_eq!(s.prefix_len(&[s.key(b"c0")]).unwrap(), 0);
}

/// Item 3: slots rewritten after the last save, then SIGKILL: the reopened index announces
/// exactly the 40 untouched blocks, and each of them reads back.
#[test]
fn after_a_sigkill_the_index_announces_only_blocks_that_read_back() {
    if as_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let child = spawn(
        "rewrite60",
        dir.path(),
        "after_a_sigkill_the_index_announces_only_blocks_that_read_back",
    );
    assert_eq!(end_with(child, libc::SIGKILL), Some(libc::SIGKILL));
    let opts = DiskTierOptions::new(dir.path());
    let (tier, mut index) =
        DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
    index.sort();
    let want: Vec<(usize, u128)> = (60..100).map(|b| (b, b as u128 + 1)).collect();
    assert_eq!(index, want, "announced: only the blocks not rewritten");
    for (b, _) in index {
        assert_eq!(tier.read_block_to_vec(b).unwrap(), page(b as u64));
    }
    // The journal is compacted by the next save: the reopened tier's first save keeps only
    // records of its own generation (none yet).
    tier.persistent().unwrap().flush().unwrap();
    let journal = persist::journal_path(tier.path());
    assert_eq!(std::fs::metadata(journal).unwrap().len(), 0);
}

/// Item 4: an index that pairs each key with the other key's slot and checksum (the entries'
/// key fields swapped by hand, the file's own checksum fixed up) serves neither: each entry's
/// checksum is sealed with its key.
#[test]
fn an_entry_pairing_a_key_with_another_keys_slot_and_checksum_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let opts = DiskTierOptions::new(dir.path());
    let path = {
        let (tier, _) =
            DiskTier::open_persistent(TierKind::Disk, dims(), 2, opts.clone(), NS).unwrap();
        bind_written(&tier, 0..2, 0);
        tier.path().to_owned()
    };
    let ip = persist::index_path(&path);
    let mut bytes = std::fs::read(&ip).unwrap();
    // Layout: magic 8 | u32 header length | header | u64 count | entries of 32 | u64 sum.
    let head = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let first = 12 + head + 8;
    let key_a = bytes[first + 8..first + 24].to_vec();
    let key_b = bytes[first + 40..first + 56].to_vec();
    assert_ne!(key_a, key_b);
    bytes[first + 8..first + 24].copy_from_slice(&key_b);
    bytes[first + 40..first + 56].copy_from_slice(&key_a);
    let n = bytes.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..n]);
    bytes[n..].copy_from_slice(&sum.to_le_bytes());
    std::fs::write(&ip, &bytes).unwrap();

    let (tier, mut index) = DiskTier::open_persistent(TierKind::Disk, dims(), 2, opts, NS).unwrap();
    index.sort();
    assert_eq!(index, vec![(0, 2), (1, 1)], "the swapped pairs are read");
    for b in 0..2 {
        let err = tier.read_block_to_vec(b).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "block {b}: {err}");
    }
}

fn worker_config(dir: &Path) -> kvbm_connector::Config {
    let mut c = config(dir, 128);
    c.remote.namespace = Some("model-a".into());
    c
}

fn reset_marker(dir: &Path) -> PathBuf {
    kvbm_connector::backends::standard::reset_marker_path(&worker_config(dir)).unwrap()
}

/// Item 2 for vLLM's `reset_cache`: the scheduler side records the reset on disk before it
/// returns (`record_cache_reset`, what the vLLM binding's `clear_tiers` calls). A worker killed
/// right after it, before it learnt of the reset, serves none of its blocks when reopened; a
/// worker still running forgets them at its next save.
#[test]
fn a_cache_reset_is_on_disk_before_it_returns_for_the_workers_tiers() {
    use kvbm_connector::backends::standard::record_cache_reset;
    if as_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let child = spawn(
        "worker10",
        dir.path(),
        "a_cache_reset_is_on_disk_before_it_returns_for_the_workers_tiers",
    );
    assert_eq!(record_cache_reset(&reset_marker(dir.path())).unwrap(), 1);
    assert_eq!(end_with(child, libc::SIGKILL), Some(libc::SIGKILL));
    let opts = DiskTierOptions::new(dir.path()).with_reset_marker(reset_marker(dir.path()));
    let (tier, index) =
        DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts.clone(), NS).unwrap();
    assert!(
        index.is_empty(),
        "blocks from before the reset announced: {index:?}"
    );

    // A running worker: blocks bound after the reset survive; a second reset forgets them at
    // the next save (here the tier's close).
    bind_written(&tier, 0..5, 0);
    tier.persistent().unwrap().flush().unwrap();
    drop(tier);
    let (tier, index) =
        DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts.clone(), NS).unwrap();
    assert_eq!(index.len(), 5, "stored after the reset: kept");
    assert_eq!(record_cache_reset(&reset_marker(dir.path())).unwrap(), 2);
    tier.persistent().unwrap().flush().unwrap();
    drop(tier);
    let (_, index) = DiskTier::open_persistent(TierKind::Disk, dims(), 128, opts, NS).unwrap();
    assert!(index.is_empty(), "{index:?}");
    // Without persistence there is no marker.
    let mut plain = worker_config(dir.path());
    plain.disk.persist = false;
    assert_eq!(
        kvbm_connector::backends::standard::reset_marker_path(&plain),
        None
    );
}

/// A process that forked after a persisted tier installed its signal handlers: SIGTERM to the
/// forked child ends the child by SIGTERM (the handler is not the child's to run: it has no
/// thread reading the pipe), and never reaches this process (which would save and end).
#[test]
fn sigterm_to_a_forked_child_ends_the_child_not_its_parent() {
    if as_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "sigterm_to_a_forked_child_ends_the_child_not_its_parent",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "fork")
        .env(DIR, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut how = None;
    let mut ready = false;
    for line in out.lines().map_while(|l| l.ok()) {
        if let Some(rest) = line.split("CHILD ").nth(1) {
            how = Some(rest.trim().to_string());
        }
        if line.trim_end().ends_with("READY") {
            ready = true;
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(how.as_deref(), Some(&*format!("signal {}", libc::SIGTERM)));
    assert!(
        ready,
        "the parent did not live on after its child's SIGTERM"
    );
}

/// A record torn by a crash while it was appended is cut when the tier reopens, so the records
/// appended after it stay readable (and withdraw what they name).
#[test]
fn a_torn_journal_record_is_cut_and_later_records_still_withdraw() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let opts = DiskTierOptions::new(dir.path()).with_index_save_within(Duration::from_secs(3600));
    let path = {
        let (tier, _) =
            DiskTier::open_persistent(TierKind::Disk, dims(), 4, opts.clone(), NS).unwrap();
        bind_written(&tier, 0..4, 0);
        tier.path().to_owned()
    };
    let jp = persist::journal_path(&path);
    std::fs::OpenOptions::new()
        .append(true)
        .open(&jp)
        .unwrap()
        .write_all(&[7u8; 7])
        .unwrap();
    let (tier, index) = DiskTier::open_persistent(TierKind::Disk, dims(), 4, opts, NS).unwrap();
    assert_eq!(index.len(), 4);
    assert_eq!(
        std::fs::metadata(&jp).unwrap().len() % persist::RECORD as u64,
        0
    );
    tier.write_block_from_slice(0, &page(99)).unwrap();
    // Read as the next process would (this one still holds the file).
    let (_, entries) = persist::load(&path, 4).expect("the journal reads");
    let mut slots: Vec<usize> = entries.iter().map(|e| e.slot).collect();
    slots.sort();
    assert_eq!(slots, vec![1, 2, 3], "block 0 withdrawn");
}

/// Schedulers of one deployment (data-parallel engines) record resets at once: none is lost.
#[test]
fn concurrent_cache_resets_are_all_counted() {
    use kvbm_connector::backends::standard::record_cache_reset;
    let dir = tempfile::tempdir().unwrap();
    let marker = reset_marker(dir.path());
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..10 {
                    record_cache_reset(&marker).unwrap();
                }
            });
        }
    });
    let n = persist::read_reset_marker(&reset_marker(dir.path())).unwrap();
    assert_eq!(n, 80);
}
