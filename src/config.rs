//! Configuration: one struct, read from a TOML file and overridden by environment variables.
//!
//! Precedence, lowest first: built-in defaults, the TOML file (`--config` or `KVBM_CONFIG`),
//! Dynamo's `DYN_KVBM_*` names (so their users can switch without edits), our `KVBM_*` names.
//! Every variable is listed in [`ENV_VARS`] with what it sets. Sizes in GB are decimal (1 GB =
//! 1e9 bytes). An invalid value is an [`ErrorKind::InvalidConfig`](crate::ErrorKind) error naming
//! the variable (or file key) and the value.
//!
//! ```toml
//! hash = "xxh3"            # or "sha256"
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
//!
//! [tcp]                    # the network transport (connector::tcp)
//! leader_addr = "10.0.0.1:5557"
//! auth_token = "s3cret"    # never written back out (to_toml, Debug)
//! rendezvous_dir = "/run/user/1000/kvbm-1000"  # private (0700) directory of rendezvous files
//! ```

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::identity::HashAlgorithm;

/// Decimal gigabyte.
pub const GB: f64 = 1e9;

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
    /// Directory for the tier's file. Default: `$TMPDIR/kvbm` (system temp dir).
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
            dir: std::env::temp_dir().join("kvbm"),
            min_frequency: 1,
            direct_io: true,
            persist: false,
            max_in_flight: 4,
            io: DiskIo::Builtin,
        }
    }
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
}

/// [`TransferConfig::load_timeout_secs`] when unset.
pub const DEFAULT_LOAD_TIMEOUT_SECS: f64 = 10.0;

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            max_concurrency: 4,
            batch_blocks: 16,
            load_timeout_secs: DEFAULT_LOAD_TIMEOUT_SECS,
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

/// The remote (G4) tier: instances sharing a directory read each other's host tiers over UCX
/// (feature `nixl`). Off unless `dir` is set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// Shared directory where instances publish their host index and tier exports. Default:
    /// unset (remote tier off).
    pub dir: Option<PathBuf>,
    /// This instance's name in that directory (unique among the instances sharing it). Default:
    /// `<hostname>-<pid>` of the leader.
    pub instance: Option<String>,
    /// Iterations between two writes of this instance's index and two reads of the peers'.
    /// Default (unset or 0): 16.
    pub publish_every: Option<u64>,
}

impl RemoteConfig {
    /// Iterations between index writes/reads when unset.
    pub const DEFAULT_PUBLISH_EVERY: u64 = 16;

    /// Whether the remote tier is on (`dir` set).
    pub fn enabled(&self) -> bool {
        self.dir.is_some()
    }

    /// True when nothing is set (the section is then left out of the TOML form).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Iterations between index writes/reads.
    pub fn publish_every(&self) -> u64 {
        match self.publish_every {
            Some(n) if n > 0 => n,
            _ => Self::DEFAULT_PUBLISH_EVERY,
        }
    }

    /// The instance name: `instance`, else `<hostname>-<pid>`.
    pub fn instance_name(&self) -> String {
        if let Some(i) = self.instance.as_ref().filter(|i| !i.trim().is_empty()) {
            return i.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "localhost".to_owned());
        format!("{host}-{}", std::process::id())
    }
}

/// The environment variable naming the leader's address ([`TcpConfig::leader_addr`]).
pub const LEADER_ADDR_ENV: &str = "KVBM_LEADER_ADDR";
/// The environment variable holding the shared secret workers present ([`TcpConfig::auth_token`]).
pub const AUTH_TOKEN_ENV: &str = "KVBM_AUTH_TOKEN";
/// The leader's address when none is set (loopback).
pub const DEFAULT_LEADER_ADDR: &str = "127.0.0.1:5557";
/// The environment variable naming the private directory of rendezvous files
/// ([`TcpConfig::rendezvous_dir`]).
pub const RENDEZVOUS_DIR_ENV: &str = "KVBM_RENDEZVOUS_DIR";

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

    /// True when nothing written out is set (the section is then left out of the TOML form).
    fn nothing_to_write(&self) -> bool {
        self.leader_addr.is_none() && self.rendezvous_dir.is_none()
    }

    /// Checks the address's form (resolving it waits until it is used) and that the rendezvous
    /// directory is absolute.
    fn validate(&self) -> Result<()> {
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
        tcp.rendezvous_dir = Some(raw.trim())
            .filter(|s| !s.is_empty())
            .map(PathBuf::from);
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
    /// Hash of block keys. Default: xxh3 (compatible with Dynamo's KVBM).
    pub hash: HashAlgorithm,
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
    ours("KVBM_INIT_TIMEOUT_SECS", "init_timeout_secs"),
    ours("KVBM_REMOTE_DIR", "remote.dir"),
    ours("KVBM_REMOTE_INSTANCE", "remote.instance"),
    ours("KVBM_REMOTE_PUBLISH_EVERY", "remote.publish_every"),
    ours(LEADER_ADDR_ENV, "tcp.leader_addr"),
    secret(AUTH_TOKEN_ENV, "tcp.auth_token"),
    ours(RENDEZVOUS_DIR_ENV, "tcp.rendezvous_dir"),
];

/// Names the configuration file when no path is given explicitly.
pub const CONFIG_FILE_VAR: &str = "KVBM_CONFIG";

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
        let cfg: Config = toml::from_str(text).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("invalid configuration: {}", e.to_string().trim()),
            )
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("cannot read configuration file {}: {e}", path.display()),
            )
            .with("path", path.display())
        })?;
        Self::from_toml_str(&text).map_err(|e| e.with("path", path.display()))
    }

    /// The effective configuration of this process: the file (`path`, else `KVBM_CONFIG`, else
    /// none) overridden by the environment.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        Self::load_with(path, |k| std::env::var(k).ok())
    }

    /// As [`Config::load`], reading variables through `env` (for tests and embedding).
    pub fn load_with(path: Option<&Path>, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let from_var = env(CONFIG_FILE_VAR)
            .filter(|s| !s.trim().is_empty())
            .map(PathBuf::from);
        let mut cfg = match path.map(Path::to_path_buf).or(from_var) {
            Some(p) => Self::from_file(&p)?,
            None => Self::default(),
        };
        cfg.apply_env(env)?;
        Ok(cfg)
    }

    /// Applies every variable of [`ENV_VARS`] that `env` knows, in order (ours after Dynamo's).
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        for var in ENV_VARS {
            let Some(raw) = env(var.name) else { continue };
            self.set(var.name, var.key, &raw)?;
        }
        self.validate()
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
            "remote.dir" => {
                self.remote.dir = Some(raw.trim())
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
            }
            "remote.instance" => {
                let name = raw.trim();
                if !name.is_empty()
                    && !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                {
                    return Err(Error::invalid_config(
                        source,
                        raw,
                        "expected letters, digits, '-', '_' or '.'",
                    ));
                }
                self.remote.instance = Some(name.to_owned()).filter(|s| !s.is_empty())
            }
            "remote.publish_every" => {
                self.remote.publish_every = Some(parse_num(source, raw, "a count of iterations")?)
            }
            "tcp.leader_addr" => {
                self.tcp.leader_addr = Some(raw.trim())
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
            }
            "tcp.auth_token" => {
                self.tcp.auth_token = Some(raw).filter(|t| !t.is_empty()).map(str::to_owned)
            }
            "tcp.rendezvous_dir" => {
                self.tcp.rendezvous_dir = Some(raw.trim())
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
            }
            other => {
                return Err(Error::internal(format!(
                    "environment table names unknown key {other}"
                )))
            }
        }
        // Re-check the one key just set so the error names the variable, not the TOML key.
        self.validate()
            .map_err(|e| Error::invalid_config(source, raw, e.message().to_string()))
    }

    /// Checks every value's range.
    pub fn validate(&self) -> Result<()> {
        self.host.validate("host")?;
        self.disk_size().validate("disk")?;
        self.tcp.validate()?;
        self.transfer.validate()?;
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
    pub fn block_counts(&self, bytes_per_block: usize) -> Result<(usize, usize)> {
        Ok((
            self.host_size().blocks(bytes_per_block)?,
            self.disk_size().blocks(bytes_per_block)?,
        ))
    }

    /// The configuration as a TOML document.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self)
            .map_err(|e| Error::internal(format!("cannot render configuration as TOML: {e}")))
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
    fn toml_round_trip_and_unknown_keys() {
        let c = Config::from_toml_str(
            "hash = \"sha256\"\n[host]\ncache_blocks = 4\n[disk]\ncache_gb = 0.5\nmin_frequency = 2\n",
        )
        .unwrap();
        assert_eq!(c.hash, HashAlgorithm::Sha256);
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
}
