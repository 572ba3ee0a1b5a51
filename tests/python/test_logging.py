"""Rust's warnings reach Python's ``logging`` (logger ``kvbm_connector``), filtered by
``KVBM_LOG`` (default: warnings). Events are queued by the Rust side and handed to ``logging`` at
the end of every call into the bindings (never taking the GIL from a thread that may hold our
locks), or by ``_kvbm.drain_logs()``."""

from __future__ import annotations

import logging
import os

import _engines as E
from kvbm_connector import _kvbm

LOGGER = "kvbm_connector"
# Read before conftest's fixture clears every KVBM_* variable for each test.
REDIS_URL = os.environ.get("KVBM_TEST_REDIS_URL")


def _from_rust(caplog, needle):
    return [
        r for r in caplog.records
        if r.name == LOGGER and needle in r.getMessage()
    ]


def test_a_rust_warning_from_the_calling_thread_reaches_logging(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _kvbm._warn("warning from the calling thread")
    recs = _from_rust(caplog, "warning from the calling thread")
    assert len(recs) == 1, caplog.text
    assert recs[0].levelno == logging.WARNING
    assert "test=yes" in recs[0].getMessage()


def test_a_rust_warning_from_a_background_thread_reaches_logging(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _kvbm._warn("warning from a background thread", thread=True)
        _kvbm.drain_logs()
    assert len(_from_rust(caplog, "warning from a background thread")) == 1, caplog.text


def test_a_real_start_up_warning_reaches_logging(monkeypatch, caplog, vllm_engine):
    """The barrier's warning (Rust, kvbm_connector::connector::barrier) when both tiers are
    sized 0: before the logging layer, only the Python-side copy was seen."""
    monkeypatch.setenv("KVBM_HOST_CACHE_BLOCKS", "0")
    monkeypatch.setenv("KVBM_DISK_CACHE_BLOCKS", "0")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        e = vllm_engine()
        e.add("a", E.prompt(3, 16), max_tokens=2)
        e.run()
        _kvbm.drain_logs()
    recs = _from_rust(caplog, "[kvbm_connector::connector::barrier]")
    assert any("store and load nothing" in r.getMessage() for r in recs), caplog.text


def test_a_remote_tier_without_a_secret_warns_at_start_up(monkeypatch, caplog, vllm_engine):
    """Issue 26 item 3: with a remote URL and no deployment secret, anyone who can write to the
    store can plant a block; the leader says so once at start-up. With a secret it does not.
    Needs the Redis server scripts/test.sh starts (``KVBM_TEST_REDIS_URL``)."""
    import uuid

    import pytest

    url = REDIS_URL
    if not url:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("KVBM_TEST_REDIS_URL is not set (scripts/redis-servers.sh)")
        pytest.skip("no Redis server (scripts/redis-servers.sh)")
    monkeypatch.setenv("KVBM_REMOTE_URL", url)
    monkeypatch.setenv("KVBM_REMOTE_NAMESPACE", f"logging-{uuid.uuid4().hex[:8]}")
    needle = "the remote tier has no deployment secret"
    for secret in (None, "a deployment secret"):
        if secret is None:
            monkeypatch.delenv("KVBM_REMOTE_SECRET", raising=False)
        else:
            monkeypatch.setenv("KVBM_REMOTE_SECRET", secret)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            vllm_engine()  # the leader builds its remote store once the barrier completed
            _kvbm.drain_logs()
        found = [r for r in caplog.records if needle in r.getMessage()]
        if secret is None:
            assert len(found) == 1, caplog.text
        else:
            assert not found, caplog.text
