"""The Python/Rust boundary: errors become ``KvbmError`` with kind, message and context; panics
are caught; long waits release the GIL."""

from __future__ import annotations

import threading
import time

import pytest

import _engines as E
from kvbm_connector import ERROR_KINDS, Config, KvbmError, _kvbm, in_process_transport


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_every_error_kind_maps_to_kvbm_error(kind):
    with pytest.raises(KvbmError) as ei:
        _kvbm._raise(kind, "what went wrong")
    e = ei.value
    assert e.kind == kind
    assert e.message == "what went wrong"
    assert e.context == {"test": "yes", "op": "_raise"}
    assert str(e) == f"{kind}: what went wrong (test=yes, op=_raise)"
    assert isinstance(e, Exception)


def test_error_kinds_are_the_rust_kinds():
    assert "invalid_argument" in ERROR_KINDS and "not_ready" in ERROR_KINDS
    assert len(ERROR_KINDS) == len(set(ERROR_KINDS)) == 16


def test_a_panic_becomes_an_internal_error():
    with pytest.raises(KvbmError) as ei:
        _kvbm._raise("internal", "boom", panic=True)
    assert ei.value.kind == "internal"
    assert "panic" in ei.value.message and "boom" in ei.value.message


def test_an_object_that_panicked_refuses_further_calls():
    probe = _kvbm._PanicProbe()
    assert probe.ok() == 1
    with pytest.raises(KvbmError) as ei:
        probe.panic()
    assert ei.value.kind == "internal" and "probe panicked" in ei.value.message
    with pytest.raises(KvbmError) as ei:
        probe.ok()
    assert ei.value.kind == "internal" and "unusable" in ei.value.message


class Counter:
    """A Python thread that counts while the main thread is inside a Rust call."""

    def __init__(self) -> None:
        self.n = 0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.n += 1

    def __enter__(self) -> "Counter":
        self._t.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._t.join()


def test_waiting_for_the_barrier_releases_the_gil():
    leader, _workers = in_process_transport(1)
    sched = _kvbm.TrtllmScheduler(Config.defaults(), E.BS, leader)
    with Counter() as c:
        before = c.n
        t0 = time.monotonic()
        with pytest.raises(KvbmError) as ei:
            sched.wait_ready(0.3)
        waited = time.monotonic() - t0
        during = c.n - before
    assert ei.value.kind == "timeout" and "barrier" in ei.value.message
    assert waited >= 0.3
    # With the GIL held for 0.3 s the counter could not move; released, it runs freely.
    assert during > 10_000, during


def test_blocking_scheduler_init_releases_the_gil_and_times_out_clearly(monkeypatch):
    monkeypatch.setenv("KVBM_INIT_TIMEOUT_SECS", "0.5")
    from kvbm_connector import load_config

    leader, _workers = in_process_transport(1)
    with Counter() as c:
        before = c.n
        with pytest.raises(KvbmError) as ei:
            _kvbm.VllmScheduler(load_config(), E.BS, leader)
        during = c.n - before
    assert ei.value.kind == "timeout"
    assert ei.value.context["missing_ranks"] == "[0]", str(ei.value)
    assert during > 10_000, during


def test_calls_from_several_threads_are_serialised(vllm_engine):
    e = vllm_engine()
    errors = []

    def poll():
        try:
            for _ in range(200):
                e.sched.has_pending_work()
                e.worker.is_ready()
        except BaseException as x:  # pragma: no cover - reported below
            errors.append(x)

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for t in threads:
        t.start()
    e.add("a", E.prompt(1, 10))
    e.run()
    for t in threads:
        t.join()
    assert not errors
