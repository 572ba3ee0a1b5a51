//! The environment variables the configuration reads (ours, `KVBM_*`, and Dynamo's
//! `DYN_KVBM_*`), and how their values are parsed.

use super::*;

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

pub(super) const fn ours(name: &'static str, key: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        dynamo_alias: false,
        secret: false,
    }
}

pub(super) const fn dynamo(name: &'static str, key: &'static str) -> EnvVar {
    EnvVar {
        name,
        key,
        dynamo_alias: true,
        secret: false,
    }
}

pub(super) const fn secret(name: &'static str, key: &'static str) -> EnvVar {
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
pub(super) fn trimmed(raw: &str) -> Option<&str> {
    Some(raw.trim()).filter(|s| !s.is_empty())
}

pub(super) fn parse_num<T: std::str::FromStr>(var: &str, raw: &str, what: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    raw.trim()
        .parse::<T>()
        .map_err(|e| Error::invalid_config(var, raw, format!("expected {what} ({e})")))
}

pub(super) fn parse_bool(var: &str, raw: &str) -> Result<bool> {
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

pub(super) fn parse_gb(var: &str, raw: &str) -> Result<f64> {
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
