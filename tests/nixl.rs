//! The `nixl` backend, for real: NIXL's POSIX plugin under the disk tier, UCX between agents and
//! between two processes, and a missing or broken installation as an error, never an abort.
//!
//! Run with the library on the loader's path: `source scripts/nixl-env.sh && cargo test
//! --features nixl --test nixl`. Without NIXL the tests that need it print `SKIP <test>: <reason>` to
//! stderr (past the test harness's capture) and return, except
//! under `CI=true`, where a missing NIXL fails them (CI installs it; a skip there would hide a
//! broken install). The missing-library tests need no NIXL and always run.
//!
//! The conformance checks are those of `tests/tier_conformance.rs` (same names, same invariants),
//! shared through `tests/conformance/mod.rs`.
//!
//! Helper tests marked `#[ignore]` are the other process of a two-process test: the parent runs
//! this binary again with `--ignored --exact <name>`.

#![cfg(feature = "nixl")]

#[macro_use]
mod conformance;
mod common;

use std::io::{BufRead, BufReader, IoSliceMut, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use conformance::*;
use kvbm_connector::backends::disk::DiskTierOptions;
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::backends::nixl::{
    probe, NixlAgent, NixlBackend, NixlDiskTier, NixlInfo, RemoteTier, TierExport, VerifiedRemote,
    LIB_DIR_ENV, PLUGIN_DIR_ENV, REMOTE_MAX_IN_FLIGHT,
};
use kvbm_connector::config::TransferConfig;
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::transfer::TransferEngine;
use kvbm_connector::{ErrorKind, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind};

// ------------------------------------------------------------------------------------------------
// NIXL present, or skip (fail under CI)
// ------------------------------------------------------------------------------------------------

/// NIXL with its POSIX and UCX plugins, or `None` after printing why (a panic under `CI=true`).
fn nixl() -> Option<NixlInfo> {
    let found = probe().and_then(|info| {
        info.require(NixlBackend::Posix)?;
        info.require(NixlBackend::Ucx)?;
        Ok(info)
    });
    match found {
        Ok(info) => Some(info),
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true and NIXL is not usable (CI installs it via scripts/nixl-env.sh): {e}")
        }
        Err(e) => {
            eprintln!(
                "SKIP {}: NIXL is not usable here: {e}",
                std::thread::current().name().unwrap_or("nixl test")
            );
            None
        }
    }
}

macro_rules! need_nixl {
    () => {
        if nixl().is_none() {
            return;
        }
    };
}

// ------------------------------------------------------------------------------------------------
// Fixtures
// ------------------------------------------------------------------------------------------------

/// A tier plus whatever must outlive it; fields drop in order (the tier first).
struct Fixture<T> {
    tier: T,
    _keep: Vec<Box<dyn std::any::Any>>,
}

fn agent(backends: &[NixlBackend]) -> NixlAgent {
    NixlAgent::new(None, backends).expect("NIXL agent")
}

fn nixl_disk(dims: LayoutDims, direct_io: bool) -> Option<Fixture<NixlDiskTier>> {
    nixl()?;
    let dir = tempfile::tempdir().expect("tempdir");
    let a = agent(&[NixlBackend::Posix]);
    let tier = NixlDiskTier::create(
        &a,
        TierKind::Disk,
        dims,
        NUM_BLOCKS,
        DiskTierOptions::new(dir.path()).with_direct_io(direct_io),
    )
    .expect("NIXL disk tier");
    Some(Fixture {
        tier,
        _keep: vec![Box::new(dir)],
    })
}

/// A host tier exported by one agent and reached over UCX by another, in this process.
fn remote(dims: LayoutDims, layout: MemLayout) -> Option<Fixture<RemoteTier>> {
    nixl()?;
    let exporter = agent(&[NixlBackend::Ucx]);
    let host: Arc<dyn StorageTier> = Arc::new(memory(dims, layout));
    let id = exporter
        .register_host_tier(host.clone())
        .expect("register host tier");
    let export = exporter.export_tier(id).expect("export");
    let export = TierExport::from_bytes(&export.to_bytes().expect("encode")).expect("decode");
    let importer = agent(&[NixlBackend::Ucx]);
    let tier = RemoteTier::connect(&importer, &export, REMOTE_MAX_IN_FLIGHT).expect("connect");
    Some(Fixture {
        tier,
        _keep: vec![Box::new(importer), Box::new(exporter), Box::new(host)],
    })
}

fn memory(dims: LayoutDims, which: MemLayout) -> MemoryTier {
    MemoryTier::host(which.layout(dims)).expect("memory tier")
}

// ------------------------------------------------------------------------------------------------
// Helpers (the rest are shared: tests/conformance/mod.rs)
// ------------------------------------------------------------------------------------------------

/// The image of `block` at `generation`, as a plain `Vec` (the shared helpers' `AlignedBuf::image`).
fn image(block: usize, len: usize, generation: u64) -> Vec<u8> {
    (0..len).map(|i| pattern(block, i, generation)).collect()
}

// ------------------------------------------------------------------------------------------------
// Conformance: the shared checks, one #[test] per (backend, handle, check)
// ------------------------------------------------------------------------------------------------

/// The shared capability check, after checking that the tier says it is not host addressable (so
/// the check takes its `Unsupported` branch).
fn check_nixl_capability<T: StorageTier + ?Sized>(tier: &T) {
    assert!(
        !tier.capability().host_addressable,
        "NIXL tiers are not host addressable"
    );
    check_capability(tier);
}

conformance! {
    fixture: optional,
    capability: check_nixl_capability;
    nixl_disk_direct_small => nixl_disk(small_dims(), true);
    nixl_disk_buffered_small => nixl_disk(small_dims(), false);
    nixl_disk_direct_aligned => nixl_disk(aligned_dims(), true);
    nixl_disk_buffered_aligned => nixl_disk(aligned_dims(), false);
    ucx_remote_contiguous_small => remote(small_dims(), MemLayout::Contiguous);
    ucx_remote_outer_major_aligned => remote(aligned_dims(), MemLayout::OuterMajor);
    ucx_remote_head_major_small => remote(small_dims(), MemLayout::HeadMajor);
}

// ------------------------------------------------------------------------------------------------
// NIXL disk tier: checksums, registered memory, the transfer engine
// ------------------------------------------------------------------------------------------------

#[test]
fn probe_reports_library_and_plugins() {
    let Some(info) = nixl() else { return };
    println!("{info:#?}");
    assert!(info.library.ends_with("libnixl_capi.so"), "{info:?}");
    assert!(info.plugin_dir.join("libplugin_POSIX.so").exists());
    assert!(info.has_plugin("POSIX") && info.has_plugin("UCX"));
}

#[test]
fn disk_same_slots_and_capability_as_the_builtin_tier() {
    let Some(f) = nixl_disk(small_dims(), true) else {
        return;
    };
    let t = &f.tier;
    assert_eq!(t.slot_bytes(), 4096);
    let len = std::fs::metadata(t.path()).expect("file").len();
    assert_eq!(len, (NUM_BLOCKS * 4096) as u64);
    let cap = t.capability();
    assert!(cap.checksummed);
    assert_eq!(
        cap.direct_io_alignment,
        if t.direct_io() { 4096 } else { 1 },
        "{:?}",
        t.direct_io_fallback_reason()
    );
    // Block 3's bytes sit at 3 × slot in the file, as in the built-in tier.
    write_image(t, 3, 5);
    let file = std::fs::read(t.path()).expect("read file");
    assert_eq!(&file[3 * 4096..3 * 4096 + 384], &image(3, 384, 5)[..]);
    let path = t.path().to_owned();
    drop(f);
    assert!(!path.exists(), "file removed with the tier");
}

#[test]
fn disk_never_written_is_not_found() {
    let Some(f) = nixl_disk(small_dims(), true) else {
        return;
    };
    let err = f.tier.read_block_to_vec(2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert_eq!(err.context_value("block"), Some("2"));
}

fn corrupt_byte(path: &Path, offset: u64) {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open tier file");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    let mut b = [0u8; 1];
    f.read_exact(&mut b).expect("read");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(&[!b[0]]).expect("write");
    f.sync_all().expect("sync");
}

/// A flipped byte in the file is `Corrupt` (naming block and file) on the bounce path and on the
/// direct path (aligned buffers inside a registered host tier); neighbours stay readable and a
/// rewrite heals.
#[test]
fn disk_corruption_is_detected_on_both_paths() {
    need_nixl!();
    for direct_io in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = agent(&[NixlBackend::Posix]);
        let host = Arc::new(memory(aligned_dims(), MemLayout::Contiguous));
        a.register_host_tier(host.clone()).expect("register");
        let disk = NixlDiskTier::create(
            &a,
            TierKind::Disk,
            aligned_dims(),
            NUM_BLOCKS,
            DiskTierOptions::new(dir.path()).with_direct_io(direct_io),
        )
        .expect("tier");
        let bpb = disk.bytes_per_block();
        write_all_blocks(&disk, 1);
        corrupt_byte(disk.path(), (disk.slot_bytes() + bpb - 1) as u64);
        // Bounce path (a plain Vec).
        let err = disk.read_block_to_vec(1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert_eq!(err.context_value("block"), Some("1"));
        let path = disk.path().display().to_string();
        assert_eq!(err.context_value("path"), Some(path.as_str()));
        // Direct path: the registered host tier's own runs.
        let err = host
            .with_block_mut(1, &mut |runs| disk.read_block(1, runs))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert_image(&disk, 0, 1);
        write_image(&disk, 1, 1);
        assert_image(&disk, 1, 1);
    }
}

/// Memory → NIXL disk → memory through the transfer engine, registered host tiers of three
/// layouts, concurrent batches: every byte comes back, and reads are checksum-verified.
#[test]
fn transfer_engine_round_trip_through_nixl_disk() {
    need_nixl!();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let engine = TransferEngine::new(&TransferConfig {
        max_concurrency: 4,
        batch_blocks: 2,
        ..Default::default()
    })
    .expect("engine");
    for dims in [small_dims(), aligned_dims()] {
        for direct_io in [true, false] {
            let dir = tempfile::tempdir().expect("tempdir");
            let a = agent(&[NixlBackend::Posix]);
            let src: Arc<dyn StorageTier> = Arc::new(memory(dims, MemLayout::OuterMajor));
            let dst: Arc<dyn StorageTier> = Arc::new(memory(dims, MemLayout::HeadMajor));
            let plain: Arc<dyn StorageTier> = Arc::new(memory(dims, MemLayout::Contiguous));
            a.register_host_tier(src.clone()).expect("register");
            a.register_host_tier(dst.clone()).expect("register");
            let disk: Arc<dyn StorageTier> = Arc::new(
                NixlDiskTier::create(
                    &a,
                    TierKind::Disk,
                    dims,
                    NUM_BLOCKS,
                    DiskTierOptions::new(dir.path()).with_direct_io(direct_io),
                )
                .expect("tier"),
            );
            write_all_blocks(src.as_ref(), 11);
            let pairs: Vec<(usize, usize)> = (0..NUM_BLOCKS).map(|b| (b, b)).collect();
            let reversed: Vec<(usize, usize)> =
                (0..NUM_BLOCKS).map(|b| (b, NUM_BLOCKS - 1 - b)).collect();
            let run = |s: &Arc<dyn StorageTier>, d: &Arc<dyn StorageTier>, p: &[(usize, usize)]| {
                let out = runtime
                    .block_on(engine.copy(s.clone(), d.clone(), p.to_vec()))
                    .expect("copy");
                assert!(out.failed.is_empty(), "{:?}", out.failed);
            };
            run(&src, &disk, &pairs);
            run(&disk, &dst, &pairs);
            assert_all_blocks(dst.as_ref(), 11);
            // Unregistered memory goes through the bounce buffers.
            run(&disk, &plain, &reversed);
            for b in 0..NUM_BLOCKS {
                assert_eq!(
                    read_image(plain.as_ref(), NUM_BLOCKS - 1 - b),
                    image(b, dims.bytes_per_block(), 11)
                );
            }
        }
    }
}

/// Verified remote reads (the G4 tier's guarantee): a block is served only while the exporter's
/// header names the expected key and the bytes read hash to the header's checksum; after the
/// exporter evicts and rewrites the block, a read for the old key fails, never served.
#[test]
fn verified_remote_reads_refuse_rewritten_blocks() {
    need_nixl!();
    let dims = small_dims();
    let exporter = agent(&[NixlBackend::Ucx]);
    let host: Arc<dyn StorageTier> = Arc::new(memory(dims, MemLayout::OuterMajor));
    let id = exporter.register_host_tier(host.clone()).expect("register");
    let headers = exporter.register_block_headers(id).expect("headers");
    let export = exporter.export_tier(id).expect("export");
    let export = TierExport::from_bytes(&export.to_bytes().expect("encode")).expect("decode");
    assert!(export.headers.is_some());
    let importer = agent(&[NixlBackend::Ucx]);
    let remote =
        Arc::new(RemoteTier::connect(&importer, &export, REMOTE_MAX_IN_FLIGHT).expect("connect"));
    assert!(remote.has_headers());
    let bpb = dims.bytes_per_block();
    let (k1, k2) = (0x1111_u128 << 64 | 0x1111, 0x2222_u128);
    let read = |block: usize, key: u128| {
        let mut buf = vec![0u8; bpb];
        remote
            .read_verified(block, key, &mut [IoSliceMut::new(&mut buf)])
            .map(|_| buf)
    };
    // Never published: not served.
    write_image(host.as_ref(), 3, 1);
    assert_eq!(read(3, k1).unwrap_err().kind(), ErrorKind::NotFound);
    // Published: served, bytes verified.
    headers.publish_from(host.as_ref(), 3, k1).expect("publish");
    assert_eq!(headers.get(3).map(|h| h.0), Some(k1));
    assert_eq!(read(3, k1).expect("verified read"), image(3, bpb, 1));
    // Another key: refused.
    assert_eq!(read(3, k2).unwrap_err().kind(), ErrorKind::NotFound);
    // Rewritten in place without following the protocol (no invalidation): the checksum catches it.
    write_image(host.as_ref(), 3, 2);
    assert_eq!(read(3, k1).unwrap_err().kind(), ErrorKind::Corrupt);
    // Evicted and reused for another key, per the protocol.
    headers.invalidate(3).expect("invalidate");
    assert_eq!(read(3, k1).unwrap_err().kind(), ErrorKind::NotFound);
    write_image(host.as_ref(), 3, 5);
    headers.publish_from(host.as_ref(), 3, k2).expect("publish");
    assert_eq!(read(3, k1).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(read(3, k2).expect("verified read"), image(3, bpb, 5));

    // Through the transfer engine, as a worker's remote load would run: the stale block fails
    // (a load error for the engine to recompute), the valid one lands, every byte checked.
    write_image(host.as_ref(), 5, 7);
    headers
        .publish_from(host.as_ref(), 5, 0x5555)
        .expect("publish");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let engine = TransferEngine::new(&TransferConfig {
        max_concurrency: 2,
        batch_blocks: 1,
        ..Default::default()
    })
    .expect("engine");
    let src: Arc<dyn StorageTier> =
        Arc::new(VerifiedRemote::new(remote.clone(), [(3, k1), (5, 0x5555)]));
    let dst: Arc<dyn StorageTier> = Arc::new(memory(dims, MemLayout::Contiguous));
    let out = runtime
        .block_on(engine.copy(src.clone(), dst.clone(), vec![(3, 0), (5, 1)]))
        .expect("copy");
    let failed: Vec<usize> = out.failed.iter().map(|f| f.dst_block).collect();
    assert_eq!(failed, vec![0], "{:?}", out.failed);
    assert_eq!(read_image(dst.as_ref(), 1), image(5, bpb, 7));
    assert!(read_image(dst.as_ref(), 0).iter().all(|b| *b == 0));
    // No headers in the export: verified reads are refused outright.
    let bare = exporter
        .register_host_tier(Arc::new(memory(dims, MemLayout::Contiguous)))
        .expect("register");
    let bare = RemoteTier::connect(&importer, &exporter.export_tier(bare).expect("export"), 2)
        .expect("connect");
    let mut buf = vec![0u8; bpb];
    assert_eq!(
        bare.read_verified(0, k1, &mut [IoSliceMut::new(&mut buf)])
            .unwrap_err()
            .kind(),
        ErrorKind::Unsupported
    );
}

#[test]
fn agent_without_posix_cannot_make_a_disk_tier() {
    need_nixl!();
    let dir = tempfile::tempdir().expect("tempdir");
    let a = agent(&[NixlBackend::Ucx]);
    let err = NixlDiskTier::create(
        &a,
        TierKind::Disk,
        small_dims(),
        2,
        DiskTierOptions::new(dir.path()),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(err.to_string().contains("POSIX"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

#[test]
fn device_like_tier_that_is_not_host_addressable_is_refused() {
    need_nixl!();
    let Some(f) = nixl_disk(small_dims(), false) else {
        return;
    };
    let a = agent(&[NixlBackend::Ucx]);
    let err = a
        .register_host_tier(Arc::new(f.tier))
        .expect_err("a disk tier has no memory to register");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
}

#[test]
fn export_with_wrong_allocation_count_is_refused() {
    need_nixl!();
    let exporter = agent(&[NixlBackend::Ucx]);
    let id = exporter
        .register_host_tier(Arc::new(memory(small_dims(), MemLayout::BlockMajor)))
        .expect("register");
    let mut export = exporter.export_tier(id).expect("export");
    export.allocations.pop();
    let importer = agent(&[NixlBackend::Ucx]);
    let err = RemoteTier::connect(&importer, &export, 2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Decode, "{err}");
}

// ------------------------------------------------------------------------------------------------
// Two processes over UCX
// ------------------------------------------------------------------------------------------------

const ROLE_DIR_ENV: &str = "KVBM_NIXL_TEST_DIR";
const EXPORT_BLOCKS: usize = 16;

/// The exporter's host tier: outer-major layer-separate (several allocations, many runs).
fn exporter_layout() -> Layout {
    Layout::layer_separate(aligned_dims(), EXPORT_BLOCKS, BlockOrder::OuterMajor).expect("layout")
}

fn self_command(test: &str) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--ignored",
        "--exact",
        test,
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// Helper process for `two_processes_move_blocks_over_ucx`: exports a filled host tier, then
/// checks on request that the parent's UCX write landed, byte for byte.
#[test]
#[ignore = "the exporting process of two_processes_move_blocks_over_ucx, started by it"]
fn child_ucx_exporter() {
    let Some(dir) = std::env::var_os(ROLE_DIR_ENV).map(PathBuf::from) else {
        panic!(
            "{ROLE_DIR_ENV} unset: this helper is started by two_processes_move_blocks_over_ucx"
        );
    };
    let a = NixlAgent::new(
        Some(&format!("kvbm-test-exporter-{}", std::process::id())),
        &[NixlBackend::Ucx],
    )
    .expect("agent");
    let host = Arc::new(MemoryTier::host(exporter_layout()).expect("host tier"));
    write_all_blocks(host.as_ref(), 1);
    let id = a.register_host_tier(host.clone()).expect("register");
    let bytes = a
        .export_tier(id)
        .expect("export")
        .to_bytes()
        .expect("encode");
    let tmp = dir.join("export.json.tmp");
    std::fs::write(&tmp, bytes).expect("write export");
    std::fs::rename(&tmp, dir.join("export.json")).expect("publish export");
    println!("EXPORTED");
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        if let Some(rest) = line.strip_prefix("verify ") {
            let mut it = rest
                .split_whitespace()
                .map(|x| x.parse::<u64>().expect("number"));
            let (block, generation) = (it.next().expect("block") as usize, it.next().expect("gen"));
            let got = host.read_block_to_vec(block).expect("read");
            let ok = got == image(block, host.bytes_per_block(), generation);
            // The other blocks are untouched.
            let others = (0..EXPORT_BLOCKS).filter(|&b| b != block).all(|b| {
                host.read_block_to_vec(b).expect("read") == image(b, host.bytes_per_block(), 1)
            });
            println!("{}", if ok && others { "VERIFIED" } else { "MISMATCH" });
            std::io::stdout().flush().expect("flush");
        }
    }
}

/// Two processes: a child exports a host tier; this process imports it as a remote (G4) tier
/// and reads every block over UCX (into a registered host tier via the transfer engine, and
/// into plain buffers through the bounce pool), verifying every byte; then it writes one block
/// and the child verifies it in its own memory.
#[test]
fn two_processes_move_blocks_over_ucx() {
    need_nixl!();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = self_command("child_ucx_exporter")
        .env(ROLE_DIR_ENV, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the exporting process");
    let export_path = dir.path().join("export.json");
    let start = Instant::now();
    while !export_path.exists() {
        if let Some(status) = child.try_wait().expect("child status") {
            panic!("exporting process ended early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "exporting process published nothing within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let export =
        TierExport::from_bytes(&std::fs::read(&export_path).expect("read export")).expect("decode");
    assert_eq!(export.layout, exporter_layout());

    let a = agent(&[NixlBackend::Ucx]);
    let remote: Arc<dyn StorageTier> =
        Arc::new(RemoteTier::connect(&a, &export, REMOTE_MAX_IN_FLIGHT).expect("connect"));
    assert_eq!(remote.kind(), TierKind::Remote);
    let local: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::host(Layout::fully_contiguous(aligned_dims(), EXPORT_BLOCKS).expect("layout"))
            .expect("host"),
    );
    a.register_host_tier(local.clone()).expect("register");

    let t = Instant::now();
    let pairs: Vec<(usize, usize)> = (0..EXPORT_BLOCKS).map(|b| (b, b)).collect();
    let out = TransferEngine::copy_blocking(remote.as_ref(), local.as_ref(), &pairs).expect("copy");
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    println!(
        "UCX read of {} blocks ({} bytes) from process {} in {:?}",
        EXPORT_BLOCKS,
        out.bytes,
        export.agent,
        t.elapsed()
    );
    assert_all_blocks(local.as_ref(), 1);
    // Unregistered buffers: through the bounce pool.
    for b in 0..EXPORT_BLOCKS {
        assert_eq!(
            remote.read_block_to_vec(b).expect("read"),
            image(b, remote.bytes_per_block(), 1)
        );
    }

    // A UCX write into the other process's memory, checked there.
    write_image(remote.as_ref(), 5, 9);
    assert_image(remote.as_ref(), 5, 9);
    let mut stdin = child.stdin.take().expect("child stdin");
    let mut stdout = BufReader::new(child.stdout.take().expect("child stdout"));
    writeln!(stdin, "verify 5 9").expect("ask the child");
    stdin.flush().expect("flush");
    let mut verdict = String::new();
    loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).expect("child output") == 0 {
            break;
        }
        if line.starts_with("VERIFIED") || line.starts_with("MISMATCH") {
            verdict = line.trim().to_owned();
            break;
        }
    }
    drop(stdin);
    drop(remote);
    let status = child.wait().expect("child exit");
    assert_eq!(verdict, "VERIFIED", "the exporting process saw other bytes");
    assert!(status.success(), "exporting process failed: {status}");
}

// ------------------------------------------------------------------------------------------------
// Missing or broken NIXL: an error naming what was searched, never an abort
// ------------------------------------------------------------------------------------------------

/// Helper process: probes NIXL under whatever environment it was given and prints the outcome;
/// then tries the constructors, which must return the same error (not abort).
#[test]
#[ignore = "the probing process of the missing/broken NIXL tests, started by them"]
fn child_probe_report() {
    match probe() {
        Ok(info) => println!("PROBE_OK {}", info.library.display()),
        Err(e) => {
            println!("PROBE_ERR kind={:?} {e}", e.kind());
            let err = NixlAgent::new(None, &[NixlBackend::Posix]).unwrap_err();
            println!("AGENT_ERR kind={:?} {err}", err.kind());
        }
    }
}

/// Runs `child_probe_report` with `env` (and `LIB_DIR_ENV`/`PLUGIN_DIR_ENV` cleared unless
/// given); returns its stdout after checking it exited normally.
fn probe_in_child(env: &[(&str, &Path)]) -> String {
    let mut cmd = self_command("child_probe_report");
    cmd.env_remove(LIB_DIR_ENV).env_remove(PLUGIN_DIR_ENV);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the probing process");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("child stdout:\n{stdout}");
    println!("child stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the probing process did not exit normally ({}): a missing NIXL must not abort",
        out.status
    );
    stdout
}

#[test]
fn missing_library_is_an_error_naming_what_was_searched() {
    let empty = tempfile::tempdir().expect("tempdir");
    let out = probe_in_child(&[
        ("LD_LIBRARY_PATH", empty.path()),
        (PLUGIN_DIR_ENV, empty.path()),
    ]);
    if out.contains("PROBE_OK") {
        eprintln!(
            "SKIP missing_library_is_an_error_naming_what_was_searched: a system-wide NIXL is on the loader's default path: {out}"
        );
        return;
    }
    assert!(out.contains("PROBE_ERR kind=Unsupported"), "{out}");
    assert!(out.contains("libnixl_capi.so could not be loaded"), "{out}");
    let empty = empty.path().display().to_string();
    assert!(out.contains(&format!("LD_LIBRARY_PATH={empty}")), "{out}");
    assert!(out.contains("scripts/nixl-env.sh"), "{out}");
    assert!(out.contains("AGENT_ERR kind=Unsupported"), "{out}");
}

#[test]
fn missing_library_in_the_named_folder_is_an_error() {
    let empty = tempfile::tempdir().expect("tempdir");
    let out = probe_in_child(&[(LIB_DIR_ENV, empty.path())]);
    assert!(out.contains("PROBE_ERR kind=Unsupported"), "{out}");
    let expected = empty.path().join("libnixl_capi.so").display().to_string();
    assert!(out.contains(&expected), "{out}");
    assert!(out.contains(LIB_DIR_ENV), "{out}");
}

#[test]
fn a_library_that_is_not_nixl_is_an_error() {
    // Any shared object without NIXL's symbols, under NIXL's name.
    let Some(libm) = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
        "/usr/lib64/libm.so.6",
    ]
    .iter()
    .map(Path::new)
    .find(|p| p.exists()) else {
        eprintln!(
            "SKIP a_library_that_is_not_nixl_is_an_error: no libm.so.6 found to stand in for a wrong library"
        );
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(libm, dir.path().join("libnixl_capi.so")).expect("symlink");
    let out = probe_in_child(&[(LIB_DIR_ENV, dir.path())]);
    assert!(out.contains("PROBE_ERR kind=Unsupported"), "{out}");
    assert!(out.contains("is not a usable NIXL C API library"), "{out}");
}

#[test]
fn empty_plugin_folder_is_an_error_naming_it() {
    let Some(info) = nixl() else { return };
    let lib_dir = info.library.parent().expect("library folder").to_owned();
    let empty = tempfile::tempdir().expect("tempdir");
    let out = probe_in_child(&[(LIB_DIR_ENV, &lib_dir), (PLUGIN_DIR_ENV, empty.path())]);
    assert!(out.contains("PROBE_ERR kind=Unsupported"), "{out}");
    assert!(out.contains("found no plugin"), "{out}");
    assert!(out.contains(&empty.path().display().to_string()), "{out}");

    let missing = empty.path().join("nope");
    let out = probe_in_child(&[(LIB_DIR_ENV, &lib_dir), (PLUGIN_DIR_ENV, &missing)]);
    assert!(out.contains("PROBE_ERR kind=Unsupported"), "{out}");
    assert!(
        out.contains(&format!("{} does not exist", missing.display())),
        "{out}"
    );
}

#[test]
fn library_from_its_folder_without_the_loader_path() {
    let Some(info) = nixl() else { return };
    let lib_dir = info.library.parent().expect("library folder").to_owned();
    let empty = tempfile::tempdir().expect("tempdir");
    // LD_LIBRARY_PATH useless, NIXL_PLUGIN_DIR unset: KVBM_NIXL_LIB_DIR alone is enough.
    let out = probe_in_child(&[(LIB_DIR_ENV, &lib_dir), ("LD_LIBRARY_PATH", empty.path())]);
    assert!(out.contains("PROBE_OK"), "{out}");
}

#[test]
fn public_types_are_send_sync() {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<NixlAgent>();
    is_send_sync::<NixlDiskTier>();
    is_send_sync::<RemoteTier>();
    is_send_sync::<TierExport>();
    is_send_sync::<NixlInfo>();
}

/// A whole replay with the disk tier's I/O through NIXL: every onboarded block verified. It runs
/// the `kvbm` binary (the tool is not part of the library's API), with a clean configuration
/// environment and the configuration in a file.
#[cfg(feature = "cli")]
#[test]
fn replay_with_nixl_disk_passes_integrity() {
    if nixl().is_none() {
        return;
    }
    use kvbm_connector::config::{DiskIo, CONFIG_FILE_VAR, ENV_VARS};
    let dir = tempfile::tempdir().unwrap();
    for framework in ["trtllm", "vllm"] {
        let mut config = kvbm_connector::Config::default();
        config.host.cache_blocks = Some(32);
        config.disk.cache_blocks = Some(512);
        config.disk.dir = dir.path().to_path_buf();
        config.disk.io = DiskIo::Nixl;
        let config_file = dir.path().join("kvbm.toml");
        std::fs::write(&config_file, config.to_toml().unwrap()).unwrap();
        let report_file = dir.path().join(format!("{framework}.json"));
        let mut kvbm = Command::new(env!("CARGO_BIN_EXE_kvbm"));
        for v in ENV_VARS {
            kvbm.env_remove(v.name);
        }
        let out = kvbm
            .env_remove(CONFIG_FILE_VAR)
            .args(["replay", "--quiet", "--framework", framework])
            .args([
                "--workload",
                "multi-turn",
                "--seed",
                "3",
                "--requests",
                "40",
            ])
            .args([
                "--arrival-gap",
                "4",
                "--block-size",
                "16",
                "--device-blocks",
                "160",
            ])
            .args([
                "--max-batch",
                "4",
                "--chunk-tokens",
                "128",
                "--device-prefix-cache",
                "off",
            ])
            .args(["--prefill-us-per-token", "50", "--tp", "1"])
            .args([
                "--layers",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "32",
                "--dtype-bytes",
                "2",
            ])
            .arg("--config")
            .arg(&config_file)
            .arg("--report")
            .arg(&report_file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{framework}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&report_file).unwrap()).unwrap();
        let s = &report["summary"];
        assert_eq!(s["integrity_errors"], 0, "{framework}");
        assert!(
            s["matched_from"]["disk"].as_u64().unwrap() > 0,
            "{framework}: no disk hits: {s}"
        );
        assert!(s["onboarded"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["path"] == "disk->device" && p["blocks"].as_u64().unwrap() > 0));
    }
}

// ------------------------------------------------------------------------------------------------
// The remote (G4) tier through the connector: two instances sharing `remote.dir`
// ------------------------------------------------------------------------------------------------

mod remote_tier {
    use super::common::{self, image as kv, info, Rig, BS};
    use super::*;
    use kvbm_connector::connector::adapter::SchedulerStep;
    use kvbm_connector::connector::leader::MatchResult;
    use kvbm_connector::connector::RequestId;

    /// One instance (leader + worker) publishing to and reading from `remote_dir` as `name`.
    fn instance(remote_dir: &Path, name: &str, host_blocks: usize) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mut config = common::config(dir.path(), host_blocks, 0);
        config
            .apply_env(|k| match k {
                "KVBM_REMOTE_DIR" => Some(remote_dir.display().to_string()),
                "KVBM_REMOTE_INSTANCE" => Some(name.to_owned()),
                "KVBM_REMOTE_PUBLISH_EVERY" => Some("1".to_owned()),
                _ => None,
            })
            .expect("config");
        common::rig_with(config, dir)
    }

    /// Matches and loads `tokens` as `id` into `blocks` (filled with 0xEE first); returns the
    /// match and the device blocks whose load failed.
    fn onboard(
        r: &mut Rig,
        id: &RequestId,
        tokens: &[u32],
        blocks: &[usize],
    ) -> (MatchResult, Vec<usize>) {
        for &b in blocks {
            r.device
                .write_block_from_slice(b, &vec![0xEE; common::dims().bytes_per_block()])
                .unwrap();
        }
        let m = r
            .leader
            .get_num_new_matched_tokens(info(id, tokens), 0)
            .unwrap();
        r.leader
            .update_state_after_alloc(id, blocks, m.external_tokens)
            .unwrap();
        let mut loaded = Vec::new();
        for _ in 0..3 {
            let (_, l) = r.step(SchedulerStep::default(), &[], &[]);
            loaded.extend(l);
            if !loaded.is_empty() {
                break;
            }
        }
        if m.external_tokens > 0 {
            assert_eq!(loaded, vec![id.clone()], "load not reported");
        }
        let errors = r.worker.take_load_errors();
        r.leader.request_finished(id, None, Some(0)).unwrap();
        r.step(SchedulerStep::default(), &[], std::slice::from_ref(id));
        (m, errors)
    }

    /// Instance B onboards a prefix instance A holds in its host tier, over UCX, every byte
    /// checked; once A evicted and rewrote those host blocks, B's load from its stale index fails
    /// as load errors (never served).
    #[test]
    fn leader_onboards_a_prefix_from_another_instances_host_tier() {
        need_nixl!();
        let dir = tempfile::tempdir().unwrap();
        let mut a = instance(dir.path(), "inst-a", 4);
        let mut b = instance(dir.path(), "inst-b", 0);
        // 3 full blocks + 1 token: all 3 blocks are matchable.
        let prompt: Vec<u32> = (0..13).map(|t| 1000 + t).collect();
        a.offload(&RequestId::from("a1"), &prompt, &[0, 1, 2, 3]);
        assert!(dir.path().join("inst-a.index.json").exists());
        assert!(dir.path().join("inst-a.rank0.export.json").exists());
        // B reads A's index on its next iteration.
        b.step(SchedulerStep::default(), &[], &[]);
        let (m, errors) = onboard(&mut b, &RequestId::from("b1"), &prompt, &[5, 6, 7, 8]);
        assert_eq!(m.external_tokens, 3 * BS, "{m:?}");
        assert_eq!(m.remote_tokens, 3 * BS, "{m:?}");
        assert_eq!((m.host_tokens, m.disk_tokens), (0, 0));
        assert!(errors.is_empty(), "{errors:?}");
        for (k, dev) in [5, 6, 7].into_iter().enumerate() {
            let got = b.device.read_block_to_vec(dev).unwrap();
            assert_eq!(got, kv(&prompt, k), "block {k}");
            assert_eq!(got, a.device.read_block_to_vec(k).unwrap(), "block {k}");
        }
        let s = b.leader.metrics().snapshot();
        assert_eq!(s.remote_hit_tokens, (3 * BS) as u64, "{s:?}");
        assert_eq!(s.load_error_blocks, 0);

        // A evicts those blocks: another prompt fills its 4 host blocks.
        let other: Vec<u32> = (0..21).map(|t| 5000 + t).collect();
        a.offload(&RequestId::from("a2"), &other, &[8, 9, 10, 11, 12, 13]);
        // B still holds A's old index (it has not built metadata since): the match is remote,
        // the load fails verification, every block is a load error and none is served.
        let (m, mut errors) = onboard(&mut b, &RequestId::from("b2"), &prompt, &[5, 6, 7, 8]);
        assert_eq!(m.remote_tokens, 3 * BS, "{m:?}");
        errors.sort();
        assert_eq!(errors, vec![5, 6, 7]);
        for dev in [5, 6, 7] {
            assert!(
                b.device
                    .read_block_to_vec(dev)
                    .unwrap()
                    .iter()
                    .all(|x| *x == 0xEE),
                "device block {dev} was written by a failed load"
            );
        }
        let s = b.leader.metrics().snapshot();
        assert_eq!(s.remote_hit_tokens, (3 * BS) as u64, "{s:?}");
        assert_eq!(s.load_error_blocks, 3, "{s:?}");
        // B has refreshed meanwhile: A's index no longer lists the prompt, nothing matches.
        let (m, _) = onboard(&mut b, &RequestId::from("b3"), &prompt, &[5, 6, 7, 8]);
        assert_eq!(m.external_tokens, 0, "{m:?}");
        // The new prompt A holds now loads from A, verified.
        b.step(SchedulerStep::default(), &[], &[]);
        let (m, errors) = onboard(&mut b, &RequestId::from("b4"), &other, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(m.remote_tokens, 4 * BS, "{m:?}");
        assert!(errors.is_empty(), "{errors:?}");
        for k in 0..4 {
            assert_eq!(b.device.read_block_to_vec(k).unwrap(), kv(&other, k));
        }
    }
}
