//! The `[remote]` settings: where the shared (G4) store is, its TLS files (read bounded, parsed
//! by the store), and the checks of its URL.

use super::*;

/// The remote (G4) tier: a shared block store beyond this machine (Redis / Valkey, standalone or
/// cluster) that every instance of a deployment looks up, reads and writes. Off unless `url` is
/// set. See docs/deployment.md.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// Where the store is (`KVBM_REMOTE_URL`): `redis://[user:pass@]host:port[/db]`,
    /// `rediss://...` for TLS, or a cluster's seed nodes
    /// `redis+cluster://[user:pass@]h1:p1,h2:p2,...` (`rediss+cluster://` for TLS). Default:
    /// unset (remote tier off). Its password is never shown ([`RemoteConfig::url_redacted`]).
    pub url: Option<String>,
    /// A file holding the deployment secret that authenticates values (a MAC on every value:
    /// whoever can write to the store without it cannot plant a block). `KVBM_REMOTE_SECRET`
    /// (the secret itself, environment only) wins over it. Default: none (checksum only).
    pub secret_file: Option<PathBuf>,
    /// The secret from `KVBM_REMOTE_SECRET`: never written out (TOML, Debug).
    #[serde(skip)]
    pub secret: Option<String>,
    /// Model identity mixed into the store's key scope: instances share blocks only with the
    /// same namespace (two models with the same shapes but different weights must differ).
    /// Default: none.
    pub namespace: Option<String>,
    /// Deadline of a lookup the engine waits for (TensorRT-LLM asks synchronously), in
    /// milliseconds; what misses it counts as a miss. Default 5.
    pub lookup_timeout_ms: Option<u64>,
    /// Deadline of one write batch (and of a background lookup), in milliseconds.
    /// Default 2000.
    pub io_timeout_ms: Option<u64>,
    /// Deadline of one read batch of a load (`KVBM_REMOTE_LOAD_TIMEOUT_MS`), in milliseconds:
    /// a request waits for its load, so past this its blocks fail and the engine recomputes
    /// them (a store whose values never arrive costs a request this, not `io_timeout_ms`).
    /// Default 500: a local store reads a batch in about a millisecond, and recomputing a
    /// prefix that takes longer to read than this is rarely slower.
    pub load_timeout_ms: Option<u64>,
    /// How long a request of an engine that asks again later (vLLM) waits for its lookup, in
    /// milliseconds (`KVBM_REMOTE_LOOKUP_WAIT_MS`): past it the request goes on with what the
    /// local tiers matched, and the late answer only informs the store's health. Default 50.
    pub lookup_wait_ms: Option<u64>,
    /// The store is *slow* when the median latency of its recent calls (a window of 32
    /// lookups and loads) is above this, in milliseconds (`KVBM_REMOTE_SLOW_MS`); *unavailable*
    /// when half of them failed. Either takes it out of the lookup and write path for
    /// `backoff_secs`. Default 50: a local store answers in well under a millisecond, and a
    /// busy host delays that by milliseconds, not tens.
    pub slow_ms: Option<u64>,
    /// How long a slow or unavailable store is left out before it is probed again, in seconds
    /// (`KVBM_REMOTE_BACKOFF_SECS`); doubles at each verdict in a row, up to 60 s (or this, if
    /// larger). Default 5.
    pub backoff_secs: Option<f64>,
    /// Host → remote admission: a block is written to the store once it was seen this many
    /// times in the host tier (1 writes every block). Default 1.
    pub min_frequency: Option<u32>,
    /// Time to live of every value written, in seconds (the store then evicts it: a miss).
    /// Default (unset or 0): none (the store's own `maxmemory` policy evicts).
    pub ttl_secs: Option<u64>,
    /// PEM file of the certificate authorities trusted for a `rediss://` server
    /// (`KVBM_REMOTE_TLS_CA_FILE`), in place of the system's roots: a private CA. Default: the
    /// system's roots.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (chain) shown to a server that asks for one
    /// (`tls-auth-clients yes`; `KVBM_REMOTE_TLS_CERT_FILE`). Needs `tls_key_file`. Default: none.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key (`KVBM_REMOTE_TLS_KEY_FILE`). Needs
    /// `tls_cert_file`. Default: none.
    pub tls_key_file: Option<PathBuf>,
}

/// A PEM file named by a `remote.tls_*_file` setting, read (bounded) but not parsed. `Debug`
/// shows its path and size, never its contents.
#[derive(Clone, PartialEq, Eq)]
pub struct PemFile {
    /// The setting that named it (`remote.tls_ca_file`, ...), for errors.
    pub key: &'static str,
    /// Where it was read from.
    pub path: PathBuf,
    /// Its contents.
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for PemFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} bytes)", self.path.display(), self.bytes.len())
    }
}

/// The PEM files of a `rediss://` connection, read by [`RemoteConfig::tls_files`] (the store
/// parses them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteTlsFiles {
    /// Trusted roots (`remote.tls_ca_file`), replacing the system's.
    pub ca: Option<PemFile>,
    /// Client certificate chain and its private key (`remote.tls_cert_file`,
    /// `remote.tls_key_file`).
    pub client: Option<(PemFile, PemFile)>,
}

/// The largest PEM file `remote.tls_*_file` may name (a CA bundle of a few hundred certificates
/// is well under it).
pub const MAX_TLS_FILE_BYTES: u64 = 4 << 20;

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &self.url_redacted())
            .field("secret_file", &self.secret_file)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("namespace", &self.namespace)
            .field("lookup_timeout_ms", &self.lookup_timeout_ms)
            .field("io_timeout_ms", &self.io_timeout_ms)
            .field("lookup_wait_ms", &self.lookup_wait_ms)
            .field("load_timeout_ms", &self.load_timeout_ms)
            .field("slow_ms", &self.slow_ms)
            .field("backoff_secs", &self.backoff_secs)
            .field("min_frequency", &self.min_frequency)
            .field("ttl_secs", &self.ttl_secs)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .finish()
    }
}

impl RemoteConfig {
    /// [`RemoteConfig::lookup_timeout_ms`] when unset.
    pub const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 5;
    /// [`RemoteConfig::io_timeout_ms`] when unset.
    pub const DEFAULT_IO_TIMEOUT_MS: u64 = 2000;
    /// [`RemoteConfig::lookup_wait_ms`] when unset.
    pub const DEFAULT_LOOKUP_WAIT_MS: u64 = 50;
    /// [`RemoteConfig::load_timeout_ms`] when unset.
    pub const DEFAULT_LOAD_TIMEOUT_MS: u64 = 500;
    /// [`RemoteConfig::slow_ms`] when unset.
    pub const DEFAULT_SLOW_MS: u64 = 50;
    /// [`RemoteConfig::backoff_secs`] when unset.
    pub const DEFAULT_BACKOFF_SECS: f64 = 5.0;

    /// Whether the remote tier is on (`url` set).
    pub fn enabled(&self) -> bool {
        self.url.is_some()
    }

    /// True when nothing is set (the section is then left out of the TOML form).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The synchronous lookup deadline.
    pub fn lookup_timeout(&self) -> Duration {
        Duration::from_millis(
            self.lookup_timeout_ms
                .unwrap_or(Self::DEFAULT_LOOKUP_TIMEOUT_MS),
        )
    }

    /// The deadline of one write batch and of a background lookup.
    pub fn io_timeout(&self) -> Duration {
        Duration::from_millis(self.io_timeout_ms.unwrap_or(Self::DEFAULT_IO_TIMEOUT_MS))
    }

    /// The deadline of one read batch of a load ([`RemoteConfig::load_timeout_ms`]).
    pub fn load_timeout(&self) -> Duration {
        Duration::from_millis(
            self.load_timeout_ms
                .unwrap_or(Self::DEFAULT_LOAD_TIMEOUT_MS),
        )
    }

    /// How long a deferred lookup is waited for ([`RemoteConfig::lookup_wait_ms`]).
    pub fn lookup_wait(&self) -> Duration {
        Duration::from_millis(self.lookup_wait_ms.unwrap_or(Self::DEFAULT_LOOKUP_WAIT_MS))
    }

    /// The median latency above which the store is slow ([`RemoteConfig::slow_ms`]).
    pub fn slow(&self) -> Duration {
        Duration::from_millis(self.slow_ms.unwrap_or(Self::DEFAULT_SLOW_MS))
    }

    /// The first back-off of a slow or unavailable store ([`RemoteConfig::backoff_secs`]).
    pub fn backoff(&self) -> Duration {
        Duration::from_secs_f64(self.backoff_secs.unwrap_or(Self::DEFAULT_BACKOFF_SECS))
    }

    /// Host → remote admission count.
    pub fn min_frequency(&self) -> u32 {
        self.min_frequency.unwrap_or(1)
    }

    /// Time to live of the values written, if any.
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl_secs.filter(|s| *s > 0).map(Duration::from_secs)
    }

    /// `url` with any password replaced by `<redacted>` (what logs and `kvbm config` show).
    pub fn url_redacted(&self) -> Option<String> {
        self.url.as_deref().map(redact_url)
    }

    /// The deployment secret: `KVBM_REMOTE_SECRET`, else the contents of `secret_file`
    /// (surrounding whitespace trimmed), else none. An unreadable or empty file is
    /// [`ErrorKind::InvalidConfig`] naming `remote.secret_file` (never the secret).
    pub fn secret(&self) -> Result<Option<Vec<u8>>> {
        if let Some(s) = self.secret.as_ref().filter(|s| !s.is_empty()) {
            return Ok(Some(s.as_bytes().to_vec()));
        }
        let Some(path) = &self.secret_file else {
            return Ok(None);
        };
        let text = std::fs::read(path).map_err(|e| {
            Error::invalid_config(
                "remote.secret_file",
                path.display(),
                format!("cannot read the secret file ({e})"),
            )
        })?;
        let trimmed = text.trim_ascii();
        if trimmed.is_empty() {
            return Err(Error::invalid_config(
                "remote.secret_file",
                path.display(),
                "the secret file is empty",
            ));
        }
        Ok(Some(trimmed.to_vec()))
    }

    /// Whether any `remote.tls_*_file` is set.
    pub fn tls_files_set(&self) -> bool {
        self.tls_ca_file.is_some() || self.tls_cert_file.is_some() || self.tls_key_file.is_some()
    }

    /// The TLS files' contents (`None` when none is set). Each file is bounded by
    /// [`MAX_TLS_FILE_BYTES`] before it is read; a missing, unreadable, empty or oversized file is
    /// [`ErrorKind::InvalidConfig`] naming its setting (never the key's contents). Whether the
    /// contents are valid PEM is the store's to check.
    pub fn tls_files(&self) -> Result<Option<RemoteTlsFiles>> {
        if !self.tls_files_set() {
            return Ok(None);
        }
        let ca = match &self.tls_ca_file {
            Some(p) => Some(read_bounded("remote.tls_ca_file", p)?),
            None => None,
        };
        if let Some(e) = self.client_pair_error() {
            return Err(e);
        }
        let client = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(c), Some(k)) => Some((
                read_bounded("remote.tls_cert_file", c)?,
                read_bounded("remote.tls_key_file", k)?,
            )),
            _ => None,
        };
        Ok(Some(RemoteTlsFiles { ca, client }))
    }

    /// The `remote.tls_*_file` settings that are set, each with its setting's name (and its
    /// variable), in the order CA, certificate, key: for a store to refuse those it cannot use.
    pub fn tls_file_settings(&self) -> Vec<(&'static str, &PathBuf)> {
        [
            (
                "remote.tls_ca_file (KVBM_REMOTE_TLS_CA_FILE)",
                &self.tls_ca_file,
            ),
            (
                "remote.tls_cert_file (KVBM_REMOTE_TLS_CERT_FILE)",
                &self.tls_cert_file,
            ),
            (
                "remote.tls_key_file (KVBM_REMOTE_TLS_KEY_FILE)",
                &self.tls_key_file,
            ),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.as_ref().map(|p| (k, p)))
        .collect()
    }

    /// Checks the settings that constrain each other whatever the store: a client certificate
    /// and its key come together. (Whether the store named by `url` takes TLS files at all is
    /// its backend's check.)
    pub(super) fn validate_relations(&self) -> Result<()> {
        match self.client_pair_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A client certificate without its key, or a key without its certificate.
    fn client_pair_error(&self) -> Option<Error> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(c), None) => Some(Error::invalid_config(
                "remote.tls_cert_file (KVBM_REMOTE_TLS_CERT_FILE)",
                c.display(),
                "a client certificate needs its key: set remote.tls_key_file (KVBM_REMOTE_TLS_KEY_FILE) too",
            )),
            (None, Some(k)) => Some(Error::invalid_config(
                "remote.tls_key_file (KVBM_REMOTE_TLS_KEY_FILE)",
                k.display(),
                "a client key needs its certificate: set remote.tls_cert_file (KVBM_REMOTE_TLS_CERT_FILE) too",
            )),
            _ => None,
        }
    }

    /// Checks the settings' forms and ranges (the URL's general form; its store checks the
    /// rest, through the remote-backend registry of the storage backends).
    pub(super) fn validate(&self) -> Result<()> {
        if let Some(url) = &self.url {
            validate_url(url)?;
        }
        if let Some(ns) = &self.namespace {
            if ns.len() > 256 || ns.chars().any(char::is_control) {
                return Err(Error::invalid_config(
                    "remote.namespace",
                    ns,
                    "at most 256 characters, no control characters",
                ));
            }
        }
        for (key, v, max) in [
            ("remote.lookup_timeout_ms", self.lookup_timeout_ms, 60_000),
            ("remote.io_timeout_ms", self.io_timeout_ms, 600_000),
            ("remote.lookup_wait_ms", self.lookup_wait_ms, 60_000),
            ("remote.load_timeout_ms", self.load_timeout_ms, 600_000),
            ("remote.slow_ms", self.slow_ms, 600_000),
        ] {
            if let Some(v) = v {
                if v == 0 || v > max {
                    return Err(Error::invalid_config(
                        key,
                        v,
                        format!("must be a number of milliseconds from 1 to {max}"),
                    ));
                }
            }
        }
        if let Some(b) = self.backoff_secs {
            if !(b.is_finite() && (0.001..=3600.0).contains(&b)) {
                return Err(Error::invalid_config(
                    "remote.backoff_secs",
                    b,
                    "must be a number of seconds from 0.001 to 3600",
                ));
            }
        }
        if self.ttl_secs.is_some_and(|t| t > 10 * 365 * 24 * 3600) {
            return Err(Error::invalid_config(
                "remote.ttl_secs",
                self.ttl_secs.unwrap_or(0),
                "must be at most ten years of seconds (0 for none)",
            ));
        }
        if self.min_frequency == Some(0) {
            return Err(Error::invalid_config(
                "remote.min_frequency",
                0,
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Reads the file `path` set by `key`, refusing (before reading) one over [`MAX_TLS_FILE_BYTES`]
/// and an empty one.
fn read_bounded(key: &'static str, path: &std::path::Path) -> Result<PemFile> {
    use std::io::Read;
    let bad = |why: String| Error::invalid_config(key, path.display(), why);
    let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open the file ({e})")))?;
    let mut bytes = Vec::new();
    file.take(MAX_TLS_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read the file ({e})")))?;
    if bytes.len() as u64 > MAX_TLS_FILE_BYTES {
        return Err(bad(format!(
            "the file is larger than {MAX_TLS_FILE_BYTES} bytes: not a PEM certificate or key"
        )));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(bad("the file is empty".to_string()));
    }
    Ok(PemFile {
        key,
        path: path.to_path_buf(),
        bytes,
    })
}

/// `url` with the password of its `user:pass@` part (if any) replaced by `<redacted>`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<redacted>".to_string();
    };
    let (authority, tail) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:<redacted>@{hosts}{tail}")
            } else {
                // `redis://password@host` (no user): the part before '@' is the password.
                format!("{scheme}://<redacted>@{hosts}{tail}")
            }
        }
        None => url.to_string(),
    }
}

/// The longest `remote.url` (a cluster of many nodes fits well within it).
pub const MAX_URL_LEN: usize = 16 * 1024;

/// Checks the form every `remote.url` has, whatever the store: `scheme://rest`, the scheme
/// letters, digits, `+`, `-` or `.`, no whitespace or control character, at most
/// [`MAX_URL_LEN`] characters. Which schemes exist and how the rest reads is the store's
/// (the storage backends' remote-backend registry). Errors name `remote.url` and show it
/// redacted.
pub fn validate_url(url: &str) -> Result<()> {
    if url.len() > MAX_URL_LEN {
        return Err(Error::invalid_config(
            "remote.url",
            redact_url(url),
            format!(
                "at most {MAX_URL_LEN} characters; this one has {}",
                url.len()
            ),
        ));
    }
    let bad = |why: &str| Error::invalid_config("remote.url", redact_url(url), why.to_string());
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad("expected scheme://…, e.g. redis://host:6379"));
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    {
        return Err(bad(
            "the scheme before :// is letters, digits, '+', '-' or '.'",
        ));
    }
    if rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("no whitespace or control characters"));
    }
    Ok(())
}
