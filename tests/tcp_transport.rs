//! The network transport through the public API on loopback: authentication, and the real leader
//! and worker offloading and onboarding over TCP. The transport's own tests (frames, handshake
//! refusals, the barrier over TCP, disconnects, round trips) reach crate-private frame and
//! barrier functions and live in `src/connector/tcp/tests.rs`.
//!
//! Every wait is bounded; all traffic is on 127.0.0.1.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use kvbm_connector::connector::tcp::{TcpLeader, TcpWorker};
use kvbm_connector::connector::transport::LeaderTransport;
use kvbm_connector::connector::RequestId;
use kvbm_connector::connector::{Blocking, NonBlocking};
use kvbm_connector::ErrorKind;

const LONG: Duration = Duration::from_secs(10);

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[test]
fn auth_token_is_enforced() {
    let leader = TcpLeader::bind(any_port(), 1, Some("s3cret".into())).unwrap();
    let addr = leader.local_addr();
    let started = Instant::now();
    let e = TcpWorker::connect(addr, 0, 1, Some("wrong".into()), LONG).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotReady, "{e}");
    assert!(e.to_string().contains("token mismatch"), "{e}");
    assert!(e.to_string().contains("rank 0"), "{e}");
    let e = TcpWorker::connect(addr, 0, 1, None, LONG).unwrap_err();
    assert!(e.to_string().contains("authentication required"), "{e}");
    // Refusals are final: no retries until the 10 s deadline.
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(leader.connected_ranks().is_empty());
    let w = TcpWorker::connect(addr, 0, 1, Some("s3cret".into()), LONG).unwrap();
    assert_eq!(leader.connected_ranks(), vec![0]);
    assert_eq!(w.world_size(), 1);
    // Refused connections never produced a message.
    assert!(leader.try_recv().unwrap().is_none());
}

#[test]
fn real_leader_and_worker_offload_and_onboard_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8, 8);
    let lt = TcpLeader::bind(any_port(), 1, Some("tok".into())).unwrap();
    let wt = TcpWorker::connect(lt.local_addr(), 0, 1, Some("tok".into()), LONG).unwrap();
    let device = device();
    let mut worker = new_worker(cfg.clone(), 1, wt, NonBlocking).unwrap();
    worker.register(device.clone()).unwrap();
    let leader = new_leader(cfg, BS, lt.clone(), Blocking).unwrap();
    wait_until("worker ready", || worker.is_ready());
    let mut rig = Rig {
        leader,
        worker,
        device,
        dir,
    };
    let tokens: Vec<u32> = (0..16).collect();
    rig.offload(&RequestId::from("a"), &tokens, &[0, 1, 2, 3]);
    // Completions cross the network asynchronously: let every store land before matching.
    wait_until("stores to complete", || {
        rig.leader.process_completions();
        rig.leader.num_operations_in_flight() == 0
    });
    let loaded = rig.onboard(&RequestId::from("b"), &tokens, &[4, 5, 6, 7]);
    assert!(loaded >= BS, "loaded {loaded} tokens");
    assert!(lt.is_session_started());
}
