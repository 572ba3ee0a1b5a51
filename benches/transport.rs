//! Per-iteration overhead of the network transport (`kvbm_connector::tcp`) against the in-process
//! transport (`transport::in_process`), with 2 ranks.
//!
//! The metadata of an iteration travels with the engine (the caller), never over the connector's
//! transport; what the transport carries per iteration is the workers' completions. So one
//! iteration here is: the leader has K = 8 operations in flight (K one-block stores, one per new
//! request, emitted by one `build_connector_meta`); each of the 2 ranks reports each of them as
//! done, one `WorkerMessage::Completed` message per operation as the real `Worker` sends them
//! (2 × 8 = 16 messages); the leader applies them (`process_completions`, polled until
//! `num_operations_in_flight() == 0`; an operation completes once both ranks reported it, and its
//! stored block is registered).
//!
//! Timed: from handing the operation ids to the two ranks (a `std::sync::mpsc` channel per rank,
//! standing in for the engine's metadata broadcast, the same in both set-ups) until the leader
//! has nothing in flight. Not timed: building the iteration (match, allocation, metadata) and
//! finishing its requests. The ranks are stand-ins (threads that answer the barrier as a worker
//! does, through the transport, and send completions), not real `Worker`s: a real worker's copies would cost
//! the same on both transports and only blur the difference.
//!
//! Over TCP: `TcpLeader` bound on 127.0.0.1 port 0 (its own runtime thread), two `TcpWorker`s
//! (blocking sockets, `TCP_NODELAY`), no auth token. The leader thread polls
//! `process_completions` and yields between polls in both set-ups.
//!
//! Rounds alternate in-process and TCP (mean per iteration over a round; median of the rounds).
//! The RATIO line is in-process / TCP time per iteration: the fraction of the network iteration
//! that the in-process one would take. There is no target: the figure to read is the overhead,
//! TCP − in-process, per iteration and per message.
//!
//! A second RATIO line repeats the comparison with each rank reporting its K completions in one
//! message, as the real `Worker` does since issue 16 (it queues its completions and sends them
//! once per iteration: one COMPLETIONS frame per rank).
//!
//! A third RATIO line (issue 16, item 3) sets the batched TCP iteration against a limit measured
//! in the same run: a raw loopback TCP round of the same bytes — per rank, a thread writes the
//! very bytes the batched iteration puts on the wire (one COMPLETIONS frame of K entries) on a
//! plain `TCP_NODELAY` socket, a reader thread per connection reads them and signals the timing
//! thread — the same thread hand-offs with no framing, decoding or leader work. It also prints
//! messages and µs per completion before (one message per completion, as `Worker` sent them until
//! issue 16) and after (one per rank and iteration), rounds of the three interleaved.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvbm_connector::connector::adapter::{ScheduledRequest, ScheduledTokens, SchedulerStep};
use kvbm_connector::connector::leader::{Leader, RequestInfo};
use kvbm_connector::connector::metadata::{ConnectorMetadata, OperationId};
use kvbm_connector::connector::transport::{
    in_process, Completion, LeaderTransport, WorkerHello, WorkerMessage, WorkerTransport,
};
use kvbm_connector::connector::RequestId;
use kvbm_connector::frameworks::vllm::Vllm;
use kvbm_connector::tcp::{Received, TcpLeader, TcpWorker};
use kvbm_connector::{Config, LayoutDims, Token};

/// Ranks.
const WORLD: usize = 2;
/// Operations per iteration (each completed by every rank).
const K: usize = 8;
const BS: usize = 16;
const HOST_BLOCKS: usize = 1 << 14;
const DEVICE_BLOCKS: usize = 1 << 20;
const LIMIT: Duration = Duration::from_secs(30);

/// One rank's shard: 8 KV heads split over 2 ranks.
fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 32,
        outer_dim: 2,
        page_size: BS,
        inner_dim: 8 / WORLD * 128,
        dtype_bytes: 2,
    }
}

fn tokens(seed: u64) -> Vec<Token> {
    (0..BS as u64)
        .map(|i| {
            let x = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ i.wrapping_mul(0xbf58_476d_1ce4_e5b9))
            .wrapping_mul(0x94d0_49bb_1331_11eb);
            (x >> 40) as Token % 128_000
        })
        .collect()
}

/// What a stand-in rank is handed per iteration: the operations, and whether to report them in
/// one message (supplementary) rather than one message per operation (as `Worker` does).
type Handoff = (Vec<OperationId>, bool);

fn done(op: OperationId) -> Completion {
    Completion {
        op,
        failed_dst_blocks: Vec::new(),
        error: None,
    }
}

/// A stand-in rank: answers the barrier, then reports every operation it is handed as done.
fn stand_in(transport: Arc<dyn WorkerTransport>, rank: usize) -> (Sender<Handoff>, JoinHandle<()>) {
    let (tx, rx) = channel::<Handoff>();
    let h = std::thread::Builder::new()
        .name(format!("stand-in-{rank}"))
        .spawn(move || {
            let hello = WorkerHello {
                rank,
                world_size: WORLD,
                bytes_per_block: dims().bytes_per_block(),
                num_device_blocks: DEVICE_BLOCKS,
                dims: dims(),
            };
            common::answer_barrier(transport.as_ref(), hello, LIMIT);
            for (ops, batched) in rx {
                if batched {
                    let list = ops.into_iter().map(done).collect();
                    transport.send(WorkerMessage::Completed(list)).unwrap();
                } else {
                    for op in ops {
                        transport
                            .send(WorkerMessage::Completed(vec![done(op)]))
                            .unwrap();
                    }
                }
            }
        })
        .unwrap();
    (tx, h)
}

struct Rig {
    name: &'static str,
    /// The TCP leader, to count what arrived.
    tcp: Option<Arc<TcpLeader>>,
    leader: Leader<ScheduledTokens>,
    ranks: Vec<Sender<Handoff>>,
    threads: Vec<JoinHandle<()>>,
    next_seed: u64,
    next_block: usize,
    /// Every timed iteration, for percentiles.
    samples: Vec<Duration>,
}

impl Rig {
    fn new(
        name: &'static str,
        lt: Arc<dyn LeaderTransport>,
        wts: Vec<Arc<dyn WorkerTransport>>,
    ) -> Self {
        let mut config = Config::default();
        config.host.cache_blocks = Some(HOST_BLOCKS);
        config.disk.cache_blocks = Some(0);
        config.init_timeout_secs = LIMIT.as_secs_f64();
        let (ranks, threads) = wts
            .into_iter()
            .enumerate()
            .map(|(r, t)| stand_in(t, r))
            .unzip();
        let mut leader = Leader::new::<Vllm>(ScheduledTokens, config, BS, lt).unwrap();
        assert!(leader.is_ready());
        Rig {
            name,
            tcp: None,
            leader,
            ranks,
            threads,
            next_seed: 0,
            next_block: 0,
            samples: Vec::new(),
        }
    }

    fn in_process() -> Self {
        let (lt, wts) = in_process(WORLD);
        let wts = wts
            .into_iter()
            .map(|w| w as Arc<dyn WorkerTransport>)
            .collect();
        Self::new("in-process", lt, wts)
    }

    fn tcp() -> Self {
        let lt = TcpLeader::bind("127.0.0.1:0".parse().unwrap(), WORLD, None).unwrap();
        let addr = lt.local_addr();
        let wts = (0..WORLD)
            .map(|r| {
                TcpWorker::connect(addr, r, WORLD, None, LIMIT).unwrap() as Arc<dyn WorkerTransport>
            })
            .collect();
        let mut rig = Self::new("tcp", lt.clone(), wts);
        rig.tcp = Some(lt);
        rig
    }

    fn received(&self) -> Received {
        self.tcp.as_ref().map(|t| t.received()).unwrap_or_default()
    }

    /// Untimed: K new one-block requests, matched (misses), allocated and prefilled in one
    /// `build_connector_meta`, which emits K stores. Returns the requests and the operation ids.
    fn prepare(&mut self) -> (Vec<RequestId>, Vec<OperationId>) {
        let mut step = SchedulerStep::default();
        let mut ids = Vec::with_capacity(K);
        for _ in 0..K {
            self.next_seed += 1;
            let id = RequestId::from(format!("r{}", self.next_seed));
            let toks = tokens(self.next_seed);
            let m = self
                .leader
                .get_num_new_matched_tokens(
                    RequestInfo {
                        id: &id,
                        tokens: &toks,
                        cache_salt: None,
                        lora_name: None,
                    },
                    0,
                )
                .unwrap();
            assert_eq!(m.external_tokens, 0);
            let block = self.next_block;
            self.next_block = (self.next_block + 1) % DEVICE_BLOCKS;
            self.leader
                .update_state_after_alloc(&id, &[block], 0)
                .unwrap();
            step.requests.push(ScheduledRequest {
                request_id: id.clone(),
                num_computed_tokens: 0,
                num_scheduled_tokens: Some(BS),
                ..Default::default()
            });
            ids.push(id);
        }
        let bytes = self.leader.build_connector_meta(&step).unwrap();
        let meta = ConnectorMetadata::decode(&bytes).unwrap();
        let ops: Vec<OperationId> = meta.operations.iter().map(|op| op.id()).collect();
        assert_eq!(ops.len(), K, "{}: expected {K} stores", self.name);
        assert_eq!(self.leader.num_operations_in_flight(), K);
        (ids, ops)
    }

    /// One iteration; returns the timed part. `batched`: each rank reports its K completions in
    /// one message.
    fn iteration(&mut self, batched: bool) -> Duration {
        let (ids, ops) = self.prepare();
        let per_rank: Vec<Handoff> = (0..WORLD).map(|_| (ops.clone(), batched)).collect();
        let t = Instant::now();
        for (tx, ops) in self.ranks.iter().zip(per_rank) {
            tx.send(ops).unwrap();
        }
        loop {
            self.leader.process_completions();
            if self.leader.num_operations_in_flight() == 0 {
                break;
            }
            assert!(
                t.elapsed() < LIMIT,
                "{}: completions did not arrive within {LIMIT:?}",
                self.name
            );
            std::thread::yield_now();
        }
        let took = t.elapsed();
        for id in &ids {
            let held = self.leader.request_finished(id, None, None).unwrap();
            assert!(!held, "{}: a completed store still holds {id}", self.name);
        }
        self.samples.push(took);
        took
    }

    /// Mean per iteration over `n` iterations.
    fn round(&mut self, n: usize, batched: bool) -> Duration {
        let total: Duration = (0..n).map(|_| self.iteration(batched)).sum();
        total / n as u32
    }

    fn percentile_us(&mut self, q: f64) -> f64 {
        self.samples.sort();
        let i = ((self.samples.len().saturating_sub(1)) as f64 * q) as usize;
        self.samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // Closing the channels ends the stand-ins.
        self.ranks.clear();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Alternating rounds of both rigs; prints the RATIO line. Returns (in-process, tcp) medians.
fn compare(local: &mut Rig, tcp: &mut Rig, batched: bool) -> (Duration, Duration) {
    let (rounds, per_round) = if common::quick() { (1, 8) } else { (15, 400) };
    // One warm-up round each, then alternate.
    local.round(per_round.min(50), batched);
    tcp.round(per_round.min(50), batched);
    local.samples.clear();
    tcp.samples.clear();
    let mut l = Vec::with_capacity(rounds);
    let mut o = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        l.push(local.round(per_round, batched));
        o.push(tcp.round(per_round, batched));
    }
    let limit = common::median(&mut l);
    let ours = common::median(&mut o);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let overhead = us(ours) - us(limit);
    let ratio = limit.as_secs_f64() / ours.as_secs_f64().max(1e-12);
    let (name, messages) = if batched {
        (
            "transport 2 ranks x 8 completions, one message per rank (as Worker sends them)",
            WORLD,
        )
    } else {
        (
            "transport 2 ranks x 8 completions per iteration, one message per completion (as Worker sent them before issue 16)",
            WORLD * K,
        )
    };
    println!(
        "RATIO {name} (applied by the leader): \
         tcp {:.1} us/iteration, in-process {:.1} us/iteration, overhead {overhead:.1} us/iteration \
         ({:.2} us per message), ratio {ratio:.3} (in-process / tcp; no target) \
         [per-iteration p50/p99: tcp {:.1}/{:.1} us, in-process {:.1}/{:.1} us; {rounds} rounds x {per_round}]",
        us(ours),
        us(limit),
        overhead / messages as f64,
        tcp.percentile_us(0.5),
        tcp.percentile_us(0.99),
        local.percentile_us(0.5),
        local.percentile_us(0.99),
    );
    (limit, ours)
}

/// The bytes one rank puts on the wire for one batched iteration: a COMPLETIONS frame (protocol
/// version 3, kind 6) of K successful entries, built by hand from the documented layout.
fn batched_frame_bytes() -> Vec<u8> {
    let mut payload = (K as u32).to_be_bytes().to_vec();
    for op in 0..K as u64 {
        payload.extend_from_slice(&op.to_be_bytes());
        payload.push(0); // flags
        payload.extend_from_slice(&0u32.to_be_bytes()); // no failed block
    }
    let mut f = b"KVBM".to_vec();
    f.extend_from_slice(&3u16.to_be_bytes());
    f.push(6);
    f.push(0);
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(&payload);
    f
}

/// The limit: per rank a writer thread and a plain loopback TCP connection carrying `bytes` per
/// iteration, a reader thread that reads them and signals the timing thread.
struct RawLoopback {
    writers: Vec<Sender<()>>,
    done: Receiver<()>,
    threads: Vec<JoinHandle<()>>,
}

impl RawLoopback {
    fn new(bytes: Vec<u8>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (done_tx, done) = channel();
        let mut writers = Vec::new();
        let mut threads = Vec::new();
        for r in 0..WORLD {
            let mut client = TcpStream::connect(addr).unwrap();
            client.set_nodelay(true).unwrap();
            let (mut server, _) = listener.accept().unwrap();
            server.set_nodelay(true).unwrap();
            let (tx, rx) = channel::<()>();
            let frame = bytes.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("raw-writer-{r}"))
                    .spawn(move || {
                        for () in rx {
                            client.write_all(&frame).unwrap();
                        }
                    })
                    .unwrap(),
            );
            let len = bytes.len();
            let done_tx = done_tx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("raw-reader-{r}"))
                    .spawn(move || {
                        let mut buf = vec![0u8; len];
                        while server.read_exact(&mut buf).is_ok() {
                            if done_tx.send(()).is_err() {
                                return;
                            }
                        }
                    })
                    .unwrap(),
            );
            writers.push(tx);
        }
        Self {
            writers,
            done,
            threads,
        }
    }

    fn iteration(&mut self) -> Duration {
        let t = Instant::now();
        for w in &self.writers {
            w.send(()).unwrap();
        }
        for _ in 0..WORLD {
            self.done.recv_timeout(LIMIT).expect("raw loopback round");
        }
        t.elapsed()
    }

    fn round(&mut self, n: usize) -> Duration {
        let total: Duration = (0..n).map(|_| self.iteration()).sum();
        total / n as u32
    }
}

impl Drop for RawLoopback {
    fn drop(&mut self) {
        // Closing the writers' channels ends them; their sockets close, which ends the readers.
        self.writers.clear();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Issue 16, item 3: messages and µs per completion before and after batching, and the batched
/// iteration against the raw loopback limit of its bytes; rounds of the three interleaved.
fn issue16_item3(tcp: &mut Rig) {
    let (rounds, per_round) = if common::quick() { (1, 8) } else { (15, 400) };
    let mut raw = RawLoopback::new(batched_frame_bytes());
    raw.round(per_round.min(50));
    tcp.round(per_round.min(50), true);
    tcp.round(per_round.min(50), false);
    let (mut l, mut after, mut before) = (Vec::new(), Vec::new(), Vec::new());
    let (mut msgs_after, mut msgs_before) = (0u64, 0u64);
    for _ in 0..rounds {
        l.push(raw.round(per_round));
        let r0 = tcp.received();
        after.push(tcp.round(per_round, true));
        let r1 = tcp.received();
        before.push(tcp.round(per_round, false));
        let r2 = tcp.received();
        msgs_after += r1.completion_frames - r0.completion_frames;
        msgs_before += r2.completion_frames - r1.completion_frames;
        assert_eq!(
            r2.completions - r0.completions,
            (2 * per_round * WORLD * K) as u64
        );
    }
    let limit = common::median(&mut l);
    let after = common::median(&mut after);
    let before = common::median(&mut before);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let iterations = (rounds * per_round) as f64;
    let per_iter_after = msgs_after as f64 / iterations;
    let per_iter_before = msgs_before as f64 / iterations;
    let n = (WORLD * K) as f64;
    println!(
        "RATIO transport issue 16 item 3, 2 ranks x 8 completions per iteration over TCP: \
         batched {:.1} us/iteration = {:.2} us per completion ({per_iter_after:.1} messages/iteration), \
         one message per completion {:.1} us/iteration = {:.2} us per completion ({per_iter_before:.1} messages/iteration); \
         {:.1}x fewer messages, {:.2}x less time per completion; \
         limit (raw loopback TCP, the same {} bytes per rank, no framing or leader work) {:.1} us/iteration; \
         ratio {:.3} (limit / batched; no target) [{rounds} rounds x {per_round}, medians of round means]",
        us(after),
        us(after) / n,
        us(before),
        us(before) / n,
        per_iter_before / per_iter_after.max(1e-12),
        us(before) / us(after).max(1e-12),
        batched_frame_bytes().len(),
        us(limit),
        limit.as_secs_f64() / after.as_secs_f64().max(1e-12),
    );
}

fn bench_transport(c: &mut Criterion) {
    let mut local = Rig::in_process();
    let mut tcp = Rig::tcp();
    let mut g = c.benchmark_group("transport");
    g.throughput(Throughput::Elements((WORLD * K) as u64));
    g.bench_function("in_process_2_ranks_8_completions", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| local.iteration(false)).sum())
    });
    g.bench_function("tcp_2_ranks_8_completions", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| tcp.iteration(false)).sum())
    });
    g.bench_function("tcp_2_ranks_8_completions_batched", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| tcp.iteration(true)).sum())
    });
    g.finish();

    compare(&mut local, &mut tcp, false);
    compare(&mut local, &mut tcp, true);
    issue16_item3(&mut tcp);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench_transport
}
criterion_main!(benches);
