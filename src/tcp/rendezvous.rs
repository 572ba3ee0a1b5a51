//! Rendezvous on one machine: how a leader and its workers find each other with no address
//! configured, whether or not they share a process.
//!
//! Owns the private per-user directory, the rendezvous file (its name, format, creation and
//! removal), [`RendezvousLeader`] (a [`TcpLeader`] that publishes such a file) and
//! [`LazyTcpWorker`] (a worker end that finds its leader — by address or by rendezvous — and
//! connects on first use).
//!
//! # Protocol
//!
//! Both halves know an *instance id* (vLLM: `kv_transfer_config.engine_id`, a uuid4 the frontend
//! makes and pickles into the scheduler's and the workers' processes).
//!
//! 1. The leader listens on `127.0.0.1:0` (an ephemeral port: two engines never fight over one)
//!    with a fresh 256-bit random token, and publishes `{"version":1,"address":…,"token":…,
//!    "pid":…,"start":…}` (`start`: the process's start time, so a recycled pid is not taken
//!    for the leader) as `leader-<hex>.json` in the directory, where `<hex>` is the first 32 hex digits
//!    of SHA-256 of the instance id. The file is written to a temporary name created with
//!    `O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600, synced, then linked to its final name (an existing
//!    one is replaced, by an atomic rename, only when its pid is dead); a live leader of the same
//!    instance is an [`ErrorKind::AlreadyExists`] error. The leader removes the file (if it is
//!    still its own) as soon as the session started — every rank confirmed its allocation, after
//!    which no worker can join — and in any case when dropped (the Python package also does it
//!    at process exit). So a file outlives its leader only when the leader was killed during
//!    start-up; publishing removes such files of dead processes.
//! 2. A worker polls for the file (10–200 ms backoff) until its deadline: vLLM builds workers
//!    before the scheduler, so the worker end resolves lazily, on first use, inside the
//!    start-up barrier. A file whose process is gone is stale and ignored. It then connects to
//!    the address with the token, as a [`TcpWorker`] does; an address that does not answer
//!    within 2 s sends it back to reading the file (a new leader may have replaced it).
//!
//! # Trust model
//!
//! The directory is created 0700; an existing one must be a real directory (not a symlink),
//! owned by this effective uid, with no group or other permission bits, or it is refused with an
//! [`ErrorKind::InvalidConfig`] error naming it. Rendezvous files are opened with `O_NOFOLLOW`
//! and must be regular files owned by this uid with mode 0600. So only this user (and root) can
//! read the token. Anyone on the machine can connect to the loopback port, but the leader
//! refuses a HELLO without the token (constant-time comparison), so another user cannot join.
//! The instance id is not a secret (it may appear on a command line); the token is. Traffic is
//! not encrypted, which loopback does not need.
//!
//! The default directory is `$XDG_RUNTIME_DIR/kvbm-<uid>` (when that variable names an absolute
//! path), else `<temp dir>/kvbm-<uid>`; `tcp.rendezvous_dir` / `KVBM_RENDEZVOUS_DIR` overrides it.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::connector::transport::{
    LeaderMessage, LeaderTransport, Rank, WorkerMessage, WorkerTransport,
};
use crate::error::{Error, ErrorKind, Result};

use super::{TcpLeader, TcpWorker};

/// The rendezvous file format's version.
const VERSION: u32 = 1;
/// A rendezvous file is small; anything larger is not one.
const MAX_FILE_BYTES: u64 = 4096;
/// Longest pause between two looks for a rendezvous file.
const MAX_POLL: Duration = Duration::from_millis(200);
/// How long a worker tries a published address before it reads the rendezvous file again.
const RECONNECT_SLICE: Duration = Duration::from_secs(2);
/// The setting that names the directory, for error messages.
const DIR_SETTING: &str = "tcp.rendezvous_dir (KVBM_RENDEZVOUS_DIR)";

/// The default rendezvous directory: `$XDG_RUNTIME_DIR/kvbm-<uid>` when that variable is an
/// absolute path, else `<temp dir>/kvbm-<uid>`.
pub fn default_dir() -> PathBuf {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .unwrap_or_else(std::env::temp_dir);
    base.join(format!("kvbm-{}", euid()))
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn insecure(dir: &Path, why: impl std::fmt::Display) -> Error {
    Error::invalid_config(DIR_SETTING, dir.display(), why).with("path", dir.display())
}

/// Creates `dir` (mode 0700, parents as needed) when missing, then checks it is private: a
/// directory, not a symlink, owned by this effective uid, no group/other permission bits.
/// Anything else is an [`ErrorKind::InvalidConfig`] error naming the directory and what is wrong.
pub fn private_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.is_absolute() {
        return Err(insecure(dir, "must be an absolute path"));
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == IoKind::AlreadyExists => {}
        Err(e) if e.kind() == IoKind::NotFound => {
            // Parents are missing: create them (the umask applies to them), then this one 0700.
            if let Some(parent) = dir.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(|e| {
                        Error::io("create the kvbm rendezvous directory", e)
                            .with("path", parent.display())
                    })?;
            }
            match fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == IoKind::AlreadyExists => {}
                Err(e) => {
                    return Err(Error::io("create the kvbm rendezvous directory", e)
                        .with("path", dir.display()))
                }
            }
        }
        Err(e) => {
            return Err(
                Error::io("create the kvbm rendezvous directory", e).with("path", dir.display())
            )
        }
    }
    let meta = fs::symlink_metadata(dir).map_err(|e| {
        Error::io("inspect the kvbm rendezvous directory", e).with("path", dir.display())
    })?;
    if meta.file_type().is_symlink() {
        return Err(insecure(dir, "is a symbolic link; refusing to follow it"));
    }
    if !meta.is_dir() {
        return Err(insecure(dir, "is not a directory"));
    }
    let me = euid();
    if meta.uid() != me {
        return Err(insecure(
            dir,
            format!(
                "is owned by uid {}, not by this user (uid {me})",
                meta.uid()
            ),
        ));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(insecure(
            dir,
            format!("has mode {mode:03o}; it must be private to its owner (0700)"),
        ));
    }
    Ok(dir.to_path_buf())
}

/// The rendezvous file of `instance` in `dir`: `leader-<first 32 hex digits of SHA-256>.json`.
pub fn rendezvous_path(dir: &Path, instance: &str) -> PathBuf {
    let digest = Sha256::digest(instance.as_bytes());
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    dir.join(format!("leader-{hex}.json"))
}

/// What a leader publishes.
#[derive(Clone, Serialize, Deserialize)]
struct Record {
    version: u32,
    address: SocketAddr,
    token: String,
    pid: u32,
    /// The leader process's start time (`/proc/<pid>/stat` field 22, clock ticks since boot),
    /// so a recycled pid does not make a stale file look live; absent where `/proc` is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    start: Option<u64>,
}

impl Record {
    /// Whether the leader that wrote this record still runs.
    fn leader_alive(&self) -> bool {
        pid_alive(self.pid)
            && match (self.start, start_time(self.pid)) {
                (Some(recorded), Some(now)) => recorded == now,
                _ => true,
            }
    }
}

/// A process's start time from `/proc/<pid>/stat` (field 22, after the parenthesised name).
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Fields from 3 (state) on; the start time is field 22.
    after_name.split_whitespace().nth(19)?.parse().ok()
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("address", &self.address)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// Whether process `pid` exists (a process of another user counts).
fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks the process exists.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A fresh 256-bit token, hex.
fn fresh_token() -> Result<String> {
    let mut bytes = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("read random bytes for the kvbm rendezvous token", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Reads the rendezvous file at `path`: `Ok(None)` when there is none; an error when it is not a
/// private regular file of this user or does not decode.
fn read_record(path: &Path) -> Result<Option<Record>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == IoKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(insecure(path, "is a symbolic link; refusing to follow it"))
        }
        Err(e) => {
            return Err(Error::io("open the kvbm rendezvous file", e).with("path", path.display()))
        }
    };
    let meta = file.metadata().map_err(|e| {
        Error::io("inspect the kvbm rendezvous file", e).with("path", path.display())
    })?;
    if !meta.is_file() {
        return Err(insecure(path, "is not a regular file"));
    }
    if meta.uid() != euid() {
        return Err(insecure(
            path,
            format!("is owned by uid {}, not by this user", meta.uid()),
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(insecure(path, "is readable or writable by others"));
    }
    let decode = |why: String| Error::new(ErrorKind::Decode, why).with("path", path.display());
    let mut text = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| Error::io("read the kvbm rendezvous file", e).with("path", path.display()))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(decode(format!(
            "kvbm rendezvous file is larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    let record: Record = serde_json::from_slice(&text)
        .map_err(|e| decode(format!("kvbm rendezvous file does not decode: {e}")))?;
    if record.version != VERSION {
        return Err(decode(format!(
            "kvbm rendezvous file has version {}, this build reads {VERSION}",
            record.version
        )));
    }
    Ok(Some(record))
}

/// Removes rendezvous files and temporary files of processes that are gone (best effort).
fn remove_stale(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        if name.starts_with("leader-") && name.ends_with(".json") {
            if let Ok(Some(r)) = read_record(&path) {
                if !r.leader_alive() {
                    let _ = fs::remove_file(&path);
                }
            }
        } else if let Some(pid) = temp_pid(name) {
            if !pid_alive(pid) {
                let _ = fs::remove_file(&path);
            }
        }
    }
}

/// The pid in a temporary file name `.leader-<hex>.json.<pid>.<n>.tmp`.
fn temp_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(".leader-")?.strip_suffix(".tmp")?;
    let mut parts = rest.rsplitn(3, '.');
    let _n = parts.next()?;
    parts.next()?.parse().ok()
}

/// Writes `record` for `instance` in `dir`, as the module documentation says.
fn publish(dir: &Path, instance: &str, record: &Record) -> Result<PathBuf> {
    remove_stale(dir);
    let path = rendezvous_path(dir, instance);
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::internal("rendezvous file name is not UTF-8"))?
        .to_owned();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".{file_name}.{}.{nanos}.tmp", record.pid));
    let text = serde_json::to_vec(record)
        .map_err(|e| Error::internal(format!("cannot encode the rendezvous record: {e}")))?;
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(&text)?;
            f.sync_all()
        });
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io("write the kvbm rendezvous file", e).with("path", tmp.display()));
    }
    let placed = match fs::hard_link(&tmp, &path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == IoKind::AlreadyExists => match read_record(&path) {
            Ok(Some(old)) if old.leader_alive() => Err(Error::new(
                ErrorKind::AlreadyExists,
                format!(
                    "another kvbm leader (pid {}, {}) already serves instance {instance:?}; give \
                     each engine its own instance id",
                    old.pid, old.address
                ),
            )
            .with("path", path.display())
            .with("instance", instance)),
            // Stale, unreadable or undecodable: replace it atomically.
            _ => fs::rename(&tmp, &path).map_err(|e| {
                Error::io("replace a stale kvbm rendezvous file", e).with("path", path.display())
            }),
        },
        Err(e) => {
            Err(Error::io("publish the kvbm rendezvous file", e).with("path", path.display()))
        }
    };
    let _ = fs::remove_file(&tmp);
    placed.map(|()| path)
}

/// Looks for the rendezvous file of `instance` in `dir` until `deadline`: the first one whose
/// leader process is alive. Missing it is an [`ErrorKind::Timeout`] error naming the instance
/// and the file; an unsafe directory or file is an error at once.
fn resolve(dir: &Path, instance: &str, deadline: Instant) -> Result<Record> {
    let path = rendezvous_path(dir, instance);
    let started = Instant::now();
    let mut backoff = Duration::from_millis(10);
    let mut stale = None;
    loop {
        match read_record(&path)? {
            Some(r) if r.leader_alive() => return Ok(r),
            Some(r) => stale = Some(r.pid),
            None => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let seen = match stale {
                Some(pid) => format!("only a stale file of dead pid {pid}"),
                None => "no file".to_string(),
            };
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "no kvbm leader published instance {instance:?} within {:.1}s ({seen}); is \
                     the scheduler running on this machine with the same instance id?",
                    started.elapsed().as_secs_f64()
                ),
            )
            .with("instance", instance)
            .with("path", path.display()));
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_POLL);
    }
}

/// A [`TcpLeader`] on an ephemeral loopback port with a fresh token, published in a rendezvous
/// file that dropping it removes.
#[derive(Debug)]
pub struct RendezvousLeader {
    leader: Arc<TcpLeader>,
    path: PathBuf,
    token: String,
    unpublished: AtomicBool,
}

impl RendezvousLeader {
    /// Listens for `world_size` workers of `instance` and publishes the rendezvous file in `dir`
    /// (made private first, see [`private_dir`]).
    pub fn bind(dir: &Path, instance: &str, world_size: usize) -> Result<Arc<RendezvousLeader>> {
        if instance.is_empty() {
            return Err(Error::invalid_argument(
                "the rendezvous instance id must not be empty",
            ));
        }
        let dir = private_dir(dir)?;
        let token = fresh_token()?;
        let leader = TcpLeader::bind(
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            world_size,
            Some(token.clone()),
        )?;
        let record = Record {
            version: VERSION,
            address: leader.local_addr(),
            token: token.clone(),
            pid: std::process::id(),
            start: start_time(std::process::id()),
        };
        let path = publish(&dir, instance, &record)?;
        tracing::info!(instance, addr = %record.address, path = %path.display(), "kvbm leader published its rendezvous file");
        Ok(Arc::new(RendezvousLeader {
            leader,
            path,
            token,
            unpublished: AtomicBool::new(false),
        }))
    }

    /// The loopback address listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.leader.local_addr()
    }

    /// The rendezvous file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The TCP leader underneath.
    pub fn tcp(&self) -> &Arc<TcpLeader> {
        &self.leader
    }

    /// Removes the rendezvous file while it is still this leader's (a successor may have
    /// replaced it); workers that connected stay connected, new ones no longer find it.
    /// Idempotent; dropping the leader does it too. For a process about to exit, where the
    /// leader may never be dropped.
    pub fn unpublish(&self) {
        if self.unpublished.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(Some(r)) = read_record(&self.path) {
            if r.token == self.token {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for RendezvousLeader {
    fn drop(&mut self) {
        self.unpublish();
    }
}

impl RendezvousLeader {
    /// Once the session started (every rank confirmed its allocation) no worker can join any
    /// more, so the file has done its work: remove it, which leaves nothing behind even when
    /// the process is later killed (vLLM's EngineCore is, on shutdown).
    fn unpublish_once_started(&self) {
        if !self.unpublished.load(Ordering::Relaxed) && self.leader.is_session_started() {
            self.unpublish();
        }
    }
}

impl LeaderTransport for RendezvousLeader {
    fn world_size(&self) -> usize {
        self.leader.world_size()
    }

    fn send(&self, rank: Rank, msg: LeaderMessage) -> Result<()> {
        self.leader.send(rank, msg)
    }

    fn try_recv(&self) -> Result<Option<(Rank, WorkerMessage)>> {
        let got = self.leader.try_recv();
        self.unpublish_once_started();
        got
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<(Rank, WorkerMessage)>> {
        let got = self.leader.recv_timeout(timeout);
        self.unpublish_once_started();
        got
    }
}

/// Where a [`LazyTcpWorker`] finds its leader.
#[derive(Clone)]
pub enum LeaderTarget {
    /// A configured address, with the token to present (if any).
    Address {
        /// The leader's address.
        addr: SocketAddr,
        /// The shared secret, if any.
        token: Option<String>,
    },
    /// The rendezvous file of `instance` in `dir`.
    Rendezvous {
        /// The private rendezvous directory.
        dir: PathBuf,
        /// The id both halves know.
        instance: String,
    },
}

impl std::fmt::Debug for LeaderTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Address { addr, token } => f
                .debug_struct("Address")
                .field("addr", addr)
                .field("token", &token.as_ref().map(|_| "<redacted>"))
                .finish(),
            Self::Rendezvous { dir, instance } => f
                .debug_struct("Rendezvous")
                .field("dir", dir)
                .field("instance", instance)
                .finish(),
        }
    }
}

/// A worker end that finds its leader and connects on first use (inside the start-up barrier,
/// which may run in the background), within one deadline for both; a failure is remembered and
/// returned by every later call.
#[derive(Debug)]
pub struct LazyTcpWorker {
    target: LeaderTarget,
    rank: Rank,
    world_size: usize,
    deadline: Duration,
    conn: Mutex<Option<Result<Arc<TcpWorker>>>>,
}

impl LazyTcpWorker {
    /// The end of `rank` of `world_size`, reaching its leader through `target` within
    /// `deadline` of first use. A rendezvous directory is made private (see [`private_dir`])
    /// now, so an unsafe one fails here.
    pub fn new(
        target: LeaderTarget,
        rank: Rank,
        world_size: usize,
        deadline: Duration,
    ) -> Result<LazyTcpWorker> {
        if rank >= world_size {
            return Err(Error::out_of_range("rank", rank, world_size));
        }
        if let LeaderTarget::Rendezvous { dir, instance } = &target {
            if instance.is_empty() {
                return Err(Error::invalid_argument(
                    "the rendezvous instance id must not be empty",
                ));
            }
            private_dir(dir)?;
        }
        Ok(LazyTcpWorker {
            target,
            rank,
            world_size,
            deadline,
            conn: Mutex::new(None),
        })
    }

    fn connect(&self) -> Result<Arc<TcpWorker>> {
        let end = Instant::now() + self.deadline;
        let left = || {
            end.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let (dir, instance) = match &self.target {
            LeaderTarget::Address { addr, token } => {
                return TcpWorker::connect(*addr, self.rank, self.world_size, token.clone(), left())
            }
            LeaderTarget::Rendezvous { dir, instance } => (dir, instance),
        };
        // A published leader that does not answer (it is exiting, or the file outlived it under
        // a recycled pid) is given a short slice; then the file is read again, in case a new
        // leader replaced it.
        loop {
            let r = resolve(dir, instance, end)?;
            let slice = left().min(RECONNECT_SLICE);
            match TcpWorker::connect(r.address, self.rank, self.world_size, Some(r.token), slice) {
                Err(e) if e.kind() == ErrorKind::Timeout && Instant::now() < end => {
                    tracing::debug!(instance = %instance, error = %e, "kvbm rendezvous leader not reachable; reading the file again");
                }
                other => return other,
            }
        }
    }

    fn get(&self) -> Result<Arc<TcpWorker>> {
        let mut conn = self.conn.lock();
        let result = conn.get_or_insert_with(|| self.connect());
        result.clone()
    }
}

impl WorkerTransport for LazyTcpWorker {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn send(&self, msg: WorkerMessage) -> Result<()> {
        self.get()?.send(msg)
    }

    fn recv_timeout(&self, timeout: Duration) -> Result<Option<LeaderMessage>> {
        self.get()?.recv_timeout(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_tmp() -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("kvbm");
        (t, dir)
    }

    #[test]
    fn private_dir_is_created_0700_and_reused() {
        let (_t, dir) = private_tmp();
        private_dir(&dir).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        private_dir(&dir).unwrap();
        // Missing parents are created too.
        let deep = dir.join("a/b");
        private_dir(&deep).unwrap();
    }

    #[test]
    fn refuses_open_dir_symlink_file_and_relative() {
        let (t, dir) = private_tmp();
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o770)).unwrap();
        let e = private_dir(&dir).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig);
        assert!(e.to_string().contains("mode 770"), "{e}");
        assert!(e.to_string().contains("KVBM_RENDEZVOUS_DIR"), "{e}");

        let real = t.path().join("real");
        fs::DirBuilder::new().mode(0o700).create(&real).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = private_dir(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");

        let file = t.path().join("file");
        fs::write(&file, b"x").unwrap();
        let e = private_dir(&file).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");

        let e = private_dir(Path::new("relative/dir")).unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }

    #[test]
    fn refuses_a_foreign_owned_dir() {
        // Only a directory owned by someone else shows this; as root, / is ours, so use a
        // directory owned by root when not root, and skip otherwise.
        if euid() == 0 {
            let (_t, dir) = private_tmp();
            fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
            // SAFETY: chown on a path we own, to an unprivileged uid.
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
            let e = private_dir(&dir).unwrap_err();
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        } else {
            let e = private_dir(Path::new("/")).unwrap_err();
            assert!(e.to_string().contains("owned by uid 0"), "{e}");
        }
    }

    #[test]
    fn file_names_differ_per_instance_and_hide_the_id() {
        let d = Path::new("/x");
        let a = rendezvous_path(d, "engine-a");
        let b = rendezvous_path(d, "engine-b");
        assert_ne!(a, b);
        assert_eq!(a, rendezvous_path(d, "engine-a"));
        assert!(!a.to_string_lossy().contains("engine"));
    }

    fn worker(dir: &Path, instance: &str, rank: Rank, ws: usize, secs: f64) -> LazyTcpWorker {
        LazyTcpWorker::new(
            LeaderTarget::Rendezvous {
                dir: dir.to_path_buf(),
                instance: instance.into(),
            },
            rank,
            ws,
            Duration::from_secs_f64(secs),
        )
        .unwrap()
    }

    fn round_trip(leader: &RendezvousLeader, w: &LazyTcpWorker) {
        w.send(WorkerMessage::Ready).unwrap();
        let (rank, msg) = leader
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!((rank, msg), (w.rank(), WorkerMessage::Ready));
        leader
            .send(w.rank(), LeaderMessage::Refused("bye".into()))
            .unwrap();
        assert_eq!(
            w.recv_timeout(Duration::from_secs(5)).unwrap(),
            Some(LeaderMessage::Refused("bye".into()))
        );
    }

    #[test]
    fn worker_before_leader_meets_it_and_file_is_private_and_removed() {
        let (_t, dir) = private_tmp();
        let w = worker(&dir, "engine-1", 0, 1, 10.0);
        let d2 = dir.clone();
        let leader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            RendezvousLeader::bind(&d2, "engine-1", 1).unwrap()
        });
        // First use resolves (waiting for the leader) and connects.
        w.send(WorkerMessage::Ready).unwrap();
        let leader = leader.join().unwrap();
        assert!(leader.local_addr().ip().is_loopback());
        let meta = fs::symlink_metadata(leader.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(leader.path().exists());
        let (rank, msg) = leader
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!((rank, msg), (0, WorkerMessage::Ready));
        // Every rank is ready: the session started and the file is gone.
        assert!(leader.tcp().is_session_started());
        let path = leader.path().to_path_buf();
        assert!(
            !path.exists(),
            "the leader removes its file once the session started"
        );
        drop(leader);
        // Dropping a leader removes its file too.
        let early = RendezvousLeader::bind(&dir, "engine-1", 1).unwrap();
        assert!(path.exists());
        drop(early);
        assert!(!path.exists(), "the leader removes its file on drop");
        // unpublish leaves a successor's file alone.
        let first = RendezvousLeader::bind(&dir, "engine-1", 1).unwrap();
        first.unpublish();
        assert!(!path.exists());
        let second = RendezvousLeader::bind(&dir, "engine-1", 1).unwrap();
        first.unpublish();
        drop(first);
        assert!(path.exists(), "a successor's file is not removed");
        drop(second);
        assert!(!path.exists());
    }

    #[test]
    fn two_engines_on_one_machine_do_not_cross() {
        let (_t, dir) = private_tmp();
        let a = RendezvousLeader::bind(&dir, "engine-a", 1).unwrap();
        let b = RendezvousLeader::bind(&dir, "engine-b", 1).unwrap();
        assert_ne!(a.local_addr(), b.local_addr());
        assert_ne!(a.path(), b.path());
        // A second live leader of the same instance is refused, and leaves the first's file.
        let e = RendezvousLeader::bind(&dir, "engine-a", 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert!(e.to_string().contains("engine-a"), "{e}");
        assert!(a.path().exists());
        let wa = worker(&dir, "engine-a", 0, 1, 5.0);
        let wb = worker(&dir, "engine-b", 0, 1, 5.0);
        round_trip(&a, &wa);
        round_trip(&b, &wb);
        assert_eq!(a.tcp().connected_ranks(), vec![0]);
        assert_eq!(b.tcp().connected_ranks(), vec![0]);
        assert_eq!(a.recv_timeout(Duration::from_millis(50)).unwrap(), None);
        assert_eq!(b.recv_timeout(Duration::from_millis(50)).unwrap(), None);
    }

    /// A pid that is not running: a reaped child's.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid));
        pid
    }

    #[test]
    fn stale_file_is_ignored_then_replaced() {
        let (_t, dir) = private_tmp();
        private_dir(&dir).unwrap();
        let stale = Record {
            version: VERSION,
            address: "127.0.0.1:9".parse().unwrap(),
            token: "old".into(),
            pid: dead_pid(),
            start: None,
        };
        publish(&dir, "engine-s", &stale).unwrap();
        // A worker does not take the stale file: it times out saying so.
        let w = worker(&dir, "engine-s", 0, 1, 0.3);
        let e = w.send(WorkerMessage::Ready).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.to_string().contains("stale file of dead pid"), "{e}");
        // A new leader replaces it, and a worker meets it.
        let leader = RendezvousLeader::bind(&dir, "engine-s", 1).unwrap();
        round_trip(&leader, &worker(&dir, "engine-s", 0, 1, 5.0));
        // Stale temporary files of dead processes are cleaned up by the next publisher.
        let tmp = dir.join(format!(".leader-00.json.{}.1.tmp", dead_pid()));
        fs::write(&tmp, b"x").unwrap();
        let _other = RendezvousLeader::bind(&dir, "engine-t", 1).unwrap();
        assert!(!tmp.exists());
    }

    #[test]
    fn recycled_pid_is_stale_and_an_unreachable_leader_is_read_again() {
        let (_t, dir) = private_tmp();
        private_dir(&dir).unwrap();
        // Our own pid, but another start time: a recycled pid.
        let me = std::process::id();
        let recycled = Record {
            version: VERSION,
            address: "127.0.0.1:9".parse().unwrap(),
            token: "old".into(),
            pid: me,
            start: start_time(me).map(|t| t + 1),
        };
        assert!(start_time(me).is_some(), "/proc is readable here");
        assert!(!recycled.leader_alive());
        // A live-looking file with an address nobody answers: the worker keeps reading the file
        // and meets the leader that replaces it.
        let unreachable = Record {
            start: start_time(me),
            ..recycled
        };
        assert!(unreachable.leader_alive());
        let path = publish(&dir, "engine-r", &unreachable).unwrap();
        let w = worker(&dir, "engine-r", 0, 1, 10.0);
        let d2 = dir.clone();
        let leader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            fs::remove_file(&path).unwrap();
            RendezvousLeader::bind(&d2, "engine-r", 1).unwrap()
        });
        w.send(WorkerMessage::Ready).unwrap();
        let leader = leader.join().unwrap();
        assert_eq!(
            leader.recv_timeout(Duration::from_secs(5)).unwrap(),
            Some((0, WorkerMessage::Ready))
        );
    }

    #[test]
    fn wrong_token_is_refused() {
        let (_t, dir) = private_tmp();
        let leader = RendezvousLeader::bind(&dir, "engine-k", 1).unwrap();
        let w = LazyTcpWorker::new(
            LeaderTarget::Address {
                addr: leader.local_addr(),
                token: Some("guessed".into()),
            },
            0,
            1,
            Duration::from_secs(5),
        )
        .unwrap();
        let e = w.send(WorkerMessage::Ready).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        let none = LazyTcpWorker::new(
            LeaderTarget::Address {
                addr: leader.local_addr(),
                token: None,
            },
            0,
            1,
            Duration::from_secs(5),
        )
        .unwrap();
        let e = none.send(WorkerMessage::Ready).unwrap_err();
        assert!(e.to_string().contains("authentication required"), "{e}");
        assert!(leader.tcp().connected_ranks().is_empty());
    }

    #[test]
    fn planted_symlink_or_open_file_is_refused() {
        let (t, dir) = private_tmp();
        private_dir(&dir).unwrap();
        let target = t.path().join("elsewhere");
        fs::write(&target, b"{}").unwrap();
        let path = rendezvous_path(&dir, "engine-l");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = read_record(&path).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        fs::remove_file(&path).unwrap();
        fs::write(&path, b"{}").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_record(&path).unwrap_err();
        assert!(e.to_string().contains("by others"), "{e}");
    }
}
