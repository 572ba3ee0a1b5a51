//! Shared by the benches: timing of interleaved rounds and the ratio line every bench prints.
//!
//! A ratio compares our path with a limit measured on the same bytes in the same run, so machine
//! drift between runs cancels out. Rounds alternate limit and ours, and the median of each is used.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvbm_connector::connector::transport::{
    LeaderMessage, TierCounts, WorkerHello, WorkerMessage, WorkerTransport,
};

/// Median of `rounds` timings of `limit` and `ours`, run alternately.
pub fn interleaved(
    rounds: usize,
    mut limit: impl FnMut(),
    mut ours: impl FnMut(),
) -> (Duration, Duration) {
    // One warm-up each.
    limit();
    ours();
    let mut l = Vec::with_capacity(rounds);
    let mut o = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        limit();
        l.push(t.elapsed());
        let t = Instant::now();
        ours();
        o.push(t.elapsed());
    }
    (median(&mut l), median(&mut o))
}

/// Median of samples.
pub fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Prints `name: ours X GB/s, limit Y GB/s, ratio R (target T)`.
pub fn report_bandwidth(name: &str, bytes: u64, limit: Duration, ours: Duration, target: f64) {
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    let ratio = limit.as_secs_f64() / ours.as_secs_f64().max(1e-12);
    println!(
        "RATIO {name}: ours {:.2} GB/s, limit {:.2} GB/s, ratio {ratio:.3} (target >= {target}) {}",
        gbps(ours),
        gbps(limit),
        if ratio >= target {
            "OK"
        } else {
            "BELOW TARGET"
        }
    );
}

/// True when criterion runs in test mode (`cargo test --benches`): keep work tiny then.
pub fn quick() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

/// A stand-in rank's side of the start-up barrier, through the public transport: reports
/// `hello`, takes the block counts the leader answers, confirms without allocating anything.
/// Panics when the leader refuses the rank or sends no counts within `limit`.
pub fn answer_barrier(t: &dyn WorkerTransport, hello: WorkerHello, limit: Duration) -> TierCounts {
    t.send(WorkerMessage::Hello(hello)).expect("send HELLO");
    let end = Instant::now() + limit;
    let counts = loop {
        assert!(Instant::now() < end, "no block counts within {limit:?}");
        let left = end.saturating_duration_since(Instant::now());
        match t.recv_timeout(left).expect("receive the block counts") {
            Some(LeaderMessage::Allocate(counts)) => break counts,
            Some(LeaderMessage::Refused(why)) => panic!("the leader refused the stand-in: {why}"),
            Some(LeaderMessage::Goodbye) => panic!("the leader shut down during start-up"),
            Some(LeaderMessage::Finish(_) | LeaderMessage::Ready) | None => {}
        }
    };
    t.send(WorkerMessage::Ready).expect("confirm");
    counts
}
