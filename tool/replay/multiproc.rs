//! Multi-process replays: the engine stand-in and the leader in this process, one `kvbm worker`
//! process per tensor-parallel rank.
//!
//! Two channels connect them, both on loopback by default:
//! * the connector's own transport ([`kvbm_connector::tcp`]): barrier and completions;
//! * the simulated engine's channel ([`super::channel`]): per-iteration commands, as a real engine
//!   drives its GPU processes.
//!
//! With `--external-workers` the replay does not start the workers: they are started by hand
//! (before or after it) with `kvbm worker --rank N ...` pointing at `--leader-addr` and
//! `--engine-addr`.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::config::auth_token_from_env;
use kvbm_connector::config::{Config, TcpConfig};
use kvbm_connector::error::{Error, Result};
use kvbm_connector::tcp::{TcpLeader, TcpWorker};

use super::channel::{accept_ranks, serve, write_frame};
use super::engines::engine_of;
use super::framework::Framework;
use super::messages::RankDriver;
use super::model::Shard;
use super::options::SimOptions;
use super::rank::{DeviceKind, RankExecutor};
use super::report::Report;
use super::simulator::{Simulator, Source};
use super::wait_for;
use crate::ModelArgs;

/// `kvbm worker` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// This worker's rank.
    #[arg(long)]
    pub rank: usize,
    /// Ranks in all.
    #[arg(long)]
    pub world_size: usize,
    /// The leader's transport address.
    #[arg(long)]
    pub leader_addr: SocketAddr,
    /// The engine's command channel address.
    #[arg(long)]
    pub engine_addr: SocketAddr,
    /// Engine to imitate.
    #[arg(long, value_enum, default_value_t = Framework::Trtllm)]
    pub framework: Framework,
    /// Model shape (of the whole model; this rank holds 1/world_size of the KV heads).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Device blocks.
    #[arg(long, default_value_t = 320)]
    pub device_blocks: usize,
    /// What backs the device cache.
    #[arg(long, value_enum, default_value_t = DeviceKind::Memory)]
    pub device: DeviceKind,
    /// KV-cache groups sharing the device cache (the engine's `--layer-groups` count).
    #[arg(long, default_value_t = 1)]
    pub kv_groups: usize,
    /// Configuration file (TOML); the environment still overrides it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory of the disk tier's file (overrides the configuration).
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
}

/// Runs `kvbm worker`: joins the leader, registers this rank's device shard, then serves the
/// engine's commands until the engine finishes.
pub fn run_worker(a: &WorkerArgs) -> Result<ExitCode> {
    let mut config = Config::load(a.config.as_deref())?;
    if let Some(d) = &a.disk_dir {
        config.disk.dir = d.clone();
    }
    if a.world_size == 0 || a.rank >= a.world_size {
        return Err(Error::invalid_argument(format!(
            "rank {} is not below world size {}",
            a.rank, a.world_size
        )));
    }
    let heads = a.model.kv_heads;
    if heads % a.world_size != 0 {
        return Err(Error::invalid_argument(format!(
            "{heads} KV heads cannot be split evenly over {} ranks",
            a.world_size
        )));
    }
    let dims = kvbm_connector::layout::LayoutDims {
        num_layers: a.model.layers,
        outer_dim: 2,
        page_size: a.model.block_size,
        inner_dim: heads / a.world_size * a.model.head_dim,
        dtype_bytes: a.model.dtype_bytes,
    };
    dims.validate()?;
    let deadline = config.init_timeout();
    let transport: Arc<TcpWorker> = TcpWorker::connect(
        a.leader_addr,
        a.rank,
        a.world_size,
        auth_token_from_env(),
        deadline,
    )?;
    let exec = RankExecutor::new(
        a.framework,
        a.device,
        config,
        Shard { rank: a.rank, dims },
        a.device_blocks,
        a.world_size,
        a.kv_groups,
        transport.clone(),
        None,
    )?;
    wait_for(&format!("rank {}", a.rank), deadline, || {
        match exec.init_error() {
            Some(e) => Err(e),
            None => Ok(exec.is_ready()),
        }
    })?;
    let until = Instant::now() + deadline;
    let mut stream = connect_retry(a.engine_addr, until)?;
    write_frame(&mut stream, &a.rank)?;
    let leader_lost = move || {
        (!transport.is_connected())
            .then(|| "the connection to the kvbm leader is lost (see its warning)".to_string())
    };
    serve(exec, stream, &leader_lost)?;
    Ok(ExitCode::SUCCESS)
}

fn connect_retry(addr: SocketAddr, until: Instant) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => {
                if Instant::now() > until {
                    return Err(Error::io("connect to the engine channel", e).with("addr", addr));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Where the multi-process replay listens, and whether it starts its workers.
#[derive(Debug, Clone)]
pub struct Topology {
    /// The leader's transport address (port 0: any free port).
    pub leader_addr: SocketAddr,
    /// The engine channel address (port 0: any free port).
    pub engine_addr: SocketAddr,
    /// Do not start workers; wait for them to be started by hand.
    pub external_workers: bool,
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Runs a replay with one worker process per rank.
pub fn replay(opts: SimOptions, workload: Source, topo: &Topology) -> Result<Report> {
    opts.model_dims()?;
    opts.check_workload(&[])?;
    let tp = opts.tp;
    let tcp = TcpConfig {
        auth_token: auth_token_from_env(),
        ..opts.config.tcp.clone()
    };
    // The engine channel has no authentication: loopback unless explicitly insecure.
    tcp.check_listen("replay's engine channel", topo.engine_addr, false)?;
    let leader_transport = TcpLeader::bind_with(topo.leader_addr, tp, &tcp)?;
    let leader_addr = leader_transport.local_addr();
    let listener = TcpListener::bind(topo.engine_addr)
        .map_err(|e| Error::io("bind the engine channel", e).with("addr", topo.engine_addr))?;
    let engine_addr = listener
        .local_addr()
        .map_err(|e| Error::io("read the engine channel address", e))?;
    // The workers read the same configuration: write it to a file they are pointed at.
    let config_path = write_private_file(
        &std::env::temp_dir(),
        "kvbm-replay",
        opts.config.to_toml()?.as_bytes(),
    )?;
    let mut children = Vec::new();
    if topo.external_workers {
        let m = opts.model;
        eprintln!(
            "kvbm: waiting for {tp} workers: kvbm worker --rank R --world-size {tp} --leader-addr {leader_addr} --engine-addr {engine_addr} --framework {} --device-blocks {} --block-size {} --layers {} --kv-heads {} --head-dim {} --dtype-bytes {} --config {}",
            opts.framework,
            opts.device_blocks,
            opts.block_size,
            m.layers,
            m.kv_heads,
            m.head_dim,
            m.dtype_bytes,
            config_path.display()
        );
    } else {
        let exe = std::env::current_exe().map_err(|e| Error::io("find the kvbm executable", e))?;
        let m = opts.model;
        for rank in 0..tp {
            let child = Command::new(&exe)
                .arg("worker")
                .args(["--rank", &rank.to_string()])
                .args(["--world-size", &tp.to_string()])
                .args(["--leader-addr", &leader_addr.to_string()])
                .args(["--engine-addr", &engine_addr.to_string()])
                .args(["--framework", &opts.framework.to_string()])
                .args(["--block-size", &opts.block_size.to_string()])
                .args(["--layers", &m.layers.to_string()])
                .args(["--kv-heads", &m.kv_heads.to_string()])
                .args(["--head-dim", &m.head_dim.to_string()])
                .args(["--dtype-bytes", &m.dtype_bytes.to_string()])
                .args(["--device-blocks", &opts.device_blocks.to_string()])
                .args(["--device", &opts.device.to_string()])
                .args(["--kv-groups", &opts.n_groups().to_string()])
                .arg("--config")
                .arg(&config_path)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn();
            match child {
                Ok(c) => children.push(c),
                Err(e) => {
                    kill_all(&mut children);
                    let _ = std::fs::remove_file(&config_path);
                    return Err(Error::io("start a worker process", e).with("rank", rank));
                }
            }
        }
    }
    let result = connect(opts, workload, leader_transport, &listener, children);
    let _ = std::fs::remove_file(&config_path);
    let engine = result?;
    engine.run()
}

/// How many names [`write_private_file`] tries before giving up.
const PRIVATE_NAME_ATTEMPTS: u32 = 64;

/// Writes `contents` to a new file `<stem>-<pid>-<n>.toml` in `dir`, created with
/// `O_CREAT | O_EXCL | O_NOFOLLOW` and mode `0600`: a name planted by someone else (a symlink to
/// a file of theirs or ours, a file) is never followed or written, another name is tried. Returns
/// the path.
fn write_private_file(dir: &std::path::Path, stem: &str, contents: &[u8]) -> Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let pid = std::process::id();
    let mut last = None;
    for n in 0..PRIVATE_NAME_ATTEMPTS {
        let path = dir.join(format!("{stem}-{pid}-{n}.toml"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path);
        match file {
            Ok(mut f) => {
                return match f.write_all(contents) {
                    Ok(()) => Ok(path),
                    Err(e) => {
                        let _ = std::fs::remove_file(&path);
                        Err(Error::io("write the workers' configuration", e)
                            .with("path", path.display()))
                    }
                };
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((path, e)),
            Err(e) => {
                return Err(
                    Error::io("create the workers' configuration", e).with("path", path.display())
                )
            }
        }
    }
    Err(match last {
        Some((path, e)) => {
            Error::io("create the workers' configuration", e).with("path", path.display())
        }
        None => Error::internal("no configuration file name was tried"),
    })
}

fn connect(
    opts: SimOptions,
    workload: Source,
    leader_transport: Arc<TcpLeader>,
    listener: &TcpListener,
    mut children: Vec<Child>,
) -> Result<Simulator> {
    let tp = opts.tp;
    let timeout = opts.config.init_timeout();
    // TensorRT-LLM: the scheduler starts non-blocking; vLLM: blocking (workers registered).
    let sched = match engine_of(opts.framework).scheduler(
        opts.config.clone(),
        opts.block_size,
        leader_transport.clone(),
        &opts.groups,
    ) {
        Ok(s) => s,
        Err(e) => {
            kill_all(&mut children);
            return Err(e);
        }
    };
    // Each worker connects to the engine channel once its barrier finished. A little longer than
    // the barrier's own deadline, so its error (which names the missing ranks) comes first.
    let until = Instant::now() + timeout + Duration::from_secs(2);
    // The barrier's own error (naming the ranks it misses) beats ours.
    let ranks = accept_ranks(
        listener,
        tp,
        until,
        timeout,
        &leader_transport,
        opts.config.tcp.call_timeout(),
        || sched.leader().init_error().map_or(Ok(()), Err),
    );
    let ranks = match ranks {
        Ok(r) => r,
        Err(e) => {
            kill_all(&mut children);
            return Err(e);
        }
    };
    leader_transport.mark_session_started();
    let drivers: Vec<Box<dyn RankDriver>> = ranks
        .into_iter()
        .map(|r| Box::new(r) as Box<dyn RankDriver>)
        .collect();
    Simulator::assemble(opts, workload, sched, drivers, children)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 13, item 8: a symlink planted where the workers' configuration goes is not followed
    /// (its target keeps its bytes); the file is written under another name, mode 0600.
    #[test]
    fn planted_symlink_is_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temporary directory");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").expect("write victim");
        let planted = dir
            .path()
            .join(format!("kvbm-replay-{}-0.toml", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).expect("plant symlink");
        let path = write_private_file(dir.path(), "kvbm-replay", b"hash = \"xxh3\"\n")
            .expect("written elsewhere");
        assert_ne!(path, planted);
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
        assert_eq!(std::fs::read(&path).expect("config"), b"hash = \"xxh3\"\n");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
