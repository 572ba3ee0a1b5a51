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
//! [tcp]                    # the network transport (src/tcp/)
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

mod env;
mod remote;
mod tcp;
mod tiers;
mod transfer;

pub use env::*;
pub use remote::*;
pub use tcp::*;
pub use tiers::*;
pub use transfer::*;

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

    /// This configuration for one of several stacks that split its host and disk tiers: each
    /// size in GB scaled by `fraction` (the stack's share of the bytes, in `(0, 1]`), the default
    /// host tier too when no tier is sized ([`Config::no_tier_sized`]); a size in blocks is kept
    /// (every stack holds that many blocks of its own size). TensorRT-LLM's layer groups in pools
    /// of their own get one stack per pool, the share its bytes per page. Errors: a fraction
    /// outside `(0, 1]` (invalid_argument).
    pub fn tier_share(&self, fraction: f64) -> Result<Config> {
        if !(fraction.is_finite() && fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::invalid_argument(format!(
                "a tier share is in (0, 1], got {fraction}"
            ))
            .with("fraction", fraction));
        }
        let mut out = self.clone();
        if self.no_tier_sized() {
            out.host.cache_gb = Some(default_host_cache_gb() * fraction);
        } else {
            out.host.cache_gb = self.host.cache_gb.map(|g| g * fraction);
            out.disk.cache_gb = self.disk.cache_gb.map(|g| g * fraction);
        }
        Ok(out)
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
            crate::tcp::rendezvous::default_dir()
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

    #[test]
    fn a_tier_share_scales_the_sizes_in_gb_and_keeps_block_counts() {
        let mut c = Config::default();
        let d = c.tier_share(0.25).unwrap();
        assert_eq!(d.host.cache_gb, Some(default_host_cache_gb() * 0.25));
        c.host.cache_gb = Some(8.0);
        c.disk.cache_gb = Some(100.0);
        c.disk.cache_blocks = Some(7);
        let d = c.tier_share(0.5).unwrap();
        assert_eq!((d.host.cache_gb, d.disk.cache_gb), (Some(4.0), Some(50.0)));
        assert_eq!(d.disk.cache_blocks, Some(7));
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            let e = c.tier_share(bad).unwrap_err();
            assert!(e.to_string().contains("tier share"), "{e}");
        }
    }
}
