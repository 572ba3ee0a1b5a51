"""Leader and workers in separate processes over the TCP transport (configured, or found by
the default rendezvous), as a real engine runs them: vLLM with tensor parallelism 2 (the
scheduler-role connector in this process, one worker-role connector per rank in a child
process, metadata pickled to each rank as vLLM's multiprocess executor sends the scheduler
output), and TensorRT-LLM's environment-driven wiring (``KVBM_LEADER_ADDR``, ``KVBM_RANK``)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import _engines as E
from kvbm_connector import KvbmError, leader_transport, vllm, worker_transport


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("wiring", ["tcp", "default"])
def test_vllm_two_ranks_in_two_processes(wiring):
    """``tcp``: an explicit address; ``default``: no setting at all (the rendezvous on the engine
    id, which vLLM pickles to every worker)."""
    extra = {"transport": "tcp", "leader_addr": free_addr()} if wiring == "tcp" else {}
    cfg = E.VllmConfig(parallel_config=E.ParallelConfig(tensor_parallel_size=2))
    cfg.kv_transfer_config.kv_connector_extra_config.update(extra)
    eid = cfg.kv_transfer_config.engine_id
    ctx = multiprocessing.get_context("spawn")
    num_blocks = 32
    # vLLM's order: the workers register their caches first (non-blocking; they connect in the
    # background), then the engine core builds the scheduler-role connector (blocking).
    runners = [E.RemoteVllmRunner(ctx, r, 2, E.kvbm_environ(), extra, num_blocks, engine_id=eid)
               for r in range(2)]
    engine = None
    try:
        for r in runners:
            r.started()
        sched = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.SCHEDULER)
        assert sched.is_ready()
        for r in runners:
            r.wait_ready(20)
        engine = E.VllmEngine(sched, runners, num_blocks)
        E.serve_a_prefix_again(engine)
        # Every loaded block was compared on both ranks, each against its own shard's bytes.
        assert engine.verified_blocks == 4
        assert engine.free == set(range(1, num_blocks))  # block 0: the null block
        m = sched.metrics()
        assert m["host_hit_tokens"] == 16
    finally:
        (engine.close() if engine else [r.close() for r in runners])


def test_tcp_is_chosen_from_the_environment(monkeypatch):
    addr = free_addr()
    monkeypatch.setenv("KVBM_LEADER_ADDR", addr)
    leader = leader_transport(1)
    assert leader.kind == "tcp" and leader.address == addr
    worker = worker_transport(0, 1, connect_timeout_secs=5)
    assert worker.kind == "tcp" and worker.rank == 0


def test_several_ranks_default_to_tcp_and_one_rank_to_in_process():
    assert worker_transport(0, 1, instance="solo").kind == "in_process"
    leader_transport(1, instance="solo")  # takes the other end; the pairing is then dropped
    addr = free_addr()
    assert worker_transport(1, 2, address=addr).kind == "tcp"


def test_in_process_ends_are_handed_out_once():
    leader_transport(2, instance="twice", transport="in_process")
    with pytest.raises(KvbmError) as ei:
        leader_transport(2, instance="twice", transport="in_process")
    assert ei.value.kind == "already_exists"
    with pytest.raises(KvbmError) as ei:
        worker_transport(0, 3, instance="twice", transport="in_process")
    assert ei.value.kind == "invalid_argument"


def test_worker_refused_when_no_leader_listens(monkeypatch):
    """A worker whose leader never comes fails its barrier with a timeout, never hangs."""
    monkeypatch.setenv("KVBM_INIT_TIMEOUT_SECS", "1")
    from kvbm_connector import trtllm

    monkeypatch.setenv("KVBM_LEADER_ADDR", free_addr())
    worker = trtllm.KvbmConnectorWorker(E.TrtLlmArgs(), rank=0)
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_caches(E.TrtllmCache(8).tensor)
    assert ei.value.kind in ("timeout", "cancelled", "not_ready")


TRTLLM_RANK = textwrap.dedent(
    """
    import sys
    import _engines as E
    from kvbm_connector import trtllm

    args = E.TrtLlmArgs(tensor_parallel_size=2)
    worker = trtllm.KvbmConnectorWorker(args)        # rank from $KVBM_RANK
    assert worker.rank == 1, worker.rank
    cache = E.TrtllmCache(16)
    worker.register_kv_caches(cache.tensor)          # blocking: returns after the barrier
    print("ready", flush=True)
    sys.stdin.read()                                 # keep the connection until told to go
    """
)


def test_trtllm_rank_joins_from_another_process(monkeypatch):
    """TensorRT-LLM under MPI: the scheduler and rank 0's worker in one process, rank 1 in
    another; each finds the leader through ``KVBM_LEADER_ADDR`` and its rank through the MPI rank
    (here ``KVBM_RANK``, as TensorRT-LLM is not installed)."""
    from kvbm_connector import trtllm

    addr = free_addr()
    monkeypatch.setenv("KVBM_LEADER_ADDR", addr)
    args = E.TrtLlmArgs(tensor_parallel_size=2)
    sched = trtllm.KvbmConnectorScheduler(args)
    env = dict(os.environ, KVBM_RANK="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    child = subprocess.Popen([sys.executable, "-c", TRTLLM_RANK], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        monkeypatch.setenv("KVBM_RANK", "0")
        worker = trtllm.KvbmConnectorWorker(args)
        worker.register_kv_caches(E.TrtllmCache(16).tensor)
        assert worker.is_ready()
        assert child.stdout.readline().strip() == "ready"
        sched.wait_ready(20)
        a = E.prompt(1, 8)
        assert sched.get_num_new_matched_tokens(E.LlmRequest(1, a, 1), 0) == (0, False)
    finally:
        child.stdin.close()
        child.wait(20)
    assert child.returncode == 0
