//! The page store (`kvbm_connector::page_store`, what SGLang's storage backend is built on) over
//! real tiers: the host memory tier, the disk tier in a temporary directory, and the in-process
//! remote store with its injectable faults. Every read's bytes are compared with what was put.

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::connector::remote::{MemoryRemoteStore, RemoteScope, RemoteStore};
use kvbm_connector::page_store::{PageStore, PageStoreOptions, PageStoreTiers, MAX_PAGES_PER_CALL};
use kvbm_connector::{
    ErrorKind, HashAlgorithm, Layout, LayoutDims, SequenceHash, StorageTier, TierKind,
};

const PAGE: usize = 6000; // not a multiple of 4096: the disk tier bounces and pads

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 1,
        outer_dim: 1,
        page_size: 1,
        inner_dim: PAGE,
        dtype_bytes: 1,
    }
}

fn options() -> PageStoreOptions {
    PageStoreOptions {
        lookup_timeout: Duration::from_millis(200),
        io_timeout: Duration::from_millis(500),
        ..Default::default()
    }
}

fn host(pages: usize) -> Arc<dyn StorageTier> {
    Arc::new(MemoryTier::host(Layout::fully_contiguous(dims(), pages).unwrap()).unwrap())
}

fn disk(dir: &std::path::Path, pages: usize) -> Arc<DiskTier> {
    Arc::new(DiskTier::create(TierKind::Disk, dims(), pages, DiskTierOptions::new(dir)).unwrap())
}

fn remote() -> MemoryRemoteStore {
    MemoryRemoteStore::new(RemoteScope::new("pages", 1, 1, PAGE, HashAlgorithm::Sha256).unwrap())
}

/// A page whose bytes name its seed at every position (two pages never agree on a byte run).
fn page(seed: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

fn keys(store: &PageStore, names: &[&str]) -> Vec<SequenceHash> {
    names.iter().map(|n| store.key(n.as_bytes())).collect()
}

fn put(store: &PageStore, names: &[&str], seeds: &[u64]) -> Vec<bool> {
    let pages: Vec<Vec<u8>> = seeds.iter().map(|&s| page(s)).collect();
    let segs: Vec<Vec<IoSlice<'_>>> = pages.iter().map(|p| vec![IoSlice::new(p)]).collect();
    store.put(&keys(store, names), &segs).unwrap()
}

/// Reads `names`; per page the tier and the bytes (zeros where missed).
fn get(store: &PageStore, names: &[&str]) -> Vec<(Option<TierKind>, Vec<u8>)> {
    let mut bufs: Vec<Vec<u8>> = names.iter().map(|_| vec![0u8; PAGE]).collect();
    let served = {
        let mut segs: Vec<Vec<IoSliceMut<'_>>> =
            bufs.iter_mut().map(|b| vec![IoSliceMut::new(b)]).collect();
        store.get(&keys(store, names), &mut segs).unwrap()
    };
    served.into_iter().zip(bufs).collect()
}

#[test]
fn pages_round_trip_through_host_and_disk_and_the_host_evicts_into_disk_copies() {
    let dir = tempfile::tempdir().unwrap();
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(4)),
            disk: Some(disk(dir.path(), 16)),
            remote: None,
            disk_index: vec![],
        },
        options(),
    )
    .unwrap();
    let names: Vec<String> = (0..10).map(|i| format!("page-{i}")).collect();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let seeds: Vec<u64> = (0..10).collect();
    assert_eq!(put(&store, &names, &seeds), vec![true; 10]);
    let stats = store.stats();
    assert_eq!((stats.host_pages, stats.disk_pages), (4, 10));
    let got = get(&store, &names);
    for (i, (tier, bytes)) in got.iter().enumerate() {
        assert!(tier.is_some(), "page {i} missed");
        assert_eq!(bytes, &page(i as u64), "page {i} bytes");
    }
    let from_host = got
        .iter()
        .filter(|(t, _)| *t == Some(TierKind::Host))
        .count();
    assert_eq!(
        from_host,
        4,
        "the host tier holds 4 pages: {got:?}",
        got = got.iter().map(|g| g.0).collect::<Vec<_>>()
    );
    // SGLang's batch_exists: the leading run present.
    let mut probe = keys(&store, &names[..3]);
    probe.push(store.key(b"absent"));
    probe.extend(keys(&store, &names[3..5]));
    assert_eq!(store.prefix_len(&probe).unwrap(), 3);
    // Putting what is held changes nothing and says held.
    assert_eq!(put(&store, &names[..2], &[0, 1]), vec![true, true]);
}

#[test]
fn a_page_in_segments_reads_back_into_other_segments() {
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(2)),
            ..Default::default()
        },
        options(),
    )
    .unwrap();
    let p = page(9);
    let src = vec![
        IoSlice::new(&p[..100]),
        IoSlice::new(&p[100..4000]),
        IoSlice::new(&p[4000..]),
    ];
    assert_eq!(store.put(&[store.key(b"k")], &[src]).unwrap(), vec![true]);
    let (mut a, mut b) = (vec![0u8; 3333], vec![0u8; PAGE - 3333]);
    let served = store
        .get(
            &[store.key(b"k")],
            &mut [vec![IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)]],
        )
        .unwrap();
    assert_eq!(served, vec![Some(TierKind::Host)]);
    assert_eq!([a, b].concat(), p);
}

#[test]
fn bad_calls_are_refused_by_name_and_store_nothing() {
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(4)),
            ..Default::default()
        },
        options(),
    )
    .unwrap();
    let ok = page(1);
    let short = vec![0u8; PAGE - 1];
    let err = store
        .put(
            &keys(&store, &["a", "b"]),
            &[vec![IoSlice::new(&ok)], vec![IoSlice::new(&short)]],
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_eq!(err.context_value("page"), Some("1"), "{err}");
    assert!(err.to_string().contains(&format!("{}", PAGE - 1)), "{err}");
    assert_eq!(
        store.prefix_len(&keys(&store, &["a"])).unwrap(),
        0,
        "nothing stored"
    );
    let err = store
        .put(&keys(&store, &["a", "b"]), &[vec![IoSlice::new(&ok)]])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let many = vec![SequenceHash(1); MAX_PAGES_PER_CALL + 1];
    assert_eq!(
        store.prefix_len(&many).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // A store with nothing to store into, and a tier of the wrong block size.
    let err = PageStore::new("ns", PAGE, PageStoreTiers::default(), options()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    let err = PageStore::new(
        "ns",
        PAGE + 1,
        PageStoreTiers {
            host: Some(host(2)),
            ..Default::default()
        },
        options(),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_eq!(err.context_value("tier"), Some("host"), "{err}");
}

#[test]
fn a_corrupt_disk_page_is_a_miss_never_wrong_bytes_and_is_withdrawn() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let d = disk(dir.path(), 4);
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            disk: Some(d.clone()),
            ..Default::default()
        },
        options(),
    )
    .unwrap();
    assert_eq!(put(&store, &["a", "b"], &[1, 2]), vec![true, true]);
    // Damage a few bytes in the middle of every slot.
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path())
            .unwrap();
        for slot in 0..4u64 {
            f.seek(SeekFrom::Start(slot * d.slot_bytes() as u64 + 1000))
                .unwrap();
            f.write_all(&[0xAB, 0xCD, 0xEF]).unwrap();
        }
        f.sync_all().unwrap();
    }
    let got = get(&store, &["a", "b"]);
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        vec![None, None]
    );
    assert_eq!(store.stats().corrupt, 2);
    assert_eq!(
        store.prefix_len(&keys(&store, &["a"])).unwrap(),
        0,
        "withdrawn"
    );
    // Stored again, it is served again.
    assert_eq!(put(&store, &["a"], &[1]), vec![true]);
    assert_eq!(get(&store, &["a"])[0], (Some(TierKind::Disk), page(1)));
}

#[test]
fn namespaces_never_share_a_page_and_the_remote_store_shares_within_one() {
    let shared = Arc::new(remote());
    let make = |ns: &str| {
        PageStore::new(
            ns,
            PAGE,
            PageStoreTiers {
                host: Some(host(2)),
                disk: None,
                remote: Some(shared.clone() as Arc<dyn RemoteStore>),
                ..Default::default()
            },
            options(),
        )
        .unwrap()
    };
    let a = make("model-x;tp0/2");
    let b = make("model-x;tp1/2");
    let a2 = make("model-x;tp0/2");
    assert_ne!(a.key(b"p"), b.key(b"p"));
    assert_eq!(a.key(b"p"), a2.key(b"p"));
    assert_eq!(put(&a, &["p", "q"], &[5, 6]), vec![true, true]);
    // The other shard: nothing, not even through the shared store.
    assert_eq!(b.prefix_len(&keys(&b, &["p"])).unwrap(), 0);
    assert_eq!(get(&b, &["p"])[0].0, None);
    // A second instance of the same shard: from the shared store, byte for byte.
    assert_eq!(a2.prefix_len(&keys(&a2, &["p", "q", "r"])).unwrap(), 2);
    let got = get(&a2, &["p", "q"]);
    assert_eq!(got[0], (Some(TierKind::Remote), page(5)));
    assert_eq!(got[1], (Some(TierKind::Remote), page(6)));
    assert_eq!(a2.stats().remote_hits, 2);
}

#[test]
fn a_failing_or_lying_remote_store_costs_its_own_hits_only() {
    let shared = Arc::new(remote());
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(2)),
            disk: None,
            remote: Some(shared.clone() as Arc<dyn RemoteStore>),
            disk_index: vec![],
        },
        options(),
    )
    .unwrap();
    // Down: writes still land locally, reads of what only the store had are misses.
    shared.faults.down.store(true, Ordering::SeqCst);
    assert_eq!(put(&store, &["a"], &[1]), vec![true]);
    assert_eq!(get(&store, &["a"])[0], (Some(TierKind::Host), page(1)));
    assert_eq!(get(&store, &["elsewhere"])[0].0, None);
    assert_eq!(
        store
            .prefix_len(&keys(&store, &["a", "elsewhere"]))
            .unwrap(),
        1
    );
    assert!(store.stats().remote_errors >= 2, "{:?}", store.stats());
    // Up again, but its values fail verification: never served.
    shared.faults.down.store(false, Ordering::SeqCst);
    assert_eq!(put(&store, &["b", "c", "d"], &[2, 3, 4]), vec![true; 3]);
    shared.faults.invalid.store(true, Ordering::SeqCst);
    let got = get(&store, &["b", "c", "d"]);
    // The host tier holds two pages; the third was only in the store.
    assert_eq!(
        got.iter().filter(|g| g.0.is_none()).count(),
        1,
        "{:?}",
        got.iter().map(|g| g.0).collect::<Vec<_>>()
    );
    for (i, (tier, bytes)) in got.iter().enumerate() {
        if tier.is_some() {
            assert_eq!(bytes, &page(2 + i as u64));
        }
    }
    assert_eq!(store.stats().remote_invalid, 1);
}

#[test]
fn clear_forgets_local_pages() {
    let dir = tempfile::tempdir().unwrap();
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(2)),
            disk: Some(disk(dir.path(), 4)),
            remote: None,
            disk_index: vec![],
        },
        options(),
    )
    .unwrap();
    put(&store, &["a", "b", "c"], &[1, 2, 3]);
    assert_eq!(
        store.prefix_len(&keys(&store, &["a", "b", "c"])).unwrap(),
        3
    );
    store.clear().unwrap();
    assert_eq!(store.prefix_len(&keys(&store, &["a"])).unwrap(), 0);
    assert_eq!((store.stats().host_pages, store.stats().disk_pages), (0, 0));
    assert_eq!(put(&store, &["a"], &[7]), vec![true]);
    assert_eq!(get(&store, &["a"])[0].1, page(7));
}

fn persisted_config(dir: &std::path::Path, pages: usize) -> kvbm_connector::Config {
    let mut c = kvbm_connector::Config::default();
    c.host.cache_blocks = Some(0);
    c.disk.cache_blocks = Some(pages);
    c.disk.dir = dir.to_path_buf();
    c.disk.persist = true;
    c
}

#[test]
fn a_persisted_disk_tier_survives_a_restart_and_refuses_another_shape() {
    use kvbm_connector::backends::standard::page_store;
    let dir = tempfile::tempdir().unwrap();
    let cfg = persisted_config(dir.path(), 8);
    {
        let first = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
        assert_eq!(first.tiers(), vec![TierKind::Disk]);
        assert_eq!(put(&first, &["a", "b", "c"], &[1, 2, 3]), vec![true; 3]);
        // A second process with the same namespace (here: a second store) cannot take the
        // file while it is held: it takes the namespace's next file, empty.
        let second = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
        assert_eq!(second.prefix_len(&keys(&second, &["a"])).unwrap(), 0);
        assert_eq!(put(&second, &["z"], &[26]), vec![true]);
    } // dropped: the indexes are saved
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".persist.blocks"))
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    // Reopened while both are free: the first store takes the first file, the second the next.
    let again = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
    {
        let second = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
        assert_eq!(get(&second, &["z"])[0], (Some(TierKind::Disk), page(26)));
    }
    assert_eq!(
        again
            .prefix_len(&keys(&again, &["a", "b", "c", "d"]))
            .unwrap(),
        3
    );
    let got = get(&again, &["a", "b", "c"]);
    for (i, (tier, bytes)) in got.iter().enumerate() {
        assert_eq!(*tier, Some(TierKind::Disk));
        assert_eq!(bytes, &page(1 + i as u64), "page {i} after the restart");
    }
    // It keeps storing (the reopened pages are evictable like any other).
    let more: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
    let more: Vec<&str> = more.iter().map(|s| s.as_str()).collect();
    assert_eq!(
        put(&again, &more, &[10, 11, 12, 13, 14, 15, 16, 17]),
        vec![true; 8]
    );
    drop(again);
    // Another namespace: its own file, empty.
    let other = page_store(&cfg, "model-b;tp0/1", PAGE).unwrap();
    assert_eq!(other.prefix_len(&keys(&other, &["m0"])).unwrap(), 0);
    drop(other);
    // The same namespace with another page count: refused, naming the field.
    let err = page_store(&persisted_config(dir.path(), 16), "model-a;tp0/1", PAGE).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert_eq!(err.context_value("field"), Some("num_blocks"), "{err}");
    // And it still opens with the shape it was written with.
    let back = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
    assert_eq!(get(&back, &["m7"])[0], (Some(TierKind::Disk), page(17)));
}

#[test]
fn a_block_rewritten_after_the_index_was_saved_is_never_served_as_the_old_key() {
    use kvbm_connector::tier::StorageTierExt;
    let dir = tempfile::tempdir().unwrap();
    let opts = DiskTierOptions::new(dir.path());
    {
        let (tier, index) =
            DiskTier::open_persistent(TierKind::Disk, dims(), 2, opts.clone(), "ns").unwrap();
        assert!(index.is_empty());
        tier.write_block_from_slice(0, &page(1)).unwrap();
        tier.write_block_from_slice(1, &page(2)).unwrap();
        let p = tier.persistent().unwrap();
        let (c0, c1) = (p.checksum(0).unwrap(), p.checksum(1).unwrap());
        p.bind(&[(0, 100, c0), (1, 200, c1)]);
        p.flush().unwrap();
        // After the save, block 0 gets other bytes (no key bound to them): the write withdraws
        // its entry, and the tier saves that when it closes. (tests/durability.rs: the same
        // with the process killed.)
        tier.write_block_from_slice(0, &page(3)).unwrap();
        // A bind with a checksum the block no longer has is dropped.
        p.bind(&[(0, 100, c0)]);
    }
    let (tier, mut index) =
        DiskTier::open_persistent(TierKind::Disk, dims(), 2, opts, "ns").unwrap();
    index.sort();
    assert_eq!(index, vec![(1, 200)]);
    let err = tier.read_block_to_vec(0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert_eq!(tier.read_block_to_vec(1).unwrap(), page(2));
}

#[test]
fn the_disk_admits_a_page_only_once_it_was_seen_often_enough() {
    let dir = tempfile::tempdir().unwrap();
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            disk: Some(disk(dir.path(), 4)),
            ..Default::default()
        },
        PageStoreOptions {
            disk_min_frequency: 2,
            ..options()
        },
    )
    .unwrap();
    // First sighting: not admitted, so not held anywhere.
    assert_eq!(put(&store, &["a"], &[1]), vec![false]);
    assert_eq!(store.stats().disk_not_admitted, 1);
    assert_eq!(store.prefix_len(&keys(&store, &["b"])).unwrap(), 0); // a lookup is a sighting
                                                                     // Second sighting of each: admitted.
    assert_eq!(put(&store, &["a", "b"], &[1, 2]), vec![true, true]);
    assert_eq!(get(&store, &["a", "b"])[1], (Some(TierKind::Disk), page(2)));
}

#[test]
fn a_slow_remote_store_is_taken_out_of_the_path_and_its_calls_skipped() {
    let shared = Arc::new(remote());
    shared.faults.delay_ms.store(30, Ordering::SeqCst);
    let store = PageStore::new(
        "ns",
        PAGE,
        PageStoreTiers {
            host: Some(host(2)),
            remote: Some(shared.clone() as Arc<dyn RemoteStore>),
            ..Default::default()
        },
        PageStoreOptions {
            lookup_timeout: Duration::from_secs(5),
            slow: Duration::from_millis(5),
            backoff: Duration::from_secs(600),
            ..options()
        },
    )
    .unwrap();
    // Every lookup answers, each 30 ms late against a 5 ms threshold: after the window's
    // minimum of samples the store is slow and left alone for its back-off.
    for _ in 0..12 {
        let _ = store.prefix_len(&keys(&store, &["x"])).unwrap();
    }
    let stats = store.stats();
    assert_eq!(
        stats.remote_state,
        Some(kvbm_connector::connector::remote::StoreState::Slow),
        "{stats:?}"
    );
    assert!(stats.remote_skipped >= 1, "{stats:?}");
    let before = shared.calls();
    assert_eq!(
        put(&store, &["y"], &[3]),
        vec![true],
        "held by the host tier"
    );
    assert_eq!(get(&store, &["z"])[0].0, None);
    assert_eq!(
        shared.calls(),
        before,
        "no call reached the store while out"
    );
    assert!(store
        .render_prometheus("sglang")
        .contains("kvbm_page_store_remote_state{engine=\"sglang\",state=\"slow\"} 1"));
}

/// Pages large enough that one call reads and writes them on several threads
/// (`PARALLEL_MIN_BYTES` each): every byte still right, a corrupt page among them a miss and
/// withdrawn, the host tier's evictions and a full disk tier as on one thread.
#[test]
fn large_pages_in_one_call_go_through_several_threads_byte_exact() {
    use kvbm_connector::page_store::PARALLEL_MIN_BYTES;
    use std::io::{Seek, SeekFrom, Write};
    const BIG: usize = PARALLEL_MIN_BYTES + 3000; // not a multiple of 4096: bounced and padded
    let big_dims = LayoutDims {
        num_layers: 1,
        outer_dim: 1,
        page_size: 1,
        inner_dim: BIG,
        dtype_bytes: 1,
    };
    let dir = tempfile::tempdir().unwrap();
    let d = Arc::new(
        DiskTier::create(
            TierKind::Disk,
            big_dims,
            12,
            DiskTierOptions::new(dir.path()),
        )
        .unwrap(),
    );
    let h: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(big_dims, 4).unwrap()).unwrap());
    let store = PageStore::new(
        "ns",
        BIG,
        PageStoreTiers {
            host: Some(h),
            disk: Some(d.clone()),
            ..Default::default()
        },
        PageStoreOptions {
            io_threads: 4,
            ..options()
        },
    )
    .unwrap();
    let big_page = |seed: u64| -> Vec<u8> {
        (0..BIG)
            .map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8)
            .collect()
    };
    let names: Vec<String> = (0..16).map(|i| format!("p{i}")).collect();
    let ks: Vec<SequenceHash> = names.iter().map(|n| store.key(n.as_bytes())).collect();
    let pages: Vec<Vec<u8>> = (0..16).map(big_page).collect();
    let segs: Vec<Vec<IoSlice<'_>>> = pages
        .iter()
        .map(|p| {
            let (a, b) = p.split_at(BIG / 3);
            vec![IoSlice::new(a), IoSlice::new(b)]
        })
        .collect();
    // 16 pages, the disk holds 12: the first 12 written are held, the host holds 4 of them.
    let held = store.put(&ks, &segs).unwrap();
    assert_eq!(held.iter().filter(|h| **h).count(), 12, "{held:?}");
    let read = |store: &PageStore| -> Vec<(Option<TierKind>, Vec<u8>)> {
        let mut bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; BIG]).collect();
        let served = {
            let mut segs: Vec<Vec<IoSliceMut<'_>>> =
                bufs.iter_mut().map(|b| vec![IoSliceMut::new(b)]).collect();
            store.get(&ks, &mut segs).unwrap()
        };
        served.into_iter().zip(bufs).collect()
    };
    let got = read(&store);
    for (i, (tier, bytes)) in got.iter().enumerate() {
        if held[i] {
            assert!(tier.is_some(), "page {i} was held");
            assert!(bytes == &pages[i], "page {i}: wrong bytes from {tier:?}");
        } else {
            assert_eq!(*tier, None, "page {i} was not held");
        }
    }
    // Damage one disk slot: exactly its page is a miss (when the host does not hold it too).
    let disk_only: Vec<usize> = (0..16)
        .filter(|&i| got[i].0 == Some(TierKind::Disk))
        .collect();
    assert!(disk_only.len() >= 8, "{disk_only:?}");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path())
            .unwrap();
        for slot in 0..12u64 {
            f.seek(SeekFrom::Start(slot * d.slot_bytes() as u64 + 777))
                .unwrap();
            f.write_all(&[0x5A; 3]).unwrap();
        }
        f.sync_all().unwrap();
    }
    let again = read(&store);
    for (i, (tier, bytes)) in again.iter().enumerate() {
        match tier {
            Some(_) => assert!(bytes == &pages[i], "page {i}: wrong bytes from {tier:?}"),
            None => assert!(!held[i] || disk_only.contains(&i), "page {i} lost"),
        }
    }
    let served_from_disk = again.iter().filter(|g| g.0 == Some(TierKind::Disk)).count();
    assert_eq!(served_from_disk, 0, "every disk slot was damaged");
    assert_eq!(store.stats().corrupt, disk_only.len() as u64);
}

#[test]
fn each_process_of_one_namespace_gets_its_own_persisted_file_up_to_the_bound() {
    use kvbm_connector::backends::standard::page_store;
    let dir = tempfile::tempdir().unwrap();
    let cfg = persisted_config(dir.path(), 2);
    let held: Vec<PageStore> = (0..64)
        .map(|i| page_store(&cfg, "model-a;mla", PAGE).unwrap_or_else(|e| panic!("store {i}: {e}")))
        .collect();
    let err = page_store(&cfg, "model-a;mla", PAGE).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("in use"), "{err}");
    drop(held);
    // Free again: opened.
    page_store(&cfg, "model-a;mla", PAGE).unwrap();
}

/// Index saves from several threads (SGLang's prefetch and backup threads both put, and
/// `flush` may come from a third) while pages are put and evicted: every save succeeds (they
/// share the index's temporary file, so one runs at a time), and a copy of the files taken
/// right after them — a process killed then — reopens with pages served byte for byte.
#[test]
fn index_saves_from_several_threads_while_pages_are_put_never_fail_or_damage_the_index() {
    use kvbm_connector::backends::standard::page_store;
    let dir = tempfile::tempdir().unwrap();
    let cfg = persisted_config(dir.path(), 8);
    let store = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
    let failures = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..40 {
                    if let Err(e) = store.flush() {
                        eprintln!("flush: {e}");
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        s.spawn(|| {
            for i in 0..60u64 {
                let name = format!("p{i}");
                assert_eq!(put(&store, &[name.as_str()], &[i]), vec![true]);
            }
        });
    });
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    store.flush().unwrap();
    // The files as a killed process leaves them (no save at drop).
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
    }
    drop(store);
    let again = page_store(&persisted_config(copy.path(), 8), "model-a;tp0/1", PAGE).unwrap();
    let names: Vec<String> = (52..60).map(|i| format!("p{i}")).collect();
    let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let got = get(&again, &names);
    for (i, (tier, bytes)) in got.iter().enumerate() {
        assert_eq!(*tier, Some(TierKind::Disk), "{} after the copy", names[i]);
        assert_eq!(bytes, &page(52 + i as u64), "{}", names[i]);
    }
}

/// A persisted tier dropped and reopened at once in the same process gets its own file back:
/// the drop lets go of the file's lock before it returns (the index saver thread, which held
/// the file too, has ended), so the reopen does not move to the identity's next, empty file.
/// Before, on a loaded host, the saver thread had not yet run when the reopen came: the reopen
/// took the `.r1` file and served none of the pages.
#[test]
fn a_persisted_tier_reopened_right_after_its_drop_gets_its_file_back() {
    use kvbm_connector::backends::standard::page_store;
    let dir = tempfile::tempdir().unwrap();
    let cfg = persisted_config(dir.path(), 8);
    {
        let first = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
        assert_eq!(put(&first, &["a"], &[1]), vec![true]);
    }
    for round in 0..200 {
        let again = page_store(&cfg, "model-a;tp0/1", PAGE).unwrap();
        assert_eq!(
            get(&again, &["a"])[0],
            (Some(TierKind::Disk), page(1)),
            "reopen {round}"
        );
    }
    let files = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".persist.blocks")
        })
        .count();
    assert_eq!(files, 1, "the reopens made other files");
}
