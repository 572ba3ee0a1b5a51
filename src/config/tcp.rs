//! The `[tcp]` settings of the leader <-> worker transport (addresses, heartbeats, deadlines, the
//! rendezvous directory, the auth token) and the environment variables that set them; also the
//! names of the variables other owners read from the environment (the remote URL and secret,
//! the metrics address).

use super::*;

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

/// The network transport between the leader and its workers (`tcp`).
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
    /// token, pid) for workers on the same machine (`tcp::rendezvous`). Created
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
    /// `metrics_server`): `ip:port`; each worker serves its own transfer counters on
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
            .unwrap_or_else(crate::tcp::rendezvous::default_dir)
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
    pub(super) fn nothing_to_write(&self) -> bool {
        self.leader_addr.is_none()
            && self.rendezvous_dir.is_none()
            && self.heartbeat_secs.is_none()
            && self.heartbeat_timeout_secs.is_none()
            && self.call_timeout_secs.is_none()
            && !self.allow_insecure
            && self.metrics_addr.is_none()
    }

    /// Checks the deadlines' ranges (the timeout at least twice the interval).
    pub(super) fn validate_deadlines(&self) -> Result<()> {
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
    pub(super) fn validate_relations(&self) -> Result<()> {
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
    pub(super) fn validate(&self) -> Result<()> {
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

pub(super) fn secs(v: Option<f64>, default: f64) -> Duration {
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
