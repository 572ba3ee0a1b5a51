//! `kvbm sweep`: capacity curves. Replays one workload (usually a trace, `--sequential`) at several
//! host capacities — and, with `--disk-tokens`, at the same host capacities plus a disk tier —
//! once per eviction policy; prints the hit rate of each run as a table with the unlimited cache's
//! line, and draws it as an SVG plot (`--plot`).
//!
//! Every run is a full `kvbm replay` (the real connector, every onboarded block verified), so a
//! sweep costs one replay per point; `--jobs` runs that many at once, each reading the trace
//! lazily on its own.
//!
//! The unlimited line is not a replay (its host tier would hold every distinct block of the
//! trace): it is the exact model of a cache that never evicts — a request matches its longest
//! prefix of full blocks seen in any earlier request, leaving the last block of a fully matched
//! prompt to compute, as the engines do — computed over the same tokens and block keys the replay
//! uses. At any capacity at least the trace's distinct blocks a replay gives exactly this line
//! (tests/mooncake.rs checks it).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kvbm_connector::error::{Error, ErrorKind, Result};
use kvbm_connector::identity::{BlockHasher, Salt};
use kvbm_connector::pool::EvictionPolicy;
use strum::VariantNames;

use crate::replay::{replay_config, sim_options, simulator, workload_source, ReplayArgs};

/// `kvbm sweep` flags: the replay's, plus the capacities, the policies and the plot.
#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// Everything `kvbm replay` takes (workload or trace, model shape, device, ...) except
    /// `--host-blocks` and `--disk-blocks`, which the sweep sets per run.
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// Host capacities in tokens, comma-separated; `K`, `M`, `G` suffixes are powers of 1000
    /// (`1M,3M,10M`). Each becomes `floor(tokens / block size)` host blocks (per instance with
    /// `--instances`, which also takes `--host-blocks` instead).
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    pub capacities: Vec<u64>,
    /// Also replay each host capacity with a disk tier of this many tokens (`30M`).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_tokens)]
    pub disk_tokens: Option<u64>,
    /// Eviction policies to compare, comma-separated (`lru`, `2q`, `prefix`): one line per
    /// policy. The configuration's `eviction` (`KVBM_EVICTION`) is overridden per run. Default:
    /// `prefix`, the configuration's default.
    #[arg(long, value_delimiter = ',', default_value = "prefix")]
    pub eviction: Vec<String>,
    /// Write the plot here (SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Plot title (default: names the trace or the workload).
    #[arg(long)]
    pub title: Option<String>,
    /// Replays run at once (each holds its own tiers: mind the memory).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1)]
    pub jobs: usize,
    /// Fleets: the trace split over several instances (`--instances`, `--router`, ...).
    #[command(flatten)]
    pub fleet: crate::fleet::FleetArgs,
}

/// Most capacities one sweep takes.
pub const MAX_POINTS: usize = 64;

/// `1M`, `3000`, `2.5K`: tokens (powers of 1000).
pub fn parse_tokens(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1e3),
        Some((i, 'm' | 'M')) => (&t[..i], 1e6),
        Some((i, 'g' | 'G')) => (&t[..i], 1e9),
        _ => (t, 1.0),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a token count (e.g. 3000, 1M, 2.5K)"))?;
    let v = x * mult;
    if !(v.is_finite() && (1.0..=1e15).contains(&v)) {
        return Err(format!("{s:?}: a token count is between 1 and 1e15"));
    }
    Ok(v.round() as u64)
}

/// The eviction policy `name` names (`--eviction`; the configuration's `eviction` values).
pub fn parse_policy(name: &str) -> Result<EvictionPolicy> {
    name.trim().parse().map_err(|_| {
        Error::invalid_argument(format!(
            "--eviction {name:?}: unknown policy (known: {})",
            EvictionPolicy::VARIANTS.join(", ")
        ))
        .with("flag", "--eviction")
    })
}

/// One point of the sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Eviction policy.
    pub policy: EvictionPolicy,
    /// Host capacity asked for, tokens.
    pub host_tokens: u64,
    /// Host blocks it became.
    pub host_blocks: usize,
    /// Disk capacity, tokens (0: no disk tier).
    pub disk_tokens: u64,
    /// Disk blocks.
    pub disk_blocks: usize,
    /// Matched tokens over all requests, and from the disk tier.
    pub matched: usize,
    /// ... of which from disk.
    pub from_disk: usize,
    /// Prompt tokens.
    pub prompt: usize,
    /// Onboarded blocks whose bytes differed (must be 0).
    pub integrity_errors: usize,
    /// Blocks verified.
    pub verified: usize,
    /// Wall time of the run, s.
    pub wall_s: f64,
}

impl Point {
    /// Matched / prompt tokens, in percent.
    pub fn hit_pct(&self) -> f64 {
        pct(self.matched, self.prompt)
    }
}

pub fn pct(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

/// The unlimited cache: matched and prompt tokens, requests, distinct blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unlimited {
    /// Tokens a never-evicting cache matches.
    pub matched: usize,
    /// Prompt tokens.
    pub prompt: usize,
    /// Requests.
    pub requests: usize,
    /// Distinct full blocks of the workload's prompts (what such a cache holds at the end).
    pub distinct_blocks: usize,
    /// The longest request's tokens (prompt and output).
    pub longest_request: usize,
    /// Full blocks of all requests' tokens (prompt and output) summed: no tier ever stores
    /// more distinct blocks than this.
    pub blocks_bound: usize,
}

/// The exact model of a cache that never evicts, over the workload of `a` (read lazily; memory:
/// one key per distinct block).
pub fn unlimited(a: &ReplayArgs) -> Result<Unlimited> {
    let config = replay_config(a)?;
    let bs = a.model.block_size;
    if bs == 0 {
        return Err(Error::invalid_argument("--block-size must be at least 1"));
    }
    let hasher = BlockHasher::new(config.hash, Salt::NONE);
    let mut seen: HashSet<u128> = HashSet::new();
    let mut out = Unlimited {
        matched: 0,
        prompt: 0,
        requests: 0,
        distinct_blocks: 0,
        longest_request: 0,
        blocks_bound: 0,
    };
    for r in workload_source(a)? {
        let r = r?;
        let keys = hasher.sequence_hashes(&r.prompt, bs)?;
        // Matchable: full blocks of all but the prompt's last token.
        let matchable = r.prompt.len().saturating_sub(1) / bs;
        let hits = keys
            .iter()
            .take(matchable)
            .take_while(|k| seen.contains(&k.0))
            .count();
        out.matched += hits * bs;
        out.prompt += r.prompt.len();
        out.requests += 1;
        let tokens = r.prompt.len().saturating_add(r.max_tokens);
        out.longest_request = out.longest_request.max(tokens);
        out.blocks_bound = out.blocks_bound.saturating_add(tokens / bs);
        seen.extend(keys.iter().map(|k| k.0));
    }
    out.distinct_blocks = seen.len();
    Ok(out)
}

/// One planned run.
#[derive(Debug, Clone)]
struct Plan {
    policy: EvictionPolicy,
    host_tokens: u64,
    disk_tokens: u64,
}

pub fn blocks_of(tokens: u64, bs: usize, flag: &str) -> Result<usize> {
    let b = usize::try_from(tokens / bs as u64).unwrap_or(usize::MAX);
    if b == 0 {
        return Err(Error::invalid_argument(format!(
            "{flag} {tokens} tokens is less than one block of {bs}"
        ))
        .with("flag", flag));
    }
    Ok(b)
}

/// Runs one point: a replay with this host (and disk) capacity and policy.
fn run_point(a: &ReplayArgs, p: &Plan, disk_dir: &Path) -> Result<Point> {
    let bs = a.model.block_size;
    let host_blocks = blocks_of(p.host_tokens, bs, "--capacities")?;
    let disk_blocks = if p.disk_tokens == 0 {
        0
    } else {
        blocks_of(p.disk_tokens, bs, "--disk-tokens")?
    };
    let mut ra = a.clone();
    ra.host_blocks = Some(host_blocks);
    ra.disk_blocks = Some(disk_blocks);
    ra.disk_dir = Some(disk_dir.to_path_buf());
    ra.quiet = true;
    let mut config = replay_config(&ra)?;
    config.eviction = p.policy;
    let opts = sim_options(&ra, config)?;
    opts.config
        .block_counts(opts.model_dims()?.bytes_per_block())?;
    let report = simulator::replay(opts, workload_source(&ra)?)?;
    let s = &report.summary;
    Ok(Point {
        policy: p.policy,
        host_tokens: p.host_tokens,
        host_blocks,
        disk_tokens: p.disk_tokens,
        disk_blocks,
        matched: s.matched_tokens,
        from_disk: s.matched_from.disk,
        prompt: s.prompt_tokens,
        integrity_errors: s.integrity_errors,
        verified: s.blocks_verified,
        wall_s: s.wall_s,
    })
}

/// Runs every point of the sweep (`jobs` at a time); points in plan order.
fn run_points(a: &SweepArgs, plans: &[Plan]) -> Result<Vec<Point>> {
    let base = a
        .replay
        .disk_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("kvbm-sweep"));
    run_in_parallel(plans, a.jobs, "sweep", |_, p| {
        run_point(&a.replay, p, &base)
    })
}

/// Runs `run` on every plan, `jobs` at a time (1 to the plan count); the results in plan
/// order. The first error stops the others from taking new plans and is returned; `what` names
/// the runs in an internal error.
pub fn run_in_parallel<P: Sync, R: Send>(
    plans: &[P],
    jobs: usize,
    what: &str,
    run: impl Fn(usize, &P) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<R>>>> =
        Mutex::new((0..plans.len()).map(|_| None).collect());
    let jobs = jobs.clamp(1, plans.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = plans.get(k) else { break };
                let r = run(k, p);
                let failed = r.is_err();
                if let Ok(mut v) = results.lock() {
                    v[k] = Some(r);
                }
                if failed {
                    // The others stop taking new plans.
                    next.store(plans.len(), Ordering::Relaxed);
                }
            });
        }
    });
    let results = results
        .into_inner()
        .map_err(|_| Error::internal(format!("a {what} run panicked")))?;
    let mut out = Vec::with_capacity(plans.len());
    for r in results.into_iter().flatten() {
        out.push(r?);
    }
    if out.len() != plans.len() {
        return Err(Error::internal(format!("a {what} run did not report")));
    }
    Ok(out)
}

/// The sweep's table.
pub fn render_table(title: &str, points: &[Point], unlimited: &Unlimited) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvbm sweep — {title}: {} requests, {} prompt tokens",
        unlimited.requests, unlimited.prompt
    );
    let _ = writeln!(
        out,
        "  {:<10} {:>12} {:>11} {:>12} {:>11} {:>9} {:>14} {:>11}",
        "policy",
        "host tokens",
        "host blocks",
        "disk tokens",
        "disk blocks",
        "hit rate",
        "matched tokens",
        "from disk"
    );
    for p in points {
        let _ = writeln!(
            out,
            "  {:<10} {:>12} {:>11} {:>12} {:>11} {:>8.2}% {:>14} {:>11}",
            p.policy.to_string(),
            p.host_tokens,
            p.host_blocks,
            p.disk_tokens,
            p.disk_blocks,
            p.hit_pct(),
            p.matched,
            p.from_disk
        );
    }
    let _ = writeln!(
        out,
        "  {:<10} {:>12} {:>11} {:>12} {:>11} {:>8.2}% {:>14} {:>11}",
        "unlimited",
        "-",
        unlimited.distinct_blocks,
        "-",
        "-",
        pct(unlimited.matched, unlimited.prompt),
        unlimited.matched,
        "-"
    );
    out
}

/// `--plot`'s path must be a file this process can write: in an existing directory, and a regular
/// file if it exists (a device such as /dev/full, a FIFO or a directory is refused). Checked by
/// opening it for writing without truncating; a file created by the check is removed again, so a
/// sweep that fails later leaves nothing behind.
pub fn check_plot_path(path: &Path) -> Result<()> {
    let bad = |why: String| {
        Err(
            Error::invalid_argument(format!("--plot {}: {why}", path.display()))
                .with("flag", "--plot"),
        )
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return bad(format!("{} is not a directory", parent.display()));
    }
    let existed = match std::fs::metadata(path) {
        Ok(m) if m.is_file() => true,
        Ok(m) if m.is_dir() => return bad("is a directory; name the SVG file to write".into()),
        Ok(_) => return bad("is not a regular file; name the SVG file to write".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return bad(format!("cannot be read: {e}")),
    };
    if let Err(e) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
    {
        return bad(format!("cannot be written: {e}"));
    }
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Writes the SVG plot: hit rate (%) over host capacity (tokens, log scale), one line per
/// policy (and per policy with the disk tier), and the unlimited cache's line.
pub fn draw_plot(
    path: &Path,
    title: &str,
    points: &[Point],
    unlimited: &Unlimited,
    block_size: usize,
) -> Result<()> {
    draw_lines(path, title, &plot_series(points), unlimited, block_size)
}

/// Writes an SVG plot of hit rate (%) over host capacity (tokens, log scale): one line per
/// series (its legend name and its (host tokens, hit rate) points, in any order), and the
/// unlimited cache's line.
pub fn draw_lines(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    unlimited: &Unlimited,
    block_size: usize,
) -> Result<()> {
    use plotters::prelude::*;
    let fail = |e: &dyn std::fmt::Display| {
        Error::new(
            ErrorKind::Io,
            format!("cannot draw the plot {}: {e}", path.display()),
        )
    };
    let (lo, hi, keys) = x_axis(series);
    let unl = pct(unlimited.matched, unlimited.prompt);
    let top = y_top(series, unl);
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((lo..hi).log_scale().with_key_points(keys), 0.0..top)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("host cache capacity (tokens, log scale)")
        .y_desc("prefix hit rate (% of prompt tokens)")
        .x_label_formatter(&|x| human(*x))
        .y_label_formatter(&|y| format!("{y:.0}%"))
        .draw()
        .map_err(|e| fail(&e))?;
    for (k, (name, mut pts)) in series.iter().cloned().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = PALETTE[k % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(|e| fail(&e))?;
    }
    let grey = RGBColor(90, 90, 90);
    chart
        .draw_series(LineSeries::new(
            vec![(lo, unl), (hi, unl)],
            grey.stroke_width(2),
        ))
        .map_err(|e| fail(&e))?
        .label(format!(
            "unlimited cache ({unl:.2}%; its {} distinct blocks hold {} tokens)",
            unlimited.distinct_blocks,
            human(unlimited.distinct_blocks as f64 * block_size as f64)
        ))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    drop(chart);
    drop(root);
    std::fs::write(path, svg).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot write the plot {}: {e}", path.display()),
        )
        .with("flag", "--plot")
    })
}

/// The plot's series colours, one per (policy, disk) series in turn.
const PALETTE: [plotters::style::RGBColor; 6] = {
    use plotters::style::RGBColor;
    [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
    ]
};

/// The plot's host-capacity axis: its range (the capacities plotted, widened by 1.5× each side;
/// a factor of 2 around a single capacity) and the key points labelled, the capacities plotted
/// (a log axis alone labels only powers of ten).
fn x_axis(series: &[(String, Vec<(f64, f64)>)]) -> (f64, f64, Vec<f64>) {
    let mut keys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .collect();
    let lo = keys.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = keys.iter().copied().fold(0.0_f64, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo / 1.5, hi * 1.5)
    } else {
        (lo.max(1.0) / 2.0, lo.max(1.0) * 2.0)
    };
    keys.sort_by(f64::total_cmp);
    keys.dedup();
    (lo, hi, keys)
}

/// The hit-rate axis' top: 15% above the highest rate (the unlimited cache's `unl` included, at
/// least 1%), rounded up to a multiple of 5.
fn y_top(series: &[(String, Vec<(f64, f64)>)], unl: f64) -> f64 {
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(unl, f64::max)
        .max(1.0);
    (top * 1.15 / 5.0).ceil() * 5.0
}

/// One series per (policy, disk) in plan order: its legend name and its (host tokens, hit rate)
/// points, unsorted.
fn plot_series(points: &[Point]) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for p in points {
        let name = if p.disk_tokens > 0 {
            format!("{}, host + {} disk", p.policy, human(p.disk_tokens as f64))
        } else {
            format!("{}, host only", p.policy)
        };
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push((p.host_tokens as f64, p.hit_pct())),
            None => series.push((name, vec![(p.host_tokens as f64, p.hit_pct())])),
        }
    }
    series
}

/// `1.5M`, `300K`, `800`.
pub fn human(x: f64) -> String {
    let trim = |v: f64, unit: &str| {
        let s = format!("{v:.1}");
        format!("{}{unit}", s.trim_end_matches(".0"))
    };
    if x >= 1e9 {
        trim(x / 1e9, "G")
    } else if x >= 1e6 {
        trim(x / 1e6, "M")
    } else if x >= 1e3 {
        trim(x / 1e3, "K")
    } else {
        format!("{x:.0}")
    }
}

/// Runs `kvbm sweep`.
pub fn run(a: &SweepArgs) -> Result<ExitCode> {
    if a.fleet.is_fleet() {
        return crate::fleet::run(a);
    }
    a.fleet.check_unused()?;
    check_args(a)?;
    let plans = plan_runs(a, &policies(a)?);
    let title = default_title(a);
    let started = Instant::now();
    let unl = unlimited(&a.replay)?;
    check_memory(a, &plans, &unl)?;
    let points = run_points(a, &plans)?;
    print!("{}", render_table(&title, &points, &unl));
    let verified: usize = points.iter().map(|p| p.verified).sum();
    let errors: usize = points.iter().map(|p| p.integrity_errors).sum();
    println!("  integrity errors {errors} ({verified} onboarded blocks verified)");
    if !a.replay.quiet {
        let walls: Vec<String> = points.iter().map(|p| format!("{:.1}", p.wall_s)).collect();
        eprintln!(
            "kvbm sweep: {} runs in {:.1} s (each, s: {})",
            points.len(),
            started.elapsed().as_secs_f64(),
            walls.join(" ")
        );
    }
    if let Some(path) = &a.plot {
        draw_plot(
            path,
            &format!("Prefix hit rate vs host capacity — {title}"),
            &points,
            &unl,
            a.replay.model.block_size,
        )?;
    }
    if points.iter().any(|p| p.integrity_errors > 0) {
        eprintln!("kvbm: onboarded blocks differed from the model's KV");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses, before any replay, a sweep whose `--jobs` runs at once would hold more than
/// `--memory-limit` (default: the memory available): each run's tiers' bookkeeping, its host
/// tier's bytes (at most the blocks the workload's tokens fill), its device cache and requests; the
/// `--jobs` largest runs summed. The error names the flag that costs most (`--capacities` for
/// the host tier).
fn check_memory(a: &SweepArgs, plans: &[Plan], unl: &Unlimited) -> Result<()> {
    let bs = a.replay.model.block_size;
    let mut runs = Vec::with_capacity(plans.len());
    for p in plans {
        let mut ra = a.replay.clone();
        ra.host_blocks = Some(blocks_of(p.host_tokens, bs, "--capacities")?);
        ra.disk_blocks = Some(if p.disk_tokens == 0 {
            0
        } else {
            blocks_of(p.disk_tokens, bs, "--disk-tokens")?
        });
        let mut config = replay_config(&ra)?;
        config.eviction = p.policy;
        let opts = sim_options(&ra, config)?;
        let waiting = (opts.max_waiting_tokens as u64).min(unl.prompt as u64);
        let mut e = crate::replay::engine_size(&opts, Some(unl.blocks_bound), waiting)?.estimate();
        for part in &mut e.parts {
            part.flag = match part.flag {
                "--host-blocks" => "--capacities",
                "--disk-blocks" => "--disk-tokens",
                f => f,
            };
        }
        runs.push(e);
    }
    let jobs = a.jobs.clamp(1, runs.len().max(1));
    runs.sort_by_key(|e| std::cmp::Reverse(e.total()));
    let mut all = crate::memory::Estimate::default();
    for e in runs.iter().take(jobs) {
        all.parts.extend(e.parts.iter().cloned());
    }
    all.check(
        &format!("kvbm sweep ({jobs} run(s) at once, --jobs)"),
        a.replay.memory_limit,
    )
}

/// Refuses the flags a sweep sets itself (--host-blocks, --disk-blocks) or cannot honour (--tp,
/// external workers), capacities and jobs out of bounds, and a `--plot` path that cannot be
/// written (checked before the sweep runs, minutes, not after it).
fn check_args(a: &SweepArgs) -> Result<()> {
    let flag = |f: &str, why: &str| Err(Error::invalid_argument(why.to_string()).with("flag", f));
    if a.replay.host_blocks.is_some() {
        return flag(
            "--host-blocks",
            "kvbm sweep sets the host tier per run: use --capacities",
        );
    }
    if a.replay.disk_blocks.is_some() {
        return flag(
            "--disk-blocks",
            "kvbm sweep sets the disk tier per run: use --disk-tokens",
        );
    }
    if a.replay.tp > 1 || a.replay.external_workers {
        return flag("--tp", "kvbm sweep replays in one process (--tp 1)");
    }
    if a.capacities.is_empty() {
        return flag(
            "--capacities",
            "kvbm sweep needs --capacities (host tokens, e.g. 1M,3M,10M)",
        );
    }
    if a.capacities.len() > MAX_POINTS {
        return flag(
            "--capacities",
            &format!("between 1 and {MAX_POINTS} capacities"),
        );
    }
    if a.jobs == 0 || a.jobs > 64 {
        return flag("--jobs", "--jobs is between 1 and 64");
    }
    if let Some(path) = &a.plot {
        check_plot_path(path)?;
    }
    Ok(())
}

/// The `--eviction` policies, parsed, each once, in the order first named.
fn policies(a: &SweepArgs) -> Result<Vec<EvictionPolicy>> {
    let mut policies: Vec<EvictionPolicy> = Vec::new();
    for p in &a.eviction {
        let p = parse_policy(p)?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    Ok(policies)
}

/// The runs, in this order: host only, then each `--disk-tokens`; within each, policy by policy;
/// within a policy, the distinct capacities from the smallest.
fn plan_runs(a: &SweepArgs, policies: &[EvictionPolicy]) -> Vec<Plan> {
    let mut caps = a.capacities.clone();
    caps.sort_unstable();
    caps.dedup();
    let mut plans = Vec::new();
    for disk in std::iter::once(0).chain(a.disk_tokens) {
        for p in policies {
            for &c in &caps {
                plans.push(Plan {
                    policy: *p,
                    host_tokens: c,
                    disk_tokens: disk,
                });
            }
        }
    }
    plans
}

/// `--title`, or the trace file's name (the workload and seed without one) and the block size.
pub fn default_title(a: &SweepArgs) -> String {
    a.title.clone().unwrap_or_else(|| match &a.replay.trace {
        Some(p) => format!(
            "{} (block {})",
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string()),
            a.replay.model.block_size
        ),
        None => format!(
            "{} workload, seed {} (block {})",
            a.replay.workload, a.replay.seed, a.replay.model.block_size
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts_take_powers_of_1000() {
        assert_eq!(parse_tokens("3000"), Ok(3000));
        assert_eq!(parse_tokens("1M"), Ok(1_000_000));
        assert_eq!(parse_tokens("2.5k"), Ok(2500));
        assert_eq!(parse_tokens(" 30M "), Ok(30_000_000));
        assert_eq!(parse_tokens("1G"), Ok(1_000_000_000));
        for bad in ["", "M", "-1M", "0", "1e20", "NaN", "3X", "1MM"] {
            assert!(parse_tokens(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn capacities_become_whole_blocks() {
        // The capacities: 1M, 3M, 10M tokens of 512-token blocks.
        assert_eq!(blocks_of(1_000_000, 512, "f").ok(), Some(1953));
        assert_eq!(blocks_of(3_000_000, 512, "f").ok(), Some(5859));
        assert_eq!(blocks_of(10_000_000, 512, "f").ok(), Some(19531));
        assert!(blocks_of(511, 512, "--capacities").is_err());
    }

    #[test]
    fn policies_parse_like_the_configuration() {
        assert_eq!(parse_policy("LRU").ok(), Some(EvictionPolicy::Lru));
        assert!(parse_policy("mru")
            .err()
            .is_some_and(|e| e.to_string().contains("known: ")));
    }

    #[test]
    fn axis_labels_are_short() {
        assert_eq!(human(1_500_000.0), "1.5M");
        assert_eq!(human(3_000_000.0), "3M");
        assert_eq!(human(500_000.0), "500K");
        assert_eq!(human(800.0), "800");
    }
}
