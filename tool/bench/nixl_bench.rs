//! `kvbm bench`'s NIXL paths (feature `nixl`); see the [module docs](super).

use super::*;
use kvbm_connector::backends::nixl::{NixlAgent, NixlBackend, NixlDiskTier};

/// Times three closures in turn, `rounds` times each after one warm-up; medians.
fn interleaved3(
    rounds: usize,
    mut f: [&mut dyn FnMut() -> Result<()>; 3],
) -> Result<[Duration; 3]> {
    for g in f.iter_mut() {
        g()?;
    }
    let mut times: [Vec<Duration>; 3] = Default::default();
    for _ in 0..rounds.max(1) {
        for (g, t) in f.iter_mut().zip(times.iter_mut()) {
            let start = Instant::now();
            g()?;
            t.push(start.elapsed());
        }
    }
    let [a, b, c] = times;
    Ok([median(a), median(b), median(c)])
}

pub(super) fn paths(
    blocks: usize,
    rounds: usize,
    dir: PathBuf,
    in_flight: usize,
) -> Result<Vec<PathResult>> {
    posix_paths(blocks, rounds, dir, in_flight)
}

fn posix_paths(
    blocks: usize,
    rounds: usize,
    dir: PathBuf,
    in_flight: usize,
) -> Result<Vec<PathResult>> {
    let d = dims();
    let bpb = d.bytes_per_block();
    let bytes = blocks * bpb;
    let agent = NixlAgent::new(None, &[NixlBackend::Posix])?;
    let mem: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, blocks)?)?);
    fill(mem.as_ref())?;
    agent.register_host_tier(mem.clone())?;
    let opts = DiskTierOptions::new(dir).with_max_in_flight(in_flight);
    let nixl_disk = NixlDiskTier::create(&agent, TierKind::Disk, d, blocks, opts.clone())?;
    let direct = nixl_disk.direct_io();
    let (path, slot) = (nixl_disk.path().to_path_buf(), nixl_disk.slot_bytes());
    let nixl_disk: Arc<dyn StorageTier> = Arc::new(nixl_disk);
    let builtin: Arc<dyn StorageTier> =
        Arc::new(DiskTier::create(TierKind::Disk, d, blocks, opts)?);
    let rig = DiskRig::new(mem.as_ref(), &path, direct, in_flight)?;
    let kind = rig.kind;
    let mut out = Vec::new();
    // Writes: raw, built-in, NIXL. Reads follow NIXL's write, so its checksums hold.
    let [raw_t, builtin_t, nixl_t] = interleaved3(
        rounds,
        [
            &mut || rig.raw(bpb, slot, true),
            &mut || rig.copy(&mem, &builtin),
            &mut || rig.copy(&mem, &nixl_disk),
        ],
    )?;
    out.push(bandwidth(
        "memory->disk (NIXL POSIX)",
        bytes,
        raw_t,
        nixl_t,
        &format!("raw {kind} pwrite, same file, memory and bytes"),
    ));
    out.push(bandwidth(
        "memory->disk (NIXL POSIX vs built-in)",
        bytes,
        builtin_t,
        nixl_t,
        "built-in disk tier, same memory and bytes",
    ));
    let [raw_t, builtin_t, nixl_t] = interleaved3(
        rounds,
        [
            &mut || rig.raw(bpb, slot, false),
            &mut || rig.copy(&builtin, &mem),
            &mut || rig.copy(&nixl_disk, &mem),
        ],
    )?;
    out.push(bandwidth(
        "disk->memory (NIXL POSIX, checksummed)",
        bytes,
        raw_t,
        nixl_t,
        &format!("raw {kind} pread, same file, memory and bytes"),
    ));
    out.push(bandwidth(
        "disk->memory (NIXL POSIX vs built-in)",
        bytes,
        builtin_t,
        nixl_t,
        "built-in disk tier, same memory and bytes",
    ));
    Ok(out)
}
