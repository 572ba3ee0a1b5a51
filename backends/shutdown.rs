//! A terminating signal saves the persisted disk indexes first.
//!
//! SIGTERM (how systemd, Kubernetes and `kill` stop a process), SIGHUP and SIGINT end a process
//! at once when it leaves them at their default action: no destructor, no `atexit` hook, so a
//! persisted tier would lose what it stored since its last save. When the first persisted tier
//! opens, each of these signals whose action is still the default gets a handler that only
//! writes the signal's number to a pipe; a thread reads it, saves every changed persisted index
//! of the process (waiting at most [`SIGNAL_SAVE_GRACE`]), restores the default action and
//! raises the signal again, so the process ends as it would have, with the same status.
//!
//! A signal the process already handles (Python's SIGINT, an engine's own SIGTERM handler) is
//! left alone: that handler's orderly exit closes the tiers, which save. Set
//! `KVBM_SIGNAL_SAVE=0` to install nothing.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;
use std::time::Duration;

/// The longest a terminating signal waits for the indexes to be saved before the process ends.
pub const SIGNAL_SAVE_GRACE: Duration = Duration::from_secs(5);

/// The signals handled (when at their default action).
const SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGHUP, libc::SIGINT];

/// The pipe's write end (-1 until installed).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

static INSTALL: Once = Once::new();

/// The process that installed the handlers: a child made by `fork` inherits them and the pipe,
/// but not the thread that reads it.
static INSTALLER: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // SAFETY: getpid, signal, raise and write are async-signal-safe; errno is saved and
    // restored around them; the buffer is one valid byte.
    unsafe {
        let errno = *libc::__errno_location();
        if libc::getpid() != INSTALLER.load(Ordering::Relaxed) {
            // A forked child: the signal takes its default action there, as if never handled.
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        } else {
            let fd = PIPE_WRITE.load(Ordering::Relaxed);
            if fd >= 0 {
                // A full pipe (a second signal before the first is handled) drops the byte:
                // one is enough.
                let b = sig as u8;
                libc::write(fd, std::ptr::addr_of!(b).cast(), 1);
            }
        }
        *libc::__errno_location() = errno;
    }
}

/// Installs the handlers once per process (see the module docs); a failure is logged, never an
/// error: the tiers still save on their own within their bound.
pub(crate) fn install() {
    INSTALL.call_once(|| {
        if std::env::var("KVBM_SIGNAL_SAVE").is_ok_and(|v| v.trim() == "0") {
            return;
        }
        if let Err(e) = try_install() {
            tracing::warn!(error = %e, "persisted disk: no save on SIGTERM/SIGHUP/SIGINT");
        }
    });
}

fn try_install() -> std::io::Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (read_fd, write_fd) = (fds[0], fds[1]);
    // The reader blocks; only the writer (the handler) must never block.
    // SAFETY: plain fcntl calls on the descriptor just created.
    unsafe {
        let flags = libc::fcntl(read_fd, libc::F_GETFL);
        libc::fcntl(read_fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    // SAFETY: getpid has no preconditions.
    INSTALLER.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    if let Err(e) = std::thread::Builder::new()
        .name("kvbm-signal-save".into())
        .spawn(move || wait_for_signal(read_fd))
    {
        // SAFETY: closing the two descriptors just created, used by nothing else.
        unsafe {
            libc::close(read_fd);
            libc::close(write_fd);
        }
        return Err(e);
    }
    PIPE_WRITE.store(write_fd, Ordering::Relaxed);
    for sig in SIGNALS {
        // SAFETY: sigaction with a null new action only reads the current one into `old`.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            continue;
        }
        if old.sa_sigaction != libc::SIG_DFL {
            continue; // handled (or ignored) by the process: left alone
        }
        // SAFETY: a zeroed sigaction with our handler, an empty mask and SA_RESTART.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
    Ok(())
}

/// The signal thread: on a signal, saves (bounded), then ends the process by the signal.
fn wait_for_signal(read_fd: libc::c_int) {
    let mut b = 0u8;
    loop {
        // SAFETY: reads one byte into a valid buffer.
        let n = unsafe { libc::read(read_fd, std::ptr::addr_of_mut!(b).cast(), 1) };
        if n == 1 {
            break;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return;
    }
    let sig = libc::c_int::from(b);
    let (tx, rx) = std::sync::mpsc::channel();
    let saver = std::thread::Builder::new()
        .name("kvbm-signal-save".into())
        .spawn(move || {
            let _ = tx.send(super::slot_file::flush_all_persisted());
        });
    match saver.map(|_| rx.recv_timeout(SIGNAL_SAVE_GRACE)) {
        Ok(Ok((n, None))) => {
            tracing::info!(signal = sig, saved = n, "persisted disk indexes saved")
        }
        Ok(Ok((_, Some(e)))) => {
            tracing::warn!(signal = sig, error = %e, "persisted disk index not saved")
        }
        _ => tracing::warn!(signal = sig, "persisted disk indexes not saved in time"),
    }
    // SAFETY: restoring the default action and raising the signal for the whole process; if it
    // is blocked everywhere and the raise returns, exit with the shell's status for it.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
        libc::_exit(128 + sig);
    }
}
