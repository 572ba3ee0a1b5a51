"""The default transport: with no transport setting at all, vLLM's scheduler-role and
worker-role connectors meet by rendezvous on the engine id, whether they share a process or not
(vLLM's default multiprocess executor puts the scheduler in the EngineCore process and each
worker in its own). Two engines on one machine never cross; another user cannot get in."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import stat
import uuid

import pytest

import _engines as E
from kvbm_connector import KvbmError, leader_transport, load_config, vllm, worker_transport


# conftest's autouse fixture clears every KVBM_* variable (no transport setting: the user's
# view) and sets a 20 s init timeout, so a regression fails in seconds, not the default minute.


def start_workers(ctx, engine_ids, num_blocks):
    """One worker process per engine, built from the engine's (pickled) config with no
    transport setting, registering its caches before any scheduler exists (vLLM's order)."""
    runners = [E.RemoteVllmRunner(ctx, 0, 1, E.kvbm_environ(), {}, num_blocks, engine_id=eid)
               for eid in engine_ids]
    for r in runners:
        r.started()
    return runners


def rendezvous_file(engine_id: str):
    """Where the leader of ``engine_id`` publishes (the Rust side's naming, restated)."""
    digits = hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    return load_config().rendezvous_dir / f"leader-{digits}.json"


def scheduler(engine_id: str):
    cfg = E.VllmConfig()
    cfg.kv_transfer_config.engine_id = engine_id
    return vllm.KvbmConnector(cfg, vllm.KVConnectorRole.SCHEDULER)


def test_scheduler_and_worker_in_two_processes_meet_with_no_setting():
    ctx = multiprocessing.get_context("spawn")
    num_blocks = 32
    eid = str(uuid.uuid4())
    runners = start_workers(ctx, [eid], num_blocks)
    engine = None
    try:
        # This process plays vLLM's EngineCore: the scheduler's blocking init returns once the
        # barrier with the worker process completed (before the fix: a timeout, "step 1
        # (bytes_per_block) missing from rank(s) [0]").
        sched = scheduler(eid)
        assert sched.is_ready()
        # The file did its work: removed once the session started, so a killed engine leaves
        # nothing behind.
        assert not rendezvous_file(eid).exists()
        runners[0].wait_ready(20)
        engine = E.VllmEngine(sched, runners, num_blocks)
        # Offloaded from the worker process, loaded back into it, and compared byte for byte.
        E.serve_a_prefix_again(engine)
        assert engine.verified_blocks == 16 // E.BS
        assert sched.metrics()["host_hit_tokens"] == 16
    finally:
        (engine.close() if engine else [r.close() for r in runners])


def test_two_engines_on_one_machine_do_not_cross():
    ctx = multiprocessing.get_context("spawn")
    num_blocks = 32
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    runners = start_workers(ctx, ids, num_blocks)
    engines = []
    try:
        scheds = [scheduler(eid) for eid in ids]
        for s, r in zip(scheds, runners):
            assert s.is_ready()
            r.wait_ready(20)
        engines = [E.VllmEngine(s, [r], num_blocks) for s, r in zip(scheds, runners)]
        a = E.prompt(5, 16)
        engines[0].add("a", a, max_tokens=2)
        engines[0].run()
        # Engine B never saw A's blocks: its own tiers are empty.
        engines[1].add("b", a + E.prompt(6, 6), max_tokens=2)
        engines[1].run()
        assert engines[1].matches["b"] == (0, False)
        # Engine A serves them, to its own worker.
        engines[0].add("c", a + E.prompt(7, 6), max_tokens=2)
        engines[0].run()
        assert engines[0].matches["c"] == (16, True)
        assert engines[0].verified_blocks == 16 // E.BS
    finally:
        for e in engines:
            e.close()
        if not engines:
            for r in runners:
                r.close()


def test_default_is_rendezvous_and_explicit_choices_hold(tmp_path, monkeypatch):
    d = tmp_path / "rdv"
    monkeypatch.setenv("KVBM_RENDEZVOUS_DIR", str(d))
    cfg = load_config()
    assert os.fspath(cfg.rendezvous_dir) == str(d)
    leader = leader_transport(1, instance="x", default="rendezvous", config=cfg)
    assert leader.kind == "rendezvous"
    assert leader.address.startswith("127.0.0.1:") and not leader.address.endswith(":5557")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (published,) = [p for p in d.iterdir() if p.name.startswith("leader-")]
    assert stat.S_IMODE(published.lstat().st_mode) == 0o600
    # Named from a hash of the id (32 hex digits), not the id itself.
    digits = published.name[len("leader-"):-len(".json")]
    assert len(digits) == 32 and set(digits) <= set("0123456789abcdef")
    assert leader.rendezvous_path == published
    w = worker_transport(0, 1, instance="x", default="rendezvous", config=cfg,
                         connect_timeout_secs=5)
    assert w.kind == "rendezvous"
    leader.unpublish()  # what the exit hook does; idempotent
    assert not published.exists()
    leader = leader_transport(1, instance="x", default="rendezvous", config=cfg)
    assert published.exists()
    del leader
    gc.collect()
    assert not published.exists(), "the leader removes its rendezvous file when dropped"
    # Explicit choices are kept as they were.
    assert worker_transport(0, 1, instance="ip", transport="in_process",
                            default="rendezvous").kind == "in_process"
    leader_transport(1, instance="ip", transport="in_process", default="rendezvous")
    assert worker_transport(0, 1, instance="t", transport="tcp", address="127.0.0.1:1",
                            default="rendezvous").kind == "tcp"
    monkeypatch.setenv("KVBM_LEADER_ADDR", "127.0.0.1:1")
    assert worker_transport(0, 1, instance="t", default="rendezvous").kind == "tcp"
    with pytest.raises(KvbmError) as ei:
        worker_transport(0, 1, instance="t", transport="carrier-pigeon")
    assert ei.value.kind == "invalid_config" and "rendezvous" in ei.value.message


def test_a_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    monkeypatch.setenv("KVBM_RENDEZVOUS_DIR", str(d))
    cfg = E.VllmConfig()
    with pytest.raises(KvbmError) as ei:
        vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
    assert ei.value.kind == "invalid_config"
    assert "KVBM_RENDEZVOUS_DIR" in str(ei.value) and "777" in str(ei.value)
    link = tmp_path / "link"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link.symlink_to(real)
    monkeypatch.setenv("KVBM_RENDEZVOUS_DIR", str(link))
    with pytest.raises(KvbmError) as ei:
        vllm.KvbmConnector(cfg, vllm.KVConnectorRole.SCHEDULER)
    assert "symbolic link" in str(ei.value)


def test_a_second_live_leader_of_one_engine_id_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_RENDEZVOUS_DIR", str(tmp_path / "d"))
    first = leader_transport(1, instance="same", default="rendezvous")
    with pytest.raises(KvbmError) as ei:
        leader_transport(1, instance="same", default="rendezvous")
    assert ei.value.kind == "already_exists" and "same" in str(ei.value)
    del first
