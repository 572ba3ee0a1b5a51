//! The library's `tracing` events in Python's `logging` (logger `kvbm_connector`), filtered by
//! `KVBM_LOG` ([`crate::log`]; default `warn`).
//!
//! Events come from any thread: the caller's (inside a call that released the GIL) and the
//! connector's background threads (transport, completions, disk I/O), some of which hold our
//! locks when they log. Taking the GIL there could deadlock: a Python thread that holds the GIL
//! may be waiting on that very lock or thread (an object's drop, run by Python with the GIL held,
//! joins our threads). So the layer only queues: it formats the event and pushes it, under a lock
//! held for the push alone and never while Python runs. The queue is drained into `logging`
//! with the GIL held and no lock of ours: at the end of every call into the bindings
//! ([`super::Guarded::call`], [`super::detached`]) and by `_kvbm.drain_logs()`. A background
//! thread's warning therefore shows at the engine's next call (every scheduler step calls us).
//! The queue is bounded ([`QUEUE_CAP`]); past it the oldest records are dropped and the next
//! drain says how many.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// The Python logger's name.
pub(crate) const LOGGER: &str = "kvbm_connector";
/// Records kept between drains; past it the oldest are dropped (and counted).
pub(crate) const QUEUE_CAP: usize = 4096;

struct Record {
    level: i32,
    text: String,
}

struct Queue {
    records: VecDeque<Record>,
    dropped: u64,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    records: VecDeque::new(),
    dropped: 0,
});

/// Set after a record is queued, cleared by [`drain`] before it empties the queue: the binding
/// calls that find nothing queued (nearly all) pay one atomic load, not the queue's lock. A record
/// queued while a drain runs sets it again, so it is handed over by the next drain.
static PENDING: AtomicBool = AtomicBool::new(false);

/// Python's level for a tracing level.
fn py_level(level: &Level) -> i32 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// The event's message, then its other fields as `name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
}

/// Queues every event that passes the filter.
struct QueueLayer;

impl<S: Subscriber> Layer<S> for QueueLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut t = Text::default();
        event.record(&mut t);
        let meta = event.metadata();
        let record = Record {
            level: py_level(meta.level()),
            text: format!("{}{} [{}]", t.message, t.fields, meta.target()),
        };
        let mut q = QUEUE.lock();
        if q.records.len() >= QUEUE_CAP {
            q.records.pop_front();
            q.dropped += 1;
        }
        q.records.push_back(record);
        drop(q);
        PENDING.store(true, Ordering::Release);
    }
}

/// Installs the layer as the process's global subscriber (once; nothing when the process already
/// has one, e.g. a host program that installed its own).
pub(crate) fn install() {
    let (filter, complaint) = crate::log::env_filter();
    let _ = tracing_subscriber::registry()
        .with(QueueLayer.with_filter(filter))
        .try_init();
    if let Some(c) = complaint {
        tracing::warn!("{c}");
    }
}

/// Hands the queued records to `logging.getLogger("kvbm_connector")`. Needs the GIL, takes our
/// queue's lock only to empty it. Errors from `logging` (interpreter shutting down, a failing
/// handler) are dropped: a log record never fails the call that drains it.
pub(crate) fn drain(py: Python<'_>) {
    if !PENDING.load(Ordering::Acquire) {
        return;
    }
    PENDING.store(false, Ordering::Release);
    let (records, dropped) = {
        let mut q = QUEUE.lock();
        if q.records.is_empty() && q.dropped == 0 {
            return;
        }
        (
            std::mem::take(&mut q.records),
            std::mem::take(&mut q.dropped),
        )
    };
    let Ok(logger) = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", (LOGGER,)))
    else {
        return;
    };
    if dropped > 0 {
        let text = format!(
            "{dropped} kvbm log records were dropped (more than {QUEUE_CAP} between calls)"
        );
        let _ = logger.call_method1("log", (30, "%s", text));
    }
    for r in records {
        let _ = logger.call_method1("log", (r.level, "%s", r.text));
    }
}

/// `_kvbm.drain_logs()`: hands the queued Rust log records to Python's `logging` now (they
/// are also handed over at the end of every call).
#[pyfunction]
pub(crate) fn drain_logs(py: Python<'_>) {
    drain(py);
}

/// `_kvbm._warn(message, thread=False)`: a Rust warning from this thread (GIL released) or from
/// a background thread, for the logging tests. Test builds only.
#[cfg(feature = "python-test-hooks")]
#[pyfunction]
#[pyo3(signature = (message, thread=false))]
pub(crate) fn _warn(py: Python<'_>, message: String, thread: bool) -> PyResult<()> {
    super::detached(py, "_warn", move || {
        if thread {
            std::thread::spawn(move || tracing::warn!(test = "yes", "{message}"))
                .join()
                .map_err(|_| crate::Error::internal("the warning thread panicked"))
        } else {
            tracing::warn!(test = "yes", "{message}");
            Ok(())
        }
    })
}
