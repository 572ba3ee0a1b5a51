//! Configuration: one struct, read from a TOML file and overridden by environment variables.
//!
//! Precedence, lowest first: built-in defaults, the TOML file (`--config` or `KVBM_CONFIG`),
//! Dynamo's `DYN_KVBM_*` names (so their users can switch without edits), our `KVBM_*` names.
//! Every variable is listed in [`ENV_VARS`] with what it sets. Sizes in GB are decimal (1 GB =
//! 1e9 bytes). An invalid value is an [`ErrorKind::InvalidConfig`](crate::ErrorKind) error naming
//! the variable (or file key) and the value.
//!
//! ```toml
//! hash = "sha256"          # or "xxh3" (trusted single-tenant deployments only)
//! eviction = "prefix"      # host and disk eviction: "prefix" (default), "lru" or "2q"
//!
//! [host]
//! cache_gb = 4.0           # or cache_blocks = 1024 (a block count wins over GB)
//!
//! [disk]
//! cache_gb = 50.0
//! dir = "/mnt/nvme/kvbm"
//! min_frequency = 2        # offload to disk only blocks seen twice; 1 admits all
//! direct_io = true
//! persist = false
//!
//! [transfer]
//! max_concurrency = 4
//! batch_blocks = 16
//! load_timeout_secs = 10.0 # a load from disk/remote past this is a load error
//! copy_method = "auto"     # large memory copies: auto (measured), plain, stream or stream-pages
//! inline_device_copies = true # a device tier in host memory (CPU engines): copy on the engine's thread
//!
//! [remote]                 # the shared G4 tier (Redis / Valkey); off without url
//! url = "redis://:pass@10.0.0.5:6379/0"  # or rediss://..., redis+cluster://h1:p1,h2:p2
//! secret_file = "/etc/kvbm/remote.secret" # MAC key for values (or KVBM_REMOTE_SECRET)
//! namespace = "llama-3-8b-instruct@rev2"  # model identity in the keys' scope
//! lookup_timeout_ms = 5    # a synchronous lookup past this is a miss (TensorRT-LLM)
//! io_timeout_ms = 2000     # one write batch, or a background lookup
//! load_timeout_ms = 500    # one read batch of a load: past it a load error, recomputed
//! lookup_wait_ms = 50      # vLLM: how long a request waits for its lookup (then a miss)
//! slow_ms = 50             # median store latency above which the store counts as slow
//! backoff_secs = 5         # a slow or unavailable store is left out this long (doubling to 60 s)
//! min_frequency = 1        # write blocks to the store once seen this many times in host
//! ttl_secs = 86400         # values expire after a day (default: none; maxmemory evicts)
//! tls_ca_file = "/etc/kvbm/redis-ca.pem"      # rediss:// signed by a private CA (default: system roots)
//! tls_cert_file = "/etc/kvbm/redis-client.pem" # client certificate, for tls-auth-clients yes
//! tls_key_file = "/etc/kvbm/redis-client.key"  # its private key
//!
//! [tcp]                    # the network transport (connector::tcp)
//! leader_addr = "10.0.0.1:5557"
//! auth_token = "s3cret"    # never written back out (to_toml, Debug)
//! rendezvous_dir = "/run/user/1000/kvbm-1000"  # private (0700) directory of rendezvous files
//! heartbeat_secs = 1.0     # leader <-> worker heartbeat interval
//! heartbeat_timeout_secs = 10.0  # silence after which a peer counts as lost
//! call_timeout_secs = 60.0 # deadline of one request/answer across processes
//! allow_insecure = false   # allow listening on a non-loopback address without a token
//! metrics_addr = "127.0.0.1:9400"  # serve GET /metrics (Prometheus text); workers: port + 1 + rank
//! ```

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::identity::HashAlgorithm;
use crate::pool::EvictionPolicy;

mod remote;

pub use remote::*;

/// Decimal gigabyte.
pub const GB: f64 = 1e9;

/// The host tier's size in GB when no host or disk size is set at all (see
/// [`Config::block_counts`]); [`default_host_cache_gb`] caps it at a quarter of the machine's
/// memory.
pub const DEFAULT_HOST_CACHE_GB: f64 = 4.0;

/// [`DEFAULT_HOST_CACHE_GB`], or a quarter of the machine's memory (`MemTotal` of
/// `/proc/meminfo`) when that is less; [`DEFAULT_HOST_CACHE_GB`] where it cannot be read.
pub fn default_host_cache_gb() -> f64 {
    let total_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        });
    match total_kb {
        Some(kb) if kb > 0.0 => DEFAULT_HOST_CACHE_GB.min(kb * 1024.0 / 4.0 / GB),
        _ => DEFAULT_HOST_CACHE_GB,
    }
}

/// Size of one cache tier: GB or an explicit block count (which wins when both are set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierSize {
    /// Capacity in decimal GB. Default: unset (tier off unless `cache_blocks` is set).
    pub cache_gb: Option<f64>,
    /// Capacity in blocks; overrides `cache_gb`. Default: unset.
    pub cache_blocks: Option<usize>,
}

impl TierSize {
    /// Block count for blocks of `bytes_per_block`: the override if set, else
    /// `floor(cache_gb × 1e9 / bytes_per_block)`, else 0 (tier off).
    pub fn blocks(&self, bytes_per_block: usize) -> Result<usize> {
        if let Some(n) = self.cache_blocks {
            return Ok(n);
        }
        let Some(gb) = self.cache_gb else {
            return Ok(0);
        };
        if bytes_per_block == 0 {
            return Err(Error::invalid_argument("bytes_per_block must be non-zero"));
        }
        // Validated finite and >= 0; the cast saturates for absurd sizes.
        Ok((gb * GB / bytes_per_block as f64).floor() as usize)
    }

    fn validate(&self, key: &str) -> Result<()> {
        if let Some(gb) = self.cache_gb {
            if !gb.is_finite() || gb < 0.0 {
                return Err(Error::invalid_config(
                    &format!("{key}.cache_gb"),
                    gb,
                    "must be a finite number >= 0",
                ));
            }
        }
        Ok(())
    }
}

/// How the disk tier does its I/O.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
pub enum DiskIo {
    /// The crate's own disk tier: positional vectored I/O (`preadv`/`pwritev`) on one file.
    #[default]
    Builtin,
    /// Through NIXL's POSIX plugin (needs the `nixl` feature).
    Nixl,
}

/// The disk (G3) tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskConfig {
    /// Capacity in decimal GB. Default: unset (disk tier off unless `cache_blocks` is set).
    pub cache_gb: Option<f64>,
    /// Capacity in blocks; overrides `cache_gb`. Default: unset.
    pub cache_blocks: Option<usize>,
    /// Directory for the tier's file. Default: `$TMPDIR/kvbm-<uid>` (system temp dir; one per
    /// user, created `0700`). Must not be empty. Only its last component is created (`0700`);
    /// a directory owned by another user (not root) or writable by others without the sticky
    /// bit is refused (the disk tier's `DiskTierOptions::dir`).
    pub dir: PathBuf,
    /// Offload a block to disk only after it was seen this many times; 1 admits every block.
    /// Default: 1.
    pub min_frequency: u32,
    /// Use O_DIRECT where the filesystem allows it. Default: true.
    pub direct_io: bool,
    /// Keep the file after shutdown (for inspection; its contents are not reloaded). Default: false.
    pub persist: bool,
    /// Parallel I/O requests the tier keeps in flight. Default: 4.
    pub max_in_flight: usize,
    /// Who does the disk I/O: `builtin` or `nixl` (needs the `nixl` feature). Default: builtin.
    pub io: DiskIo,
}

impl Default for DiskConfig {
    fn default() -> Self {
        Self {
            cache_gb: None,
            cache_blocks: None,
            dir: default_disk_dir(),
            min_frequency: 1,
            direct_io: true,
            persist: false,
            max_in_flight: 4,
            io: DiskIo::Builtin,
        }
    }
}

/// `$TMPDIR/kvbm-<uid>`: private to the user, so users of one machine never share (or fight
/// over) the default directory.
fn default_disk_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("kvbm-{uid}"))
}

/// The transfer engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferConfig {
    /// Batches of block copies running at once, over all transfers of one kind: a worker bounds
    /// its memory copies (device ↔ host) and its I/O copies (disk, remote) separately, so stuck
    /// I/O never holds up memory copies. Default: 4.
    pub max_concurrency: usize,
    /// Blocks per batch (one blocking task). Default: 16.
    pub batch_blocks: usize,
    /// Deadline of one load from a tier that does I/O (disk, remote), in seconds
    /// (`KVBM_LOAD_TIMEOUT_SECS`). A load still running then is reported as failed — its device
    /// blocks are load errors the engine recomputes — while the stuck I/O finishes in the
    /// background into a buffer that is dropped. Default: [`DEFAULT_LOAD_TIMEOUT_SECS`] (10 s): a
    /// healthy load of even a long prefix (gigabytes at disk bandwidth) takes well under that,
    /// while recomputing a prefill takes seconds at most — past 10 s waiting costs more than it
    /// saves, and a frozen or failing disk must not hold a request (and its batch) longer.
    pub load_timeout_secs: f64,
    /// How transfers of at least 4 MiB between two memory tiers store their bytes
    /// (`KVBM_COPY_METHOD`): `auto` (the fastest of ordinary stores and two streaming-store
    /// loops on this machine, measured once per process by the first large transfer; see
    /// [`crate::transfer::calibrate`]), `plain`, `stream` (streaming stores, one line after the
    /// other) or `stream-pages` (streaming stores to four pages in turn). Default: `auto`.
    pub copy_method: crate::transfer::CopyPolicy,
    /// Where the device tier is itself host memory (an engine on the CPU: its "device" KV cache
    /// is ordinary tensors), copies between it and another memory tier run on the engine's own
    /// thread inside the call that submits them — loads in `start_load_kv`, stores when the
    /// forward pass is done — instead of on the worker's copy threads
    /// (`KVBM_INLINE_DEVICE_COPIES`). Such a copy is a `memcpy` of the step's blocks (a few
    /// milliseconds at most); on a host whose cores are all busy a copy thread waits for a time
    /// slice first, and meanwhile a finished request keeps its device blocks and a loading one
    /// its place in the queue. No effect with a GPU, or on copies to or from disk or the remote
    /// store. Default: `true`.
    pub inline_device_copies: bool,
}

/// [`TransferConfig::load_timeout_secs`] when unset.
pub const DEFAULT_LOAD_TIMEOUT_SECS: f64 = 10.0;

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            max_concurrency: 4,
            batch_blocks: 16,
            load_timeout_secs: DEFAULT_LOAD_TIMEOUT_SECS,
            copy_method: crate::transfer::CopyPolicy::Auto,
            inline_device_copies: true,
        }
    }
}

impl TransferConfig {
    /// The load deadline ([`TransferConfig::load_timeout_secs`]).
    pub fn load_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.load_timeout_secs)
    }

    fn validate(&self) -> Result<()> {
        if !(self.load_timeout_secs.is_finite()
            && self.load_timeout_secs > 0.0
            && self.load_timeout_secs <= 1e6)
        {
            return Err(Error::invalid_config(
                "transfer.load_timeout_secs",
                self.load_timeout_secs,
                "must be a number of seconds > 0 (at most 1e6)",
            ));
        }
        Ok(())
    }
}

/// The environment variable naming the remote store ([`RemoteConfig::url`]).
pub const REMOTE_URL_ENV: &str = "KVBM_REMOTE_URL";
/// The environment variable holding the remote store's deployment secret
/// ([`RemoteConfig::secret`]).
pub const REMOTE_SECRET_ENV: &str = "KVBM_REMOTE_SECRET";
/// The environment variable naming the leader's address ([`TcpConfig::leader_addr`]).
pub const LEADER_ADDR_ENV: &str = "KVBM_LEADER_ADDR";
/// The environment variable holding the shared secret workers present ([`TcpConfig::auth_token`]).
pub const AUTH_TOKEN_ENV: &str = "KVBM_AUTH_TOKEN";
/// The environment variable naming where the metrics endpoint listens ([`TcpConfig::metrics_addr`]).
pub const METRICS_ADDR_ENV: &str = "KVBM_METRICS_ADDR";
/// The leader's address when none is set (loopback).
pub const DEFAULT_LEADER_ADDR: &str = "127.0.0.1:5557";
/// The environment variable naming the private directory of rendezvous files
/// ([`TcpConfig::rendezvous_dir`]).
pub const RENDEZVOUS_DIR_ENV: &str = "KVBM_RENDEZVOUS_DIR";
/// The environment variable setting [`TcpConfig::heartbeat_secs`].
pub const HEARTBEAT_ENV: &str = "KVBM_HEARTBEAT_SECS";
/// The environment variable setting [`TcpConfig::heartbeat_timeout_secs`].
pub const HEARTBEAT_TIMEOUT_ENV: &str = "KVBM_HEARTBEAT_TIMEOUT_SECS";
/// The environment variable setting [`TcpConfig::call_timeout_secs`].
pub const CALL_TIMEOUT_ENV: &str = "KVBM_CALL_TIMEOUT_SECS";
/// The environment variable setting [`TcpConfig::allow_insecure`].
pub const ALLOW_INSECURE_ENV: &str = "KVBM_ALLOW_INSECURE";
/// Default of [`TcpConfig::heartbeat_secs`].
pub const DEFAULT_HEARTBEAT_SECS: f64 = 1.0;
/// Default of [`TcpConfig::heartbeat_timeout_secs`].
pub const DEFAULT_HEARTBEAT_TIMEOUT_SECS: f64 = 10.0;
/// Default of [`TcpConfig::call_timeout_secs`].
pub const DEFAULT_CALL_TIMEOUT_SECS: f64 = 60.0;

/// The network transport between the leader and its workers (`connector::tcp`).
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TcpConfig {
    /// Where the leader listens and its workers connect: `ip:port`, `[ipv6]:port` or
    /// `host:port` (resolved when used; the first address wins). Default: unset, meaning
    /// [`DEFAULT_LEADER_ADDR`] (loopback only).
    pub leader_addr: Option<String>,
    /// The shared secret every worker presents to the leader; unset or empty means none. Never
    /// written back out: [`Config::to_toml`], the JSON form and `Debug` leave it out. Default:
    /// unset.
    #[serde(skip_serializing)]
    pub auth_token: Option<String>,
    /// The private directory where a leader publishes its rendezvous file (address, one-time
    /// token, pid) for workers on the same machine (`connector::tcp::rendezvous`). Created
    /// 0700 when missing; refused when it is a symlink, not owned by this user or open to
    /// others. Default: unset, meaning `$XDG_RUNTIME_DIR/kvbm-<uid>`, else
    /// `<temp dir>/kvbm-<uid>`.
    pub rendezvous_dir: Option<PathBuf>,
    /// Seconds between two heartbeat frames on each leader <-> worker connection (both ways; the
    /// leader announces its value to its workers in the handshake). Default: unset, meaning
    /// [`DEFAULT_HEARTBEAT_SECS`] (1 s): 12 bytes a second per direction and rank, cheap enough
    /// to send unconditionally, and ten of them fit in the default timeout.
    pub heartbeat_secs: Option<f64>,
    /// Seconds without any frame from a peer after which the connection counts as lost: the
    /// leader treats the rank exactly as a killed worker ([`WorkerMessage::Disconnected`]), the
    /// worker its leader as gone. At least twice `heartbeat_secs`. Heartbeats come from a thread
    /// (worker) and a runtime task (leader) of their own, outside the engine's locks and Python's
    /// GIL, so an idle or busy peer keeps beating; only a stopped, frozen or unreachable one
    /// misses ten in a row. Default: unset, meaning [`DEFAULT_HEARTBEAT_TIMEOUT_SECS`] (10 s, the
    /// order of vLLM's own RPC timeout; TCP itself would notice a silent peer only after its
    /// retransmissions give up, about 15 minutes).
    ///
    /// [`WorkerMessage::Disconnected`]: crate::connector::transport::WorkerMessage::Disconnected
    pub heartbeat_timeout_secs: Option<f64>,
    /// Seconds one request/answer exchange across processes may take before the peer counts as
    /// lost (the `kvbm` replay's engine channel: one rank's step, verification or final drain).
    /// Covers a rank that is alive and heartbeating but stuck. Default: unset, meaning
    /// [`DEFAULT_CALL_TIMEOUT_SECS`] (60 s: a rank's final drain waits for its background
    /// transfers, which the replay itself allows 60 s).
    pub call_timeout_secs: Option<f64>,
    /// Allow the leader (and the `kvbm` replay's engine channel) to listen on a non-loopback
    /// address without an auth token (the engine channel has no token at all). Without it, such
    /// a bind is an [`ErrorKind::InvalidConfig`] error naming [`AUTH_TOKEN_ENV`] and
    /// [`ALLOW_INSECURE_ENV`]: anyone who reaches the port could join as a worker. Default: false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_insecure: bool,
    /// Where the leader serves its counters over HTTP (`GET /metrics`, Prometheus text;
    /// `connector::metrics_server`): `ip:port`; each worker serves its own transfer counters on
    /// the same IP at port + 1 + rank. Default: unset, meaning no endpoint (nothing listens
    /// unless asked). A non-loopback address follows the rule of [`Self::check_listen`]
    /// with no token (the endpoint has none): refused unless [`Self::allow_insecure`]. Port 0
    /// picks a free port ([`Leader::metrics_addr`] says which).
    ///
    /// [`Leader::metrics_addr`]: crate::connector::leader::Leader::metrics_addr
    pub metrics_addr: Option<SocketAddr>,
}

impl std::fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConfig")
            .field("leader_addr", &self.leader_addr)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .field("rendezvous_dir", &self.rendezvous_dir)
            .field("heartbeat_secs", &self.heartbeat_secs)
            .field("heartbeat_timeout_secs", &self.heartbeat_timeout_secs)
            .field("call_timeout_secs", &self.call_timeout_secs)
            .field("allow_insecure", &self.allow_insecure)
            .field("metrics_addr", &self.metrics_addr)
            .finish()
    }
}

impl TcpConfig {
    /// The leader's address: `leader_addr` resolved, else [`DEFAULT_LEADER_ADDR`]. An address
    /// that does not resolve is an [`ErrorKind::InvalidConfig`] error naming [`LEADER_ADDR_ENV`]
    /// and the value.
    pub fn leader_addr(&self) -> Result<SocketAddr> {
        leader_addr_from(self.leader_addr.as_deref())
    }

    /// The shared secret, if any (an empty one counts as none).
    pub fn auth_token(&self) -> Option<String> {
        self.auth_token.clone().filter(|t| !t.is_empty())
    }

    /// The rendezvous directory: `rendezvous_dir`, else the default (see the field).
    pub fn rendezvous_dir(&self) -> PathBuf {
        self.rendezvous_dir
            .clone()
            .unwrap_or_else(crate::connector::tcp::rendezvous::default_dir)
    }

    /// The heartbeat interval ([`Self::heartbeat_secs`] or its default).
    pub fn heartbeat(&self) -> Duration {
        secs(self.heartbeat_secs, DEFAULT_HEARTBEAT_SECS)
    }

    /// The heartbeat timeout ([`Self::heartbeat_timeout_secs`] or its default).
    pub fn heartbeat_timeout(&self) -> Duration {
        secs(self.heartbeat_timeout_secs, DEFAULT_HEARTBEAT_TIMEOUT_SECS)
    }

    /// The per-call deadline ([`Self::call_timeout_secs`] or its default).
    pub fn call_timeout(&self) -> Duration {
        secs(self.call_timeout_secs, DEFAULT_CALL_TIMEOUT_SECS)
    }

    /// Whether a listener may bind `addr`: a loopback address always; another one only with
    /// `has_token` (an authenticated protocol) or [`Self::allow_insecure`]. The error, an
    /// [`ErrorKind::InvalidConfig`], names `what` listens, the address and both settings.
    pub fn check_listen(&self, what: &str, addr: SocketAddr, has_token: bool) -> Result<()> {
        if addr.ip().is_loopback() || has_token || self.allow_insecure {
            return Ok(());
        }
        let fix = if what.contains("engine channel") {
            format!("it has no authentication; set {ALLOW_INSECURE_ENV}=1 (tcp.allow_insecure) to accept that")
        } else {
            format!("set {AUTH_TOKEN_ENV} (tcp.auth_token) on the leader and every worker, or {ALLOW_INSECURE_ENV}=1 (tcp.allow_insecure) to accept that")
        };
        Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "refusing to listen for the {what} on the non-loopback address {addr} without authentication: anyone who reaches it could join; {fix}"
            ),
        )
        .with("addr", addr)
        .with("setting", ALLOW_INSECURE_ENV))
    }

    /// True when nothing written out is set (the section is then left out of the TOML form).
    fn nothing_to_write(&self) -> bool {
        self.leader_addr.is_none()
            && self.rendezvous_dir.is_none()
            && self.heartbeat_secs.is_none()
            && self.heartbeat_timeout_secs.is_none()
            && self.call_timeout_secs.is_none()
            && !self.allow_insecure
            && self.metrics_addr.is_none()
    }

    /// Checks the deadlines' ranges (the timeout at least twice the interval).
    fn validate_deadlines(&self) -> Result<()> {
        for (key, v) in [
            ("tcp.heartbeat_secs", self.heartbeat_secs),
            ("tcp.heartbeat_timeout_secs", self.heartbeat_timeout_secs),
            ("tcp.call_timeout_secs", self.call_timeout_secs),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && (0.001..=1e6).contains(&v)) {
                    return Err(Error::invalid_config(
                        key,
                        v,
                        "must be a number of seconds from 0.001 to 1000000",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the settings that constrain each other (once all are set: the environment may set
    /// them in any order): the heartbeat timeout is at least twice the interval.
    fn validate_relations(&self) -> Result<()> {
        let (beat, timeout) = (self.heartbeat(), self.heartbeat_timeout());
        if timeout < beat * 2 {
            return Err(Error::invalid_config(
                &format!("tcp.heartbeat_timeout_secs ({HEARTBEAT_TIMEOUT_ENV})"),
                timeout.as_secs_f64(),
                format!(
                    "must be at least twice the heartbeat interval (tcp.heartbeat_secs = {})",
                    beat.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }

    /// Checks the address's form (resolving it waits until it is used), that the rendezvous
    /// directory is absolute, and the deadlines.
    fn validate(&self) -> Result<()> {
        self.validate_deadlines()?;
        if let Some(dir) = &self.rendezvous_dir {
            if !dir.is_absolute() {
                return Err(Error::invalid_config(
                    "tcp.rendezvous_dir",
                    dir.display(),
                    "must be an absolute directory path",
                ));
            }
        }
        let Some(text) = self.leader_addr.as_deref() else {
            return Ok(());
        };
        if text.parse::<SocketAddr>().is_ok() {
            return Ok(());
        }
        match text.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() => {
                port.parse::<u16>().map(|_| ()).map_err(|e| {
                    Error::invalid_config(
                        "tcp.leader_addr",
                        text,
                        format!("expected ip:port or host:port (bad port: {e})"),
                    )
                })
            }
            _ => Err(Error::invalid_config(
                "tcp.leader_addr",
                text,
                "expected ip:port or host:port",
            )),
        }
    }
}

fn secs(v: Option<f64>, default: f64) -> Duration {
    Duration::from_secs_f64(v.filter(|v| v.is_finite() && *v > 0.0).unwrap_or(default))
}

/// The `[tcp]` settings of the environment alone (no file): defaults overridden by every
/// `KVBM_*` variable of a `tcp.` key in [`ENV_VARS`]. An invalid value is an
/// [`ErrorKind::InvalidConfig`] error naming the variable and value.
pub fn tcp_config_from_env() -> Result<TcpConfig> {
    let mut c = Config::default();
    for var in ENV_VARS.iter().filter(|v| v.key.starts_with("tcp.")) {
        if let Ok(raw) = std::env::var(var.name) {
            c.set(var.name, var.key, &raw)?;
        }
    }
    c.tcp.validate_relations()?;
    Ok(c.tcp)
}

/// The leader's address from [`LEADER_ADDR_ENV`], or [`DEFAULT_LEADER_ADDR`] when it is unset or
/// empty. An invalid value is an [`ErrorKind::InvalidConfig`] error naming the variable and value.
pub fn leader_addr_from_env() -> Result<SocketAddr> {
    leader_addr_from(std::env::var(LEADER_ADDR_ENV).ok().as_deref())
}

/// Parses a leader address as [`leader_addr_from_env`] does: `None` or empty gives
/// [`DEFAULT_LEADER_ADDR`]; otherwise `ip:port`, `[ipv6]:port` or `host:port` (resolved; the
/// first address wins).
pub fn leader_addr_from(value: Option<&str>) -> Result<SocketAddr> {
    let v = value.map(str::trim).filter(|v| !v.is_empty());
    let text = v.unwrap_or(DEFAULT_LEADER_ADDR);
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    let invalid = |why: String| Error::invalid_config(LEADER_ADDR_ENV, text, why);
    match text.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| invalid("the host name resolves to no address".to_string())),
        Err(e) => Err(invalid(format!("expected ip:port or host:port ({e})"))),
    }
}

/// The rendezvous directory from [`RENDEZVOUS_DIR_ENV`] (unset or empty: the default of
/// [`TcpConfig::rendezvous_dir`]). A relative path is an [`ErrorKind::InvalidConfig`] error naming
/// the variable.
pub fn rendezvous_dir_from_env() -> Result<PathBuf> {
    let mut tcp = TcpConfig::default();
    if let Ok(raw) = std::env::var(RENDEZVOUS_DIR_ENV) {
        tcp.rendezvous_dir = trimmed(&raw).map(PathBuf::from);
        tcp.validate().map_err(|e| {
            Error::invalid_config(RENDEZVOUS_DIR_ENV, &raw, e.message().to_string())
        })?;
    }
    Ok(tcp.rendezvous_dir())
}

/// The shared secret from [`AUTH_TOKEN_ENV`]; unset or empty means none.
pub fn auth_token_from_env() -> Option<String> {
    std::env::var(AUTH_TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Hash of block keys. Default: SHA-256 (collision-resistant 128-bit keys); xxh3 (xxh3-128)
    /// is forgeable: only for trusted single-tenant deployments.
    pub hash: HashAlgorithm,
    /// Which cached block the host and disk tiers evict when full: `lru`, `prefix` (prefix-aware
    /// reuse credit) or `2q` ([`EvictionPolicy`]). Default: `prefix`.
    pub eviction: EvictionPolicy,
    /// Host tier size.
    pub host: TierSize,
    /// Disk tier size and behaviour.
    pub disk: DiskConfig,
    /// Transfer engine.
    pub transfer: TransferConfig,
    /// One deadline for the whole leader/worker start-up barrier, in seconds. Default: 60.
    pub init_timeout_secs: f64,
    /// The remote (G4) tier. Default: off.
    #[serde(skip_serializing_if = "RemoteConfig::is_default")]
    pub remote: RemoteConfig,
    /// The network transport. Default: loopback, no token.
    #[serde(skip_serializing_if = "TcpConfig::nothing_to_write")]
    pub tcp: TcpConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            hash: HashAlgorithm::default(),
            eviction: EvictionPolicy::default(),
            host: TierSize::default(),
            disk: DiskConfig::default(),
            transfer: TransferConfig::default(),
            init_timeout_secs: 60.0,
            remote: RemoteConfig::default(),
            tcp: TcpConfig::default(),
        }
    }
}

/// One environment variable the configuration reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvVar {
    /// The variable's name.
    pub name: &'static str,
    /// The setting it overrides (TOML key path).
    pub key: &'static str,
    /// True for Dynamo's names, accepted for compatibility (ours win when both are set).
    pub dynamo_alias: bool,
    /// True for a secret, whose value is never shown ([`EnvVar::shown`]).
    pub secret: bool,
}

impl EnvVar {
    /// The value as it may be shown: quoted, or `<redacted>` for a secret.
    pub fn shown(&self, raw: &str) -> String {
        if self.secret {
            "<redacted>".to_string()
        } else {
            format!("{raw:?}")
        }
    }
}

const fn ours(name: &'static str, key: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        dynamo_alias: false,
        secret: false,
    }
}

const fn dynamo(name: &'static str, key: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        dynamo_alias: true,
        secret: false,
    }
}

const fn secret(name: &'static str, key: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        dynamo_alias: false,
        secret: true,
    }
}

/// Every environment variable read, in the order applied (later wins).
pub const ENV_VARS: &[EnvVar] = &[
    dynamo("DYN_KVBM_CPU_CACHE_GB", "host.cache_gb"),
    dynamo(
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
        "host.cache_blocks",
    ),
    dynamo("DYN_KVBM_DISK_CACHE_GB", "disk.cache_gb"),
    dynamo(
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",
        "disk.cache_blocks",
    ),
    dynamo("DYN_KVBM_DISK_CACHE_DIR", "disk.dir"),
    ours("KVBM_HASH", "hash"),
    ours("KVBM_EVICTION", "eviction"),
    ours("KVBM_HOST_CACHE_GB", "host.cache_gb"),
    ours("KVBM_HOST_CACHE_BLOCKS", "host.cache_blocks"),
    ours("KVBM_DISK_CACHE_GB", "disk.cache_gb"),
    ours("KVBM_DISK_CACHE_BLOCKS", "disk.cache_blocks"),
    ours("KVBM_DISK_CACHE_DIR", "disk.dir"),
    ours("KVBM_DISK_MIN_FREQUENCY", "disk.min_frequency"),
    ours("KVBM_DISK_DIRECT_IO", "disk.direct_io"),
    ours("KVBM_DISK_PERSIST", "disk.persist"),
    ours("KVBM_DISK_MAX_IN_FLIGHT", "disk.max_in_flight"),
    ours("KVBM_DISK_IO", "disk.io"),
    ours("KVBM_TRANSFER_CONCURRENCY", "transfer.max_concurrency"),
    ours("KVBM_TRANSFER_BATCH_BLOCKS", "transfer.batch_blocks"),
    ours("KVBM_LOAD_TIMEOUT_SECS", "transfer.load_timeout_secs"),
    ours("KVBM_COPY_METHOD", "transfer.copy_method"),
    ours("KVBM_INLINE_DEVICE_COPIES", "transfer.inline_device_copies"),
    ours("KVBM_INIT_TIMEOUT_SECS", "init_timeout_secs"),
    ours(REMOTE_URL_ENV, "remote.url"),
    ours("KVBM_REMOTE_SECRET_FILE", "remote.secret_file"),
    secret(REMOTE_SECRET_ENV, "remote.secret"),
    ours("KVBM_REMOTE_NAMESPACE", "remote.namespace"),
    ours("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "remote.lookup_timeout_ms"),
    ours("KVBM_REMOTE_IO_TIMEOUT_MS", "remote.io_timeout_ms"),
    ours("KVBM_REMOTE_LOOKUP_WAIT_MS", "remote.lookup_wait_ms"),
    ours("KVBM_REMOTE_LOAD_TIMEOUT_MS", "remote.load_timeout_ms"),
    ours("KVBM_REMOTE_SLOW_MS", "remote.slow_ms"),
    ours("KVBM_REMOTE_BACKOFF_SECS", "remote.backoff_secs"),
    ours("KVBM_REMOTE_MIN_FREQUENCY", "remote.min_frequency"),
    ours("KVBM_REMOTE_TTL_SECS", "remote.ttl_secs"),
    ours("KVBM_REMOTE_TLS_CA_FILE", "remote.tls_ca_file"),
    ours("KVBM_REMOTE_TLS_CERT_FILE", "remote.tls_cert_file"),
    ours("KVBM_REMOTE_TLS_KEY_FILE", "remote.tls_key_file"),
    ours(LEADER_ADDR_ENV, "tcp.leader_addr"),
    secret(AUTH_TOKEN_ENV, "tcp.auth_token"),
    ours(RENDEZVOUS_DIR_ENV, "tcp.rendezvous_dir"),
    ours(HEARTBEAT_ENV, "tcp.heartbeat_secs"),
    ours(HEARTBEAT_TIMEOUT_ENV, "tcp.heartbeat_timeout_secs"),
    ours(CALL_TIMEOUT_ENV, "tcp.call_timeout_secs"),
    ours(ALLOW_INSECURE_ENV, "tcp.allow_insecure"),
    ours(METRICS_ADDR_ENV, "tcp.metrics_addr"),
];

/// Names the configuration file when no path is given explicitly.
pub const CONFIG_FILE_VAR: &str = "KVBM_CONFIG";

/// `raw` without surrounding whitespace, or `None` when nothing is left (the setting is unset).
fn trimmed(raw: &str) -> Option<&str> {
    Some(raw.trim()).filter(|s| !s.is_empty())
}

fn parse_num<T: std::str::FromStr>(var: &str, raw: &str, what: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    raw.trim()
        .parse::<T>()
        .map_err(|e| Error::invalid_config(var, raw, format!("expected {what} ({e})")))
}

fn parse_bool(var: &str, raw: &str) -> Result<bool> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::invalid_config(
            var,
            raw,
            "expected true/false, 1/0, yes/no or on/off",
        )),
    }
}

fn parse_gb(var: &str, raw: &str) -> Result<f64> {
    let v: f64 = parse_num(var, raw, "a size in decimal GB")?;
    if !v.is_finite() || v < 0.0 {
        return Err(Error::invalid_config(
            var,
            raw,
            "must be a finite number >= 0",
        ));
    }
    Ok(v)
}

impl Config {
    /// Parses a TOML document (unknown keys are errors).
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let cfg = Self::parse_toml(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML and checks each value on its own (not the settings that constrain each other:
    /// the environment or a tool's flags may still change them).
    fn parse_toml(text: &str) -> Result<Self> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid configuration: {}", e.to_string().trim()),
            )
        })?;
        cfg.validate_values()?;
        Ok(cfg)
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg = Self::read_file(path)?;
        cfg.validate().map_err(|e| e.with("path", path.display()))?;
        Ok(cfg)
    }

    /// [`Config::from_file`] with each value checked on its own only.
    fn read_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("cannot read configuration file {}: {e}", path.display()),
            )
            .with("path", path.display())
        })?;
        Self::parse_toml(&text).map_err(|e| e.with("path", path.display()))
    }

    /// The effective configuration of this process: the file (`path`, else `KVBM_CONFIG`, else
    /// none) overridden by the environment.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        Self::load_with(path, |k| std::env::var(k).ok())
    }

    /// As [`Config::load`], reading variables through `env` (for tests and embedding).
    pub fn load_with(path: Option<&Path>, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let cfg = Self::load_for_overrides_with(path, env)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// As [`Config::load`], for a caller that overrides settings next (a tool's flags): every
    /// value is checked, but the settings that constrain each other (a client certificate and its
    /// key, TLS files and the URL's scheme, heartbeat and its timeout) only once the caller has
    /// applied its overrides and called [`Config::validate`].
    pub fn load_for_overrides(path: Option<&Path>) -> Result<Self> {
        Self::load_for_overrides_with(path, |k| std::env::var(k).ok())
    }

    fn load_for_overrides_with(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let from_var = env(CONFIG_FILE_VAR)
            .filter(|s| !s.trim().is_empty())
            .map(PathBuf::from);
        let mut cfg = match path.map(Path::to_path_buf).or(from_var) {
            Some(p) => Self::read_file(&p)?,
            None => Self::default(),
        };
        cfg.set_env(env)?;
        Ok(cfg)
    }

    /// Applies every variable of [`ENV_VARS`] that `env` knows, in order (ours after Dynamo's).
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        self.set_env(env)?;
        self.validate()
    }

    /// [`Config::apply_env`] with each value checked on its own only.
    fn set_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        for var in ENV_VARS {
            let Some(raw) = env(var.name) else { continue };
            self.set(var.name, var.key, &raw)?;
        }
        Ok(())
    }

    /// Sets one key (a TOML key path of [`ENV_VARS`]) from its text form; `source` names the
    /// variable in errors.
    fn set(&mut self, source: &str, key: &str, raw: &str) -> Result<()> {
        match key {
            "hash" => {
                self.hash = raw
                    .trim()
                    .parse()
                    .map_err(|_| Error::invalid_config(source, raw, "expected xxh3 or sha256"))?
            }
            "eviction" => {
                self.eviction = raw.trim().parse().map_err(|_| {
                    Error::invalid_config(source, raw, "expected one of prefix, 2q, lru")
                })?
            }
            "host.cache_gb" => self.host.cache_gb = Some(parse_gb(source, raw)?),
            "host.cache_blocks" => {
                self.host.cache_blocks = Some(parse_num(source, raw, "a block count")?)
            }
            "disk.cache_gb" => self.disk.cache_gb = Some(parse_gb(source, raw)?),
            "disk.cache_blocks" => {
                self.disk.cache_blocks = Some(parse_num(source, raw, "a block count")?)
            }
            "disk.dir" => {
                if raw.trim().is_empty() {
                    return Err(Error::invalid_config(
                        source,
                        raw,
                        "must be a directory path",
                    ));
                }
                self.disk.dir = PathBuf::from(raw)
            }
            "disk.min_frequency" => {
                self.disk.min_frequency = parse_num(source, raw, "a count >= 1")?
            }
            "disk.direct_io" => self.disk.direct_io = parse_bool(source, raw)?,
            "disk.io" => {
                self.disk.io = raw
                    .trim()
                    .parse()
                    .map_err(|_| Error::invalid_config(source, raw, "expected builtin or nixl"))?
            }
            "disk.persist" => self.disk.persist = parse_bool(source, raw)?,
            "disk.max_in_flight" => {
                self.disk.max_in_flight = parse_num(source, raw, "a count >= 1")?
            }
            "transfer.max_concurrency" => {
                self.transfer.max_concurrency = parse_num(source, raw, "a count >= 1")?
            }
            "transfer.batch_blocks" => {
                self.transfer.batch_blocks = parse_num(source, raw, "a count >= 1")?
            }
            "init_timeout_secs" => self.init_timeout_secs = parse_num(source, raw, "seconds > 0")?,
            "transfer.load_timeout_secs" => {
                self.transfer.load_timeout_secs = parse_num(source, raw, "seconds > 0")?
            }
            "transfer.copy_method" => {
                self.transfer.copy_method = raw.trim().parse().map_err(|_| {
                    Error::invalid_config(
                        source,
                        raw,
                        "expected one of auto, plain, stream, stream-pages",
                    )
                })?
            }
            "transfer.inline_device_copies" => {
                self.transfer.inline_device_copies = parse_bool(source, raw)?
            }
            "remote.url" => self.remote.url = trimmed(raw).map(str::to_owned),
            "remote.secret_file" => self.remote.secret_file = trimmed(raw).map(PathBuf::from),
            "remote.secret" => {
                self.remote.secret = Some(raw).filter(|t| !t.is_empty()).map(str::to_owned)
            }
            "remote.tls_ca_file" => self.remote.tls_ca_file = trimmed(raw).map(PathBuf::from),
            "remote.tls_cert_file" => self.remote.tls_cert_file = trimmed(raw).map(PathBuf::from),
            "remote.tls_key_file" => self.remote.tls_key_file = trimmed(raw).map(PathBuf::from),
            "remote.namespace" => self.remote.namespace = trimmed(raw).map(str::to_owned),
            "remote.lookup_timeout_ms" => {
                self.remote.lookup_timeout_ms = Some(parse_num(source, raw, "milliseconds >= 1")?)
            }
            "remote.lookup_wait_ms" => {
                self.remote.lookup_wait_ms = Some(parse_num(source, raw, "milliseconds >= 1")?)
            }
            "remote.slow_ms" => {
                self.remote.slow_ms = Some(parse_num(source, raw, "milliseconds >= 1")?)
            }
            "remote.backoff_secs" => {
                self.remote.backoff_secs = Some(parse_num(source, raw, "seconds > 0")?)
            }
            "remote.io_timeout_ms" => {
                self.remote.io_timeout_ms = Some(parse_num(source, raw, "milliseconds >= 1")?)
            }
            "remote.load_timeout_ms" => {
                self.remote.load_timeout_ms = Some(parse_num(source, raw, "milliseconds >= 1")?)
            }
            "remote.min_frequency" => {
                self.remote.min_frequency = Some(parse_num(source, raw, "a count >= 1")?)
            }
            "remote.ttl_secs" => {
                self.remote.ttl_secs = Some(parse_num(source, raw, "seconds (0 for none)")?)
            }
            "tcp.leader_addr" => self.tcp.leader_addr = trimmed(raw).map(str::to_owned),
            "tcp.auth_token" => {
                self.tcp.auth_token = Some(raw).filter(|t| !t.is_empty()).map(str::to_owned)
            }
            "tcp.rendezvous_dir" => self.tcp.rendezvous_dir = trimmed(raw).map(PathBuf::from),
            "tcp.heartbeat_secs" => {
                self.tcp.heartbeat_secs = Some(parse_num(source, raw, "seconds > 0")?)
            }
            "tcp.heartbeat_timeout_secs" => {
                self.tcp.heartbeat_timeout_secs = Some(parse_num(source, raw, "seconds > 0")?)
            }
            "tcp.call_timeout_secs" => {
                self.tcp.call_timeout_secs = Some(parse_num(source, raw, "seconds > 0")?)
            }
            "tcp.allow_insecure" => self.tcp.allow_insecure = parse_bool(source, raw)?,
            "tcp.metrics_addr" => {
                let raw = raw.trim();
                self.tcp.metrics_addr = if raw.is_empty() {
                    None
                } else {
                    Some(raw.parse().map_err(|e| {
                        Error::invalid_config(source, raw, format!("expected ip:port ({e})"))
                    })?)
                }
            }
            other => {
                return Err(Error::internal(format!(
                    "environment table names unknown key {other}"
                )))
            }
        }
        // Re-check the one key just set so the error names the variable, not the TOML key (a
        // secret or a URL's password is never echoed).
        self.validate_values().map_err(|e| {
            let shown = match key {
                "remote.secret" | "tcp.auth_token" => "<redacted>".to_string(),
                "remote.url" => redact_url(raw),
                _ => raw.to_string(),
            };
            Error::invalid_config(source, shown, e.message().to_string())
        })
    }

    /// Checks every value's range, and the settings that constrain each other.
    pub fn validate(&self) -> Result<()> {
        self.validate_values()?;
        self.tcp.validate_relations()?;
        self.remote.validate_relations()
    }

    /// Checks every value's range on its own.
    fn validate_values(&self) -> Result<()> {
        self.host.validate("host")?;
        self.disk_size().validate("disk")?;
        self.disk.validate_dir()?;
        self.tcp.validate()?;
        self.transfer.validate()?;
        self.remote.validate()?;
        if !(self.init_timeout_secs.is_finite()
            && self.init_timeout_secs > 0.0
            && self.init_timeout_secs <= 1e9)
        {
            return Err(Error::invalid_config(
                "init_timeout_secs",
                self.init_timeout_secs,
                "must be a number of seconds > 0",
            ));
        }
        for (key, v) in [
            ("disk.min_frequency", self.disk.min_frequency as usize),
            ("disk.max_in_flight", self.disk.max_in_flight),
            ("transfer.max_concurrency", self.transfer.max_concurrency),
            ("transfer.batch_blocks", self.transfer.batch_blocks),
        ] {
            if v == 0 {
                return Err(Error::invalid_config(key, v, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The start-up barrier deadline.
    pub fn init_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.init_timeout_secs)
    }

    /// Host tier size.
    pub fn host_size(&self) -> TierSize {
        self.host.clone()
    }

    /// Disk tier size.
    pub fn disk_size(&self) -> TierSize {
        TierSize {
            cache_gb: self.disk.cache_gb,
            cache_blocks: self.disk.cache_blocks,
        }
    }

    /// Host and disk block counts for blocks of `bytes_per_block` (the leader's barrier answer).
    ///
    /// With no host or disk size set at all ([`Config::no_tier_sized`]) the host tier gets
    /// [`default_host_cache_gb`]: the connector was loaded to offload, so doing nothing would
    /// be a silent surprise. A size set to 0 is respected (that tier off).
    ///
    /// Errors: a size whose bytes (`blocks × bytes_per_block`) exceed `isize::MAX` (what one
    /// allocation or file offset can address) is [`ErrorKind::InvalidConfig`] naming the setting
    /// (`host.cache_gb`, `disk.cache_blocks`, ...), not a layout error later.
    pub fn block_counts(&self, bytes_per_block: usize) -> Result<(usize, usize)> {
        let host = if self.no_tier_sized() {
            TierSize {
                cache_gb: Some(default_host_cache_gb()),
                cache_blocks: None,
            }
        } else {
            self.host_size()
        };
        Ok((
            sized_blocks("host", &host, bytes_per_block)?,
            sized_blocks("disk", &self.disk_size(), bytes_per_block)?,
        ))
    }

    /// True when neither the host nor the disk tier has a size (GB or blocks, 0 included) from
    /// any source: [`Config::block_counts`] then uses the default host tier.
    pub fn no_tier_sized(&self) -> bool {
        self.host.cache_gb.is_none()
            && self.host.cache_blocks.is_none()
            && self.disk.cache_gb.is_none()
            && self.disk.cache_blocks.is_none()
    }

    /// What start-up should say loudly about the tier sizes, if anything: that the default host
    /// tier is in use (no size set), or that every tier is sized 0 and the remote tier is off,
    /// so the connector stores and loads nothing.
    pub fn tier_warning(&self) -> Option<String> {
        if self.no_tier_sized() {
            return Some(format!(
                "no host or disk tier size is set (KVBM_HOST_CACHE_GB, KVBM_DISK_CACHE_GB or a config file); using a default host tier of {:.2} GB ({} GB, at most a quarter of this machine's memory)",
                default_host_cache_gb(),
                DEFAULT_HOST_CACHE_GB
            ));
        }
        let zero = |t: &TierSize| {
            t.cache_blocks == Some(0)
                || (t.cache_blocks.is_none() && t.cache_gb.is_none_or(|g| g * GB < 1.0))
        };
        if zero(&self.host_size()) && zero(&self.disk_size()) && !self.remote.enabled() {
            return Some(
                "the host and disk tiers are both sized 0 and the remote tier is off: the connector will store and load nothing (set KVBM_HOST_CACHE_GB or KVBM_DISK_CACHE_GB)"
                    .to_string(),
            );
        }
        None
    }

    /// The configuration as a TOML document to show: as [`Config::to_toml`] with the password
    /// of `remote.url` replaced by `<redacted>`.
    pub fn to_toml_redacted(&self) -> Result<String> {
        let mut shown = self.clone();
        shown.remote.url = self.remote.url_redacted();
        shown.to_toml()
    }

    /// The configuration as a TOML document (secrets left out, `remote.url` as set: it may
    /// carry a password, so write it only where the configuration file itself may go).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self)
            .map_err(|e| Error::internal(format!("cannot render configuration as TOML: {e}")))
    }
}

/// [`TierSize::blocks`] of tier `key`, refused (naming the setting that sized it) when the
/// tier's bytes would not fit `isize::MAX`.
fn sized_blocks(key: &str, size: &TierSize, bytes_per_block: usize) -> Result<usize> {
    let n = size.blocks(bytes_per_block)?;
    let fits = n
        .checked_mul(bytes_per_block)
        .is_some_and(|b| isize::try_from(b).is_ok());
    if fits {
        return Ok(n);
    }
    let (setting, value) = match (size.cache_blocks, size.cache_gb) {
        (Some(b), _) => ("cache_blocks", b.to_string()),
        (None, Some(gb)) => ("cache_gb", format!("{gb:?}")),
        (None, None) => ("cache_blocks", n.to_string()),
    };
    Err(Error::invalid_config(
        &format!("{key}.{setting}"),
        value,
        format_args!("{n} blocks of {bytes_per_block} bytes exceed what one process can address"),
    ))
}

impl DiskConfig {
    /// `disk.dir` must name a directory: the empty path (the current directory, by accident) is
    /// refused from the TOML file as from the environment.
    fn validate_dir(&self) -> Result<()> {
        if self.dir.as_os_str().is_empty() || self.dir.to_str().is_some_and(|d| d.trim().is_empty())
        {
            return Err(Error::invalid_config(
                "disk.dir",
                self.dir.display(),
                "must be a directory path",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_tier_sized_gets_the_default_host_tier_and_says_so() {
        let c = Config::default();
        assert!(c.no_tier_sized());
        let gb = default_host_cache_gb();
        assert!(gb > 0.0 && gb <= DEFAULT_HOST_CACHE_GB, "{gb}");
        let (host, disk) = c.block_counts(1_000_000).unwrap();
        assert_eq!((host, disk), ((gb * 1000.0).floor() as usize, 0));
        assert!(c.tier_warning().unwrap().contains("default host tier"));
        // Any size set, even 0, is respected: no default.
        let c = Config::load_with(None, env(&[("KVBM_DISK_CACHE_GB", "1")])).unwrap();
        assert_eq!(c.block_counts(1_000_000).unwrap(), (0, 1000));
        assert_eq!(c.tier_warning(), None);
        let c = Config::load_with(None, env(&[("KVBM_HOST_CACHE_GB", "0")])).unwrap();
        assert_eq!(c.block_counts(1_000_000).unwrap(), (0, 0));
        assert!(c.tier_warning().unwrap().contains("nothing"));
    }

    #[test]
    fn gb_is_decimal_and_blocks_win() {
        let mut c = Config::default();
        c.apply_env(env(&[("KVBM_HOST_CACHE_GB", "2")])).unwrap();
        assert_eq!(c.host_size().blocks(1_000_000).unwrap(), 2000);
        c.apply_env(env(&[("KVBM_HOST_CACHE_BLOCKS", "7")]))
            .unwrap();
        assert_eq!(c.host_size().blocks(1_000_000).unwrap(), 7);
    }

    #[test]
    fn ours_win_over_dynamo_names() {
        let mut c = Config::default();
        c.apply_env(env(&[
            ("DYN_KVBM_CPU_CACHE_GB", "1"),
            ("KVBM_HOST_CACHE_GB", "3"),
            ("DYN_KVBM_DISK_CACHE_DIR", "/tmp/dyn"),
        ]))
        .unwrap();
        assert_eq!(c.host.cache_gb, Some(3.0));
        assert_eq!(c.disk.dir, PathBuf::from("/tmp/dyn"));
    }

    #[test]
    fn invalid_env_names_variable_and_value() {
        let mut c = Config::default();
        let e = c
            .apply_env(env(&[("DYN_KVBM_DISK_CACHE_GB", "-1")]))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains("DYN_KVBM_DISK_CACHE_GB"), "{e}");
        assert!(e.to_string().contains("\"-1\""), "{e}");
        let e = c.apply_env(env(&[("KVBM_HASH", "md5")])).unwrap_err();
        assert!(e.to_string().contains("KVBM_HASH"), "{e}");
        let e = c
            .apply_env(env(&[("KVBM_DISK_MIN_FREQUENCY", "0")]))
            .unwrap_err();
        assert!(e.to_string().contains("KVBM_DISK_MIN_FREQUENCY"), "{e}");
    }

    #[test]
    fn copy_method_from_env_and_file() {
        use crate::transfer::CopyPolicy;
        assert_eq!(Config::default().transfer.copy_method, CopyPolicy::Auto);
        let c = Config::load_with(None, env(&[("KVBM_COPY_METHOD", " Stream ")])).unwrap();
        assert_eq!(c.transfer.copy_method, CopyPolicy::Stream);
        let e = Config::load_with(None, env(&[("KVBM_COPY_METHOD", "avx")])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert_eq!(e.context_value("setting"), Some("KVBM_COPY_METHOD"));
        for part in ["\"avx\"", "auto", "plain", "stream"] {
            assert!(e.to_string().contains(part), "{e}");
        }
        let c = Config::from_toml_str("[transfer]\ncopy_method = \"plain\"\n").unwrap();
        assert_eq!(c.transfer.copy_method, CopyPolicy::Plain);
        assert!(Config::from_toml_str("[transfer]\ncopy_method = \"fast\"\n").is_err());
    }

    #[test]
    fn inline_device_copies_from_env_and_file() {
        assert!(Config::default().transfer.inline_device_copies);
        let c = Config::load_with(None, env(&[("KVBM_INLINE_DEVICE_COPIES", "off")])).unwrap();
        assert!(!c.transfer.inline_device_copies);
        let e = Config::load_with(None, env(&[("KVBM_INLINE_DEVICE_COPIES", "sometimes")]))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert_eq!(
            e.context_value("setting"),
            Some("KVBM_INLINE_DEVICE_COPIES")
        );
        let c = Config::from_toml_str("[transfer]\ninline_device_copies = false\n").unwrap();
        assert!(!c.transfer.inline_device_copies);
    }

    #[test]
    fn eviction_policy_from_env_and_file() {
        assert_eq!(Config::default().eviction, EvictionPolicy::Prefix);
        let c = Config::load_with(None, env(&[("KVBM_EVICTION", " Prefix ")])).unwrap();
        assert_eq!(c.eviction, EvictionPolicy::Prefix);
        let c = Config::load_with(None, env(&[("KVBM_EVICTION", "2q")])).unwrap();
        assert_eq!(c.eviction, EvictionPolicy::TwoQ);
        let e = Config::load_with(None, env(&[("KVBM_EVICTION", "mru")])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert_eq!(e.context_value("setting"), Some("KVBM_EVICTION"));
        let msg = e.to_string();
        for part in ["\"mru\"", "prefix", "2q", "lru"] {
            assert!(msg.contains(part), "{msg}");
        }
        let c = Config::from_toml_str("eviction = \"2q\"\n").unwrap();
        assert_eq!(c.eviction, EvictionPolicy::TwoQ);
        assert!(c.to_toml().unwrap().contains("eviction = \"2q\""));
        let e = Config::from_toml_str("eviction = \"mru\"\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        let msg = e.to_string();
        for part in ["mru", "prefix", "2q", "lru"] {
            assert!(msg.contains(part), "{msg}");
        }
    }

    #[test]
    fn toml_round_trip_and_unknown_keys() {
        let c = Config::from_toml_str(
            "hash = \"xxh3\"\n[host]\ncache_blocks = 4\n[disk]\ncache_gb = 0.5\nmin_frequency = 2\n",
        )
        .unwrap();
        assert_eq!(c.hash, HashAlgorithm::Xxh3);
        assert_eq!(c.block_counts(1_000_000).unwrap(), (4, 500));
        let again = Config::from_toml_str(&c.to_toml().unwrap()).unwrap();
        assert_eq!(again, c);
        let e = Config::from_toml_str("[host]\ncache_gib = 4\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains("cache_gib"), "{e}");
    }

    #[test]
    fn leader_address_parsing() {
        assert_eq!(
            leader_addr_from(None).unwrap(),
            "127.0.0.1:5557".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("  ")).unwrap(),
            "127.0.0.1:5557".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("10.0.0.7:6000")).unwrap(),
            "10.0.0.7:6000".parse().unwrap()
        );
        assert_eq!(
            leader_addr_from(Some("[::1]:6000")).unwrap(),
            "[::1]:6000".parse().unwrap()
        );
        for bad in ["not-an-address", "127.0.0.1", "127.0.0.1:99999"] {
            let e = leader_addr_from(Some(bad)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}: {e}");
            assert!(e.to_string().contains(LEADER_ADDR_ENV), "{e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn rendezvous_dir_from_env_and_toml() {
        let mut c = Config::default();
        assert_eq!(
            c.tcp.rendezvous_dir(),
            crate::connector::tcp::rendezvous::default_dir()
        );
        c.apply_env(env(&[(RENDEZVOUS_DIR_ENV, " /run/kvbm-x ")]))
            .unwrap();
        assert_eq!(c.tcp.rendezvous_dir(), PathBuf::from("/run/kvbm-x"));
        let toml = c.to_toml().unwrap();
        assert!(toml.contains("rendezvous_dir = \"/run/kvbm-x\""), "{toml}");
        assert_eq!(Config::from_toml_str(&toml).unwrap(), c);
        let e = Config::default()
            .apply_env(env(&[(RENDEZVOUS_DIR_ENV, "relative/dir")]))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains(RENDEZVOUS_DIR_ENV), "{e}");
        let e = Config::from_toml_str("[tcp]\nrendezvous_dir = \"rel\"\n").unwrap_err();
        assert!(e.to_string().contains("tcp.rendezvous_dir"), "{e}");
    }

    #[test]
    fn load_timeout_from_env_and_toml() {
        let mut c = Config::default();
        assert_eq!(c.transfer.load_timeout_secs, DEFAULT_LOAD_TIMEOUT_SECS);
        c.apply_env(env(&[("KVBM_LOAD_TIMEOUT_SECS", "0.25")]))
            .unwrap();
        assert_eq!(
            c.transfer.load_timeout(),
            std::time::Duration::from_millis(250)
        );
        assert_eq!(Config::from_toml_str(&c.to_toml().unwrap()).unwrap(), c);
        for bad in ["0", "-1", "nan", "inf", "soon"] {
            let e = Config::default()
                .apply_env(env(&[("KVBM_LOAD_TIMEOUT_SECS", bad)]))
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}");
            assert!(e.to_string().contains("KVBM_LOAD_TIMEOUT_SECS"), "{e}");
        }
        let e = Config::from_toml_str("[transfer]\nload_timeout_secs = 0\n").unwrap_err();
        assert!(e.to_string().contains("transfer.load_timeout_secs"), "{e}");
    }

    #[test]
    fn tcp_settings_from_env_and_toml() {
        let mut c = Config::default();
        assert_eq!(
            c.tcp.leader_addr().unwrap(),
            "127.0.0.1:5557".parse().unwrap()
        );
        assert_eq!(c.tcp.auth_token(), None);
        c.apply_env(env(&[
            (LEADER_ADDR_ENV, " 10.0.0.7:6000 "),
            (AUTH_TOKEN_ENV, "s3cret"),
        ]))
        .unwrap();
        assert_eq!(
            c.tcp.leader_addr().unwrap(),
            "10.0.0.7:6000".parse().unwrap()
        );
        assert_eq!(c.tcp.auth_token().as_deref(), Some("s3cret"));
        // The secret is never written back out.
        let toml = c.to_toml().unwrap();
        assert!(toml.contains("leader_addr = \"10.0.0.7:6000\""), "{toml}");
        assert!(!toml.contains("s3cret"), "{toml}");
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(!serde_json::to_string(&c).unwrap().contains("s3cret"));
        let token = ENV_VARS.iter().find(|v| v.name == AUTH_TOKEN_ENV).unwrap();
        assert_eq!(token.shown("s3cret"), "<redacted>");
        // Empty values mean "unset", as before.
        c.apply_env(env(&[(LEADER_ADDR_ENV, ""), (AUTH_TOKEN_ENV, "")]))
            .unwrap();
        assert_eq!(c.tcp, TcpConfig::default());
        let e = c
            .apply_env(env(&[(LEADER_ADDR_ENV, "127.0.0.1:99999")]))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains(LEADER_ADDR_ENV), "{e}");
        assert!(e.to_string().contains("127.0.0.1:99999"), "{e}");
        let c = Config::from_toml_str("[tcp]\nleader_addr = \"[::1]:6000\"\nauth_token = \"t\"\n")
            .unwrap();
        assert_eq!(c.tcp.leader_addr().unwrap(), "[::1]:6000".parse().unwrap());
        assert_eq!(c.tcp.auth_token().as_deref(), Some("t"));
        let e = Config::from_toml_str("[tcp]\nleader_addr = \"nowhere\"\n").unwrap_err();
        assert!(e.to_string().contains("tcp.leader_addr"), "{e}");
    }

    #[test]
    fn heartbeat_call_timeout_and_insecure_settings() {
        let c = Config::default();
        assert_eq!(c.tcp.heartbeat(), Duration::from_secs(1));
        assert_eq!(c.tcp.heartbeat_timeout(), Duration::from_secs(10));
        assert_eq!(c.tcp.call_timeout(), Duration::from_secs(60));
        assert!(!c.tcp.allow_insecure);
        let mut c = Config::default();
        c.apply_env(env(&[
            (HEARTBEAT_ENV, "0.25"),
            (HEARTBEAT_TIMEOUT_ENV, "2"),
            (CALL_TIMEOUT_ENV, "5"),
            (ALLOW_INSECURE_ENV, "yes"),
        ]))
        .unwrap();
        assert_eq!(c.tcp.heartbeat(), Duration::from_millis(250));
        assert_eq!(c.tcp.heartbeat_timeout(), Duration::from_secs(2));
        assert_eq!(c.tcp.call_timeout(), Duration::from_secs(5));
        assert!(c.tcp.allow_insecure);
        let toml = c.to_toml().unwrap();
        assert!(toml.contains("allow_insecure = true"), "{toml}");
        assert_eq!(Config::from_toml_str(&toml).unwrap(), c);
        for (var, raw, why) in [
            (HEARTBEAT_ENV, "0", "seconds"),
            (HEARTBEAT_TIMEOUT_ENV, "-1", "seconds"),
            (CALL_TIMEOUT_ENV, "soon", "seconds"),
            (CALL_TIMEOUT_ENV, "inf", "seconds"),
            (ALLOW_INSECURE_ENV, "maybe", "true/false"),
            (HEARTBEAT_TIMEOUT_ENV, "1.5", "twice the heartbeat interval"),
        ] {
            let e = Config::default().apply_env(env(&[(var, raw)])).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{var}={raw}: {e}");
            assert!(e.to_string().contains(var), "{var}={raw}: {e}");
            assert!(
                e.to_string().contains(&format!("{raw:?}")),
                "{var}={raw}: {e}"
            );
            assert!(e.to_string().contains(why), "{var}={raw}: {e}");
        }
        // Both set, in either order: the pair is checked once both are in.
        let mut c = Config::default();
        c.apply_env(env(&[(HEARTBEAT_ENV, "20"), (HEARTBEAT_TIMEOUT_ENV, "60")]))
            .unwrap();
        assert_eq!(c.tcp.heartbeat_timeout(), Duration::from_secs(60));
        let e = Config::from_toml_str("[tcp]\nheartbeat_secs = 6.0\n").unwrap_err();
        assert!(e.to_string().contains("tcp.heartbeat_timeout_secs"), "{e}");
        let e = Config::from_toml_str("[tcp]\ncall_timeout_secs = 0.0\n").unwrap_err();
        assert!(e.to_string().contains("tcp.call_timeout_secs"), "{e}");
        // Only non-loopback listening without a token needs the insecure setting.
        let tcp = TcpConfig::default();
        let lan: SocketAddr = "10.0.0.1:5557".parse().unwrap();
        tcp.check_listen("kvbm leader", "127.0.0.1:1".parse().unwrap(), false)
            .unwrap();
        tcp.check_listen("kvbm leader", "[::1]:1".parse().unwrap(), false)
            .unwrap();
        tcp.check_listen("kvbm leader", lan, true).unwrap();
        let e = tcp.check_listen("kvbm leader", lan, false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains(ALLOW_INSECURE_ENV), "{e}");
        assert!(e.to_string().contains(AUTH_TOKEN_ENV), "{e}");
        let open = TcpConfig {
            allow_insecure: true,
            ..TcpConfig::default()
        };
        open.check_listen("kvbm leader", lan, false).unwrap();
    }

    #[test]
    fn remote_settings_from_env_and_toml() {
        let c = Config::load_with(
            None,
            env(&[
                ("KVBM_REMOTE_URL", "redis://user:hunter2@10.0.0.5:6379/2"),
                ("KVBM_REMOTE_SECRET", "s3cret-mac-key"),
                ("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "7"),
                ("KVBM_REMOTE_IO_TIMEOUT_MS", "1500"),
                ("KVBM_REMOTE_MIN_FREQUENCY", "2"),
                ("KVBM_REMOTE_NAMESPACE", "m1"),
                ("KVBM_REMOTE_TTL_SECS", "60"),
            ]),
        )
        .unwrap();
        assert!(c.remote.enabled());
        assert_eq!(c.remote.lookup_timeout(), Duration::from_millis(7));
        assert_eq!(c.remote.io_timeout(), Duration::from_millis(1500));
        assert_eq!(c.remote.min_frequency(), 2);
        assert_eq!(c.remote.ttl(), Some(Duration::from_secs(60)));
        assert_eq!(c.remote.secret().unwrap().unwrap(), b"s3cret-mac-key");
        // Neither the secret nor the password is shown.
        let shown = format!("{c:?}{}", c.to_toml_redacted().unwrap());
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(
            shown.contains("redis://user:<redacted>@10.0.0.5:6379/2"),
            "{shown}"
        );
        // The full form keeps the URL (workers read it) but never the secret.
        let toml = c.to_toml().unwrap();
        assert!(
            toml.contains("hunter2") && !toml.contains("s3cret"),
            "{toml}"
        );
        let again = Config::from_toml_str(&toml).unwrap();
        assert_eq!(again.remote.url, c.remote.url);
        // Defaults.
        let d = RemoteConfig::default();
        assert!(!d.enabled());
        assert_eq!(d.lookup_timeout(), Duration::from_millis(5));
        assert_eq!(d.io_timeout(), Duration::from_millis(2000));
        assert_eq!(d.min_frequency(), 1);
        assert_eq!(d.ttl(), None);
        assert_eq!(d.secret().unwrap(), None);
    }

    /// The core checks the form every remote URL has; the store its scheme names checks the
    /// rest (the storage backends' remote registry, tested there and in tests/redis.rs).
    #[test]
    fn remote_urls_are_checked_and_never_echo_a_password() {
        for ok in [
            "redis://127.0.0.1:6379",
            "rediss+cluster://u:p@a:1,b:2",
            "memory://plan",
            "s3://bucket/prefix",
        ] {
            validate_url(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (bad, why) in [
            ("h:6379", "expected scheme://"),
            ("://h:1", "scheme"),
            ("re dis://h:1", "scheme"),
            ("redis://h 1", "whitespace"),
            ("redis://h\u{7}:1", "control"),
        ] {
            let e = validate_url(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}");
            assert!(e.to_string().contains(why), "{bad}: {e}");
            assert!(e.to_string().contains("remote.url"), "{bad}: {e}");
        }
        let long = format!("redis://{}", "a".repeat(MAX_URL_LEN));
        assert!(validate_url(&long)
            .unwrap_err()
            .to_string()
            .contains("characters"));
        let e = Config::load_with(None, env(&[("KVBM_REMOTE_URL", "redis://u:topsecret@h 1")]))
            .unwrap_err();
        assert!(e.to_string().contains("KVBM_REMOTE_URL"), "{e}");
        assert!(!e.to_string().contains("topsecret"), "{e}");
        assert_eq!(redact_url("redis://pw@h:1"), "redis://<redacted>@h:1");
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
    }

    #[test]
    fn remote_ranges_and_secret_file() {
        for (var, bad) in [
            ("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "0"),
            ("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "-1"),
            ("KVBM_REMOTE_IO_TIMEOUT_MS", "0"),
            ("KVBM_REMOTE_IO_TIMEOUT_MS", "100000000"),
            ("KVBM_REMOTE_MIN_FREQUENCY", "0"),
            ("KVBM_REMOTE_TTL_SECS", "-5"),
        ] {
            let e = Config::load_with(None, env(&[(var, bad)])).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig);
            assert!(e.to_string().contains(var), "{e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "  from-file\n").unwrap();
        let mut c = Config::default();
        c.remote.secret_file = Some(path.clone());
        assert_eq!(c.remote.secret().unwrap().unwrap(), b"from-file");
        c.remote.secret = Some("from-env".into());
        assert_eq!(c.remote.secret().unwrap().unwrap(), b"from-env");
        c.remote.secret = None;
        std::fs::write(&path, "\n").unwrap();
        let e = c.remote.secret().unwrap_err();
        assert!(e.to_string().contains("remote.secret_file"), "{e}");
        c.remote.secret_file = Some(dir.path().join("missing"));
        let e = c.remote.secret().unwrap_err();
        assert!(e.to_string().contains("remote.secret_file"), "{e}");
        let e =
            Config::from_toml_str("[remote]\nurl = \"redis://h:1\"\ndir = \"/x\"\n").unwrap_err();
        assert!(e.to_string().contains("dir"), "{e}");
    }

    #[test]
    fn remote_tls_files_from_env_and_toml_bounded_and_paired() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let cert = dir.path().join("client.pem");
        let key = dir.path().join("client.key");
        std::fs::write(&ca, "ca bytes\n").unwrap();
        std::fs::write(&cert, "cert bytes\n").unwrap();
        std::fs::write(&key, "key bytes\n").unwrap();
        let (ca_s, cert_s, key_s) = (
            ca.display().to_string(),
            cert.display().to_string(),
            key.display().to_string(),
        );
        // Environment: all three, read as they are (the store parses them).
        let c = Config::load_with(
            None,
            env(&[
                ("KVBM_REMOTE_URL", "rediss://h:1"),
                ("KVBM_REMOTE_TLS_CA_FILE", &ca_s),
                ("KVBM_REMOTE_TLS_CERT_FILE", &cert_s),
                ("KVBM_REMOTE_TLS_KEY_FILE", &key_s),
            ]),
        )
        .unwrap();
        let files = c.remote.tls_files().unwrap().unwrap();
        assert_eq!(files.ca.as_ref().unwrap().bytes, b"ca bytes\n");
        let (c_pem, k_pem) = files.client.as_ref().unwrap();
        assert_eq!(
            (c_pem.key, k_pem.key),
            ("remote.tls_cert_file", "remote.tls_key_file")
        );
        assert_eq!(k_pem.bytes, b"key bytes\n");
        // Debug shows paths and sizes, never the key.
        let shown = format!("{files:?}");
        assert!(
            !shown.contains("key bytes") && shown.contains("client.key"),
            "{shown}"
        );
        // TOML: the same settings.
        let t = Config::from_toml_str(&format!(
            "[remote]\nurl = \"rediss+cluster://h:1,h:2\"\ntls_ca_file = \"{ca_s}\"\n"
        ))
        .unwrap();
        assert_eq!(t.remote.tls_ca_file.as_deref(), Some(ca.as_path()));
        assert!(t.remote.tls_files().unwrap().unwrap().client.is_none());
        // (Whether a URL's store takes TLS files at all — Redis: rediss:// only — is its
        // backend's check, tested with the storage backends.)
        // Relations are checked on the merged settings, not on the file alone: a file with the
        // certificate and the key in the environment.
        let file = dir.path().join("kvbm.toml");
        std::fs::write(
            &file,
            format!("[remote]\nurl = \"redis://h:1\"\ntls_cert_file = \"{cert_s}\"\n"),
        )
        .unwrap();
        let c = Config::load_with(
            Some(&file),
            env(&[
                ("KVBM_REMOTE_URL", "rediss://h:1"),
                ("KVBM_REMOTE_TLS_KEY_FILE", &key_s),
            ]),
        )
        .unwrap();
        assert!(c.remote.tls_files().unwrap().unwrap().client.is_some());
        let e = Config::load_with(Some(&file), env(&[("KVBM_REMOTE_URL", "rediss://h:1")]))
            .unwrap_err();
        assert!(e.to_string().contains("remote.tls_key_file"), "{e}");
        // Nothing set: none.
        assert!(Config::default().remote.tls_files().unwrap().is_none());
        // A certificate without its key and a key without its certificate: refused when the
        // configuration loads, naming the setting.
        for (vars, want) in [
            (
                vec![("KVBM_REMOTE_TLS_KEY_FILE", key_s.as_str())],
                "remote.tls_cert_file",
            ),
            (
                vec![
                    ("KVBM_REMOTE_URL", "rediss://h:1"),
                    ("KVBM_REMOTE_TLS_CERT_FILE", cert_s.as_str()),
                ],
                "remote.tls_key_file",
            ),
            (
                vec![
                    ("KVBM_REMOTE_URL", "rediss://h:1"),
                    ("KVBM_REMOTE_TLS_KEY_FILE", key_s.as_str()),
                ],
                "remote.tls_cert_file",
            ),
        ] {
            let e = Config::load_with(None, env(&vars)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{vars:?}");
            assert!(e.to_string().contains(want), "{vars:?}: {e}");
        }
        // Missing, empty and oversized files: refused naming the setting (the oversized one
        // before it is read whole).
        let big = dir.path().join("big.pem");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_TLS_FILE_BYTES + 1).unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, " \n").unwrap();
        for (path, why) in [
            (dir.path().join("missing.pem"), "cannot open"),
            (empty, "empty"),
            (big, "larger than"),
        ] {
            let mut r = RemoteConfig {
                url: Some("rediss://h:1".into()),
                tls_ca_file: Some(path.clone()),
                ..Default::default()
            };
            let e = r.tls_files().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig);
            let text = e.to_string();
            assert!(
                text.contains("remote.tls_ca_file") && text.contains(why),
                "{text}"
            );
            r.tls_ca_file = None;
            r.tls_cert_file = Some(cert.clone());
            r.tls_key_file = Some(path);
            let e = r.tls_files().unwrap_err();
            assert!(e.to_string().contains("remote.tls_key_file"), "{e}");
        }
    }
}
