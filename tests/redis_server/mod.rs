//! A `redis-server` of a test's own, and the SKIP-or-fail rule, shared by tests/redis.rs and
//! tests/redis_e2e.rs.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Without a dependency a test prints `SKIP <test>: <reason>` past the harness's capture; under
/// CI=true it fails instead (scripts/test.sh installs and starts what it needs).
pub fn skip(reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("redis test")
        .to_owned();
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true and {reason} (scripts/test.sh installs and starts the Redis servers)");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIP {test}: {reason}");
}

/// A `redis-server` on a free loopback port with `args` added to its command line, no
/// persistence; killed when dropped.
pub struct OwnServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    args: Vec<String>,
}

impl OwnServer {
    /// Starts one; `None` (after [`skip`]) when `redis-server` is not installed.
    pub fn start(extra: &[&str]) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            skip("redis-server is not on PATH (apt-get install redis-server)");
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut s = Self {
            child: None,
            port,
            dir: tempfile::tempdir().expect("temp dir"),
            args: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        Some(s)
    }

    /// Starts (again) on the same port, empty.
    pub fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("redis-server starts"));
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < until,
                "redis-server did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `sig` to the server (SIGSTOP / SIGCONT).
    pub fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().expect("running").id() as i32;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    /// Runs one command with `redis-cli` against this server; its output.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
    }
}
