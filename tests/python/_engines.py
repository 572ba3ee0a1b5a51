"""Stand-ins for the engines: a model whose KV bytes are checkable, numpy-backed tensors shaped as
the engines register them, the engines' argument objects, and two scripted engine loops that call
the connector classes in each engine's order.

Sources of the shapes (field names and types as the engines define them):

* TensorRT-LLM: ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` -- ``RequestData``
  (``request_id``, ``new_tokens``, ``new_block_ids``, ``computed_position``,
  ``num_scheduled_tokens``), ``SchedulerOutput`` (``new_requests``, ``cached_requests``), and
  ``KvCacheConnectorManager`` / ``KvCacheConnectorSchedulerOutputManager`` for the call order and
  how ``computed_position`` is reported (the context's current position: after an asynchronous
  load, the only kind this connector asks for, it counts the loaded tokens on the request's first
  appearance too; only a synchronous load's tokens are left out; ``len(tokens) - 1`` while
  generating), and ``py_executor.py`` for what an iteration with nothing scheduled calls (only
  ``get_finished``); ``LlmRequest`` (``request_id``, ``get_tokens(beam)``, ``cache_salt_id`` in
  older trees, ``cache_salt`` in newer ones); ``TorchLlmArgs.kv_cache_config.tokens_per_block``;
  the cache tensor is the primary pool
  ``[num_blocks, num_layers, kv_factor, tokens_per_block * kv_heads * head_dim]``.
* vLLM v1: ``vllm/v1/core/sched/output.py`` -- ``NewRequestData`` (``req_id``,
  ``prompt_token_ids``, ``block_ids`` as a tuple of one list per KV-cache group,
  ``num_computed_tokens``), ``CachedRequestData`` (parallel lists ``req_ids``,
  ``resumed_from_preemption``, ``new_token_ids``, ``new_block_ids``, ``num_computed_tokens``),
  ``SchedulerOutput`` (``scheduled_new_reqs``, ``scheduled_cached_reqs``,
  ``num_scheduled_tokens``, ``finished_req_ids``, ``preempted_req_ids``, and
  ``kv_connector_metadata`` which the scheduler sets); ``vllm/v1/request.py`` ``Request``
  (``request_id``, ``all_token_ids``, ``num_computed_tokens``, ``cache_salt``,
  ``lora_request``); ``vllm/v1/core/kv_cache_manager.py`` ``KVCacheBlocks.get_block_ids()``;
  ``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/worker/kv_connector_model_runner_mixin.py``
  for the call order; per-layer caches ``[2, num_blocks, block_size, kv_heads, head_dim]``
  (FlashAttention) or ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (FlashInfer).

The model: the KV of a token is a pure function of (token prefix, layer, K/V, position, rank), so
a full block's bytes are a pure function of the prefix up to the block's end. Freed device blocks
are overwritten with junk, so an onboarded block compares equal only if the load copied it.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

BS = 4  # tokens per block
LAYERS = 2
HEADS = 2
HEAD_DIM = 2
INNER = HEADS * HEAD_DIM
DTYPE = np.float16
TOKEN_BYTES = INNER * np.dtype(DTYPE).itemsize  # one token's K (or V) in one layer
BLOCK_BYTES = LAYERS * 2 * BS * TOKEN_BYTES
MASK = (1 << 64) - 1
MAX_ITERATIONS = 200
# Steps in which no request can run (every one is waiting for the connector: a load in flight, a
# save being written, completions crossing from the worker's threads to the leader's) do not count
# against MAX_ITERATIONS: such a step waits IDLE_WAIT first, up to IDLE_LIMIT in all. Without the
# wait, 200 steps take ~25 ms while an engine drains in up to ~60 steps (measured): on a busy host,
# a connector thread not scheduled for those 25 ms failed a run that would have drained.
IDLE_WAIT = 0.002
IDLE_LIMIT = 60.0

# -------------------------------------------------------------------------------------------------
# The model stand-in
# -------------------------------------------------------------------------------------------------


def prefix_hashes(tokens: List[int]) -> List[int]:
    """``h[p]`` names the prefix ``tokens[:p + 1]`` (FNV-1a)."""
    h = 0xCBF29CE484222325
    out = []
    for t in tokens:
        h = ((h ^ t) * 0x100000001B3) & MASK
        out.append(h)
    return out


def splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def token_kv(prefix: int, layer: int, kv: int, pos: int, rank: int = 0) -> bytes:
    x = (prefix ^ (layer << 56) ^ (kv << 48) ^ (rank << 40) ^ pos) & MASK
    out = bytearray()
    while len(out) < TOKEN_BYTES:
        x = splitmix(x)
        out += x.to_bytes(8, "little")
    return bytes(out[:TOKEN_BYTES])


def expected_block(tokens: List[int], block: int, rank: int = 0) -> bytes:
    """The canonical image ``[layer][kv][slot][token bytes]`` of full block ``block``."""
    h = prefix_hashes(tokens[: (block + 1) * BS])
    image = bytearray(BLOCK_BYTES)
    for layer in range(LAYERS):
        for kv in range(2):
            for p in range(block * BS, (block + 1) * BS):
                o = ((layer * 2 + kv) * BS + p % BS) * TOKEN_BYTES
                image[o : o + TOKEN_BYTES] = token_kv(h[p], layer, kv, p, rank)
    return bytes(image)


def next_token(tokens: List[int]) -> int:
    return 100_000 + prefix_hashes(tokens)[-1] % 50_000


def prompt(seed: int, n: int) -> List[int]:
    return [seed * 1000 + i for i in range(n)]


def junk(block: int) -> bytes:
    return bytes([0xA5 ^ (block & 0xFF)]) * BLOCK_BYTES


# -------------------------------------------------------------------------------------------------
# Tensors: what torch.Tensor offers the connector, over numpy memory
# -------------------------------------------------------------------------------------------------


class FakeDtype:
    """``torch.dtype``: the connector reads ``itemsize``."""

    def __init__(self, np_dtype: np.dtype) -> None:
        self.itemsize = np.dtype(np_dtype).itemsize
        self.name = str(np.dtype(np_dtype))


class FakeDevice:
    """``torch.device``: ``type`` is ``"cpu"`` or ``"cuda"``."""

    def __init__(self, spec: str) -> None:
        self.type = spec.split(":")[0]
        self._spec = spec

    def __str__(self) -> str:
        return self._spec


class FakeTensor:
    """The registration surface of ``torch.Tensor`` (``data_ptr()``, ``shape``, ``dtype``,
    ``device``, ``is_contiguous()``, ``element_size()``) over a numpy array."""

    def __init__(self, array: np.ndarray, device: str = "cpu") -> None:
        self.np = array
        self.shape = tuple(array.shape)
        self.dtype = FakeDtype(array.dtype)
        self.device = FakeDevice(device)

    def data_ptr(self) -> int:
        return int(self.np.ctypes.data)

    def is_contiguous(self) -> bool:
        return bool(self.np.flags.c_contiguous)

    def element_size(self) -> int:
        return int(self.np.itemsize)

    def view(self, *args):
        """``Tensor.view(dtype)`` (the same bytes as another element type) or
        ``Tensor.view(*shape)``."""
        if len(args) == 1 and not isinstance(args[0], int):
            dt = args[0]
            dt = np.dtype(dt.name) if isinstance(dt, FakeDtype) else np.dtype(dt)
            return FakeTensor(self.np.view(dt), str(self.device))
        return FakeTensor(self.np.reshape(*args), str(self.device))


class PoolRegion:
    """A TensorRT-LLM ``KvCacheRegion`` (KV cache manager V2's layout) over the numpy array
    ``pool`` (``[slots, layers, 2, BS * INNER]``): one slot a page of ``layer_ids``' keys and
    values, as the region of a layer group (or of a pool every group of one page size shares)."""

    def __init__(self, pool, layer_ids):
        self._u8 = pool.view(np.uint8).reshape(pool.shape[0], -1)
        self.base = int(pool.ctypes.data)
        self.num_slots = pool.shape[0]
        self.size = self.stride = self._u8.shape[1]
        self.buffers = tuple((l, role) for l in layer_ids for role in ("key", "value"))

    def as_tensor(self):
        return FakeTensor(self._u8)


class TrtllmCache:
    """TensorRT-LLM's primary pool ``[num_blocks, num_layers, 2, tokens_per_block * inner]``."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.array = np.zeros((num_blocks, LAYERS, 2, BS * INNER), dtype=DTYPE)
        self.tensor = FakeTensor(self.array)
        self._u8 = self.array.view(np.uint8).reshape(num_blocks, LAYERS, 2, BS, TOKEN_BYTES)

    def write(self, block: int, layer: int, kv: int, slot: int, data: bytes) -> None:
        self._u8[block, layer, kv, slot] = np.frombuffer(data, dtype=np.uint8)

    def read_block(self, block: int) -> bytes:
        return self._u8[block].tobytes()

    def fill(self, block: int, data: bytes) -> None:
        self._u8[block] = np.frombuffer(data, dtype=np.uint8).reshape(self._u8[block].shape)


class VllmCache:
    """vLLM's per-layer caches: FlashAttention ``[2, num_blocks, block_size, heads, head_dim]``
    (outer-major) or FlashInfer ``[num_blocks, 2, block_size, heads, head_dim]`` (block-major)."""

    def __init__(self, num_blocks: int, backend: str = "flash_attn") -> None:
        self.num_blocks = num_blocks
        self.backend = backend
        if backend == "flash_attn":
            shape = (2, num_blocks, BS, HEADS, HEAD_DIM)
        elif backend == "flashinfer":
            shape = (num_blocks, 2, BS, HEADS, HEAD_DIM)
        else:
            raise ValueError(backend)
        self.arrays = [np.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)]
        self.tensors = {layer_name(l): FakeTensor(a) for l, a in enumerate(self.arrays)}
        u8_shape = shape[:3] + (TOKEN_BYTES,)
        self._u8 = [a.view(np.uint8).reshape(u8_shape) for a in self.arrays]

    def _run(self, block: int, layer: int, kv: int) -> np.ndarray:
        u = self._u8[layer]
        return u[kv, block] if self.backend == "flash_attn" else u[block, kv]

    def write(self, block: int, layer: int, kv: int, slot: int, data: bytes) -> None:
        self._run(block, layer, kv)[slot] = np.frombuffer(data, dtype=np.uint8)

    def read_block(self, block: int) -> bytes:
        return b"".join(
            self._run(block, l, kv).tobytes() for l in range(LAYERS) for kv in range(2)
        )

    def fill(self, block: int, data: bytes) -> None:
        run = BS * TOKEN_BYTES
        for l in range(LAYERS):
            for kv in range(2):
                o = (l * 2 + kv) * run
                self._run(block, l, kv)[:] = np.frombuffer(data[o : o + run], dtype=np.uint8).reshape(
                    BS, TOKEN_BYTES
                )


def layer_name(l: int) -> str:
    return f"model.layers.{l}.self_attn.attn"


def write_kv(cache, tokens: List[int], blocks: List[int], start: int, end: int,
             layers: range, rank: int = 0) -> None:
    """The model stand-in: the KV of ``tokens[start:end]`` in ``layers``."""
    if start >= end:
        return
    h = prefix_hashes(tokens[:end])
    for p in range(start, end):
        for layer in layers:
            for kv in range(2):
                cache.write(blocks[p // BS], layer, kv, p % BS, token_kv(h[p], layer, kv, p, rank))


# -------------------------------------------------------------------------------------------------
# TensorRT-LLM
# -------------------------------------------------------------------------------------------------


@dataclass
class TrtKvCacheConfig:
    tokens_per_block: int = BS
    max_attention_window: Optional[List[int]] = None


@dataclass
class TrtLlmArgs:
    """``TorchLlmArgs``: the fields the connector reads."""

    kv_cache_config: TrtKvCacheConfig = field(default_factory=TrtKvCacheConfig)
    max_seq_len: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


class LlmRequest:
    """``tensorrt_llm.bindings.internal.batch_manager.LlmRequest``: the fields the connector
    reads."""

    def __init__(self, request_id: int, tokens: List[int], max_new: int, **salt) -> None:
        self.request_id = request_id
        # ``cache_salt_id`` (older TensorRT-LLM, an int) or ``cache_salt`` (newer, a str).
        for name, value in salt.items():
            assert name in ("cache_salt_id", "cache_salt"), name
            setattr(self, name, value)
        self.tokens = list(tokens)
        self.prompt_len = len(tokens)
        self.max_new = max_new
        self.blocks: List[int] = []
        self.pos = 0  # context_current_position
        self.loaded = 0
        self.appeared = False
        self.reported_tokens = 0
        self.reported_blocks = 0

    def get_tokens(self, beam: int) -> List[int]:
        assert beam == 0
        return list(self.tokens)


@dataclass
class RequestData:
    """TensorRT-LLM's ``RequestData``."""

    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class TrtSchedulerOutput:
    """TensorRT-LLM's ``SchedulerOutput``."""

    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)


class TrtllmEngine:
    """TensorRT-LLM's PyExecutor and ``KvCacheConnectorManager`` in miniature, one rank.

    An iteration with requests to schedule (waiting or running): admission
    (``get_num_new_matched_tokens`` -> allocate -> ``update_state_after_alloc``; an asynchronous
    load parks the request), ``build_connector_meta`` -> ``bind_connector_meta``,
    ``start_load_kv``; then, if any request computes (a batch of only loading requests computes
    nothing), per layer ``wait_for_layer_load`` / forward / ``save_kv_layer``, ``wait_for_save``,
    sampling and ``request_finished`` (after this iteration's metadata was built and after its
    ``wait_for_save``, as TensorRT-LLM does); finally ``get_finished(finished_gen_req_ids,
    started_loading_req_ids)`` with the ids new since the last call. An iteration with nothing to
    schedule (only loads in flight, or finished requests held for their stores) calls
    ``get_finished`` alone (``idle_iterations`` counts them). A request first appears in the
    scheduler output with ``computed_position`` = its current position, which after an
    asynchronous load counts the loaded tokens.

    Determinism (one legal interleaving, which makes every run the same): after the forward pass,
    and before an idle iteration's ``get_finished``, it waits for the worker to be idle.
    """

    def __init__(
        self,
        scheduler,
        worker,
        cache: TrtllmCache,
        chunk: Optional[int] = None,
        window_blocks: Optional[int] = None,
    ) -> None:
        self.sched = scheduler
        self.worker = worker
        self.cache = cache
        self.chunk = chunk or 1 << 30
        # A sliding window of this many blocks (KV cache manager V2, one layer group): a hit of n
        # tokens gets pages only for the window before n; the ordinals before it hold -1
        # (BAD_PAGE_INDEX) in every list the connector sees.
        self.window_blocks = window_blocks
        self.free = set(range(cache.num_blocks))
        self.waiting: List[LlmRequest] = []
        self.loading: List[LlmRequest] = []
        self.running: List[LlmRequest] = []
        self.saving: List[LlmRequest] = []
        self.new_saving: List[int] = []
        self.new_loading: List[int] = []
        self.done: Dict[int, LlmRequest] = {}
        self.matched: Dict[int, Tuple[int, bool]] = {}
        self.held: Dict[int, bool] = {}
        self.loaded_ids: Set[int] = set()
        self.verified_blocks = 0
        self.metas: List[bytes] = []
        self.outputs: List[TrtSchedulerOutput] = []
        self.iteration = 0
        self.idle_iterations = 0
        for b in range(cache.num_blocks):
            cache.fill(b, junk(b))

    def submit(self, request_id: int, tokens: List[int], max_new: int = 1, **salt) -> None:
        self.waiting.append(LlmRequest(request_id, tokens, max_new, **salt))

    def _alloc(self) -> int:
        b = min(self.free)
        self.free.remove(b)
        return b

    def step(self) -> None:
        self.iteration += 1
        if not (self.waiting or self.running):
            # Nothing to schedule: TensorRT-LLM calls get_finished only.
            self.idle_iterations += 1
            self.worker.wait_idle(10)
            self._report()
            return
        self._admit()
        self._execute()

    def _execute(self) -> None:
        """The rest of an iteration with a batch: metadata, loads, forward, finish, report."""
        output, plan = self._plan()
        self.outputs.append(output)
        meta = self.sched.build_connector_meta(output)
        assert isinstance(meta, bytes)
        self.metas.append(meta)
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        if plan:
            for layer in range(LAYERS):
                self.worker.wait_for_layer_load(layer, None)
                for req, (start, end) in plan:
                    write_kv(self.cache, req.tokens, req.blocks, start, end, range(layer, layer + 1))
                self.worker.save_kv_layer(layer, None)
            self.worker.wait_for_save(None)
        self.worker.wait_idle(10)
        self._sample(plan)
        self._report()

    def run(self) -> None:
        """Iterates until every request is done (no call beyond TensorRT-LLM's own)."""
        steps, idle_since = 0, None
        while steps < MAX_ITERATIONS:
            if not (self.waiting or self.loading or self.running or self.saving):
                return
            if self.waiting or self.running:
                steps, idle_since = steps + 1, None
            else:  # only the connector's work is left: give its threads time
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > IDLE_LIMIT:
                    break
                time.sleep(IDLE_WAIT)
            self.step()
        raise AssertionError(
            f"engine still busy after {steps} steps: waiting {len(self.waiting)}, loading "
            f"{len(self.loading)}, running {len(self.running)}, saving {len(self.saving)}"
        )

    def _admit(self) -> None:
        for req in self.waiting:
            n, load_async = self.sched.get_num_new_matched_tokens(req, 0)
            assert n % BS == 0 and load_async == (n > 0)
            self.matched[req.request_id] = (n, load_async)
            skip = 0 if self.window_blocks is None else max(0, n // BS - self.window_blocks)
            req.blocks = [-1 if i < skip else self._alloc() for i in range(-(-req.prompt_len // BS))]
            self.sched.update_state_after_alloc(req, list(req.blocks))
            if load_async:
                req.loaded = n
                req.pos = n
                self.new_loading.append(req.request_id)
                self.loading.append(req)
            else:
                self.running.append(req)
        self.waiting = []

    def _plan(self):
        output = TrtSchedulerOutput()
        plan = []
        for req in self.running:
            n = len(req.tokens)
            context = req.pos < req.prompt_len
            start, end = (req.pos, min(req.pos + self.chunk, req.prompt_len)) if context else (n - 1, n)
            while len(req.blocks) * BS < end:
                req.blocks.append(self._alloc())
            # After an asynchronous load the first appearance already counts the loaded tokens.
            computed = req.pos if context else n - 1
            data = RequestData(
                request_id=req.request_id,
                new_tokens=req.tokens[req.reported_tokens :],
                new_block_ids=req.blocks[req.reported_blocks :],
                computed_position=computed,
                num_scheduled_tokens=end - start,
            )
            req.reported_tokens, req.reported_blocks = n, len(req.blocks)
            (output.cached_requests if req.appeared else output.new_requests).append(data)
            req.appeared = True
            plan.append((req, (start, end)))
        return output, plan

    def _sample(self, plan) -> None:
        for req, (_, end) in plan:
            req.pos = end
            if req.pos < len(req.tokens):
                continue
            req.tokens.append(next_token(req.tokens))
            if len(req.tokens) - req.prompt_len == req.max_new:
                self.running.remove(req)
                self._finish(req)

    def _finish(self, req: LlmRequest) -> None:
        held = self.sched.request_finished(req, list(req.blocks))
        assert isinstance(held, bool)
        self.held[req.request_id] = held
        if held:
            self.new_saving.append(req.request_id)
            self.saving.append(req)
        else:
            self._release(req)

    def abort(self, request_id: int) -> bool:
        for q in (self.loading, self.running):
            for req in q:
                if req.request_id == request_id:
                    q.remove(req)
                    self._finish(req)
                    return self.held[request_id]
        raise KeyError(request_id)

    def _report(self) -> None:
        finished, self.new_saving = self.new_saving, []
        loading, self.new_loading = self.new_loading, []
        saved, loaded = self.worker.get_finished(finished, loading)
        for rid in loaded:
            assert rid not in self.loaded_ids, f"request {rid} reported loaded twice"
            self.loaded_ids.add(rid)
            req = next(r for r in self.loading + self.saving if r.request_id == rid)
            self.verified_blocks += self.verify_onboarded(req)
            if req in self.loading:
                self.loading.remove(req)
                self.running.append(req)
        for rid in saved:
            req = next(r for r in self.saving if r.request_id == rid)
            self.saving.remove(req)
            self._release(req)

    def verify_onboarded(self, req: LlmRequest) -> int:
        checked = 0
        for b in range(req.loaded // BS):
            if req.blocks[b] < 0:
                continue  # no page here (before the sliding window): nothing was loaded
            checked += 1
            got = self.cache.read_block(req.blocks[b])
            assert got == expected_block(req.tokens, b), (
                f"request {req.request_id}: onboarded block {b} (device block {req.blocks[b]}) "
                "does not hold its prefix's KV"
            )
        return checked

    def _release(self, req: LlmRequest) -> None:
        for b in req.blocks:
            if b < 0:
                continue
            self.cache.fill(b, junk(b))
            assert b not in self.free
            self.free.add(b)
        self.done[req.request_id] = req


# -------------------------------------------------------------------------------------------------
# vLLM
# -------------------------------------------------------------------------------------------------


@dataclass
class CacheConfig:
    block_size: int = BS


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class KVTransferConfig:
    kv_connector: str = "KvbmConnector"
    kv_connector_module_path: str = "kvbm_connector.vllm"
    kv_role: str = "kv_both"
    # vLLM makes a fresh uuid4 per config (KVTransferConfig.__post_init__).
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_connector_extra_config: dict = field(default_factory=dict)


@dataclass
class VllmConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)


@dataclass
class LoRARequest:
    lora_name: str


@dataclass
class Request:
    """``vllm.v1.request.Request``: the fields the connector reads, plus the stand-in's state."""

    request_id: str
    prompt_token_ids: List[int]
    max_tokens: int
    all_token_ids: List[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: Optional[str] = None
    lora_request: Optional[LoRARequest] = None
    blocks: List[int] = field(default_factory=list)
    status: str = "waiting"
    loading: Tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)


class KVCacheBlocks:
    """``vllm.v1.core.kv_cache_manager.KVCacheBlocks``: ``get_block_ids()`` gives one list per
    KV-cache group."""

    def __init__(self, block_ids: List[int]) -> None:
        self._ids = list(block_ids)

    def get_block_ids(self) -> Tuple[List[int], ...]:
        return (list(self._ids),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: List[int]
    block_ids: Tuple[List[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_from_preemption: List[bool] = field(default_factory=list)
    new_token_ids: List[List[int]] = field(default_factory=list)
    new_block_ids: List[Optional[Tuple[List[int], ...]]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: Dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: Set[str] = field(default_factory=set)
    preempted_req_ids: Set[str] = field(default_factory=set)
    kv_connector_metadata: object = None


class VllmRunner:
    """One rank's model runner with its worker-role connector (vLLM's
    ``KVConnectorModelRunnerMixin``): per step ``bind_connector_metadata`` -> ``start_load_kv`` ->
    per layer ``wait_for_layer_load`` / forward / ``save_kv_layer`` -> ``wait_for_save`` ->
    ``get_finished(finished_req_ids)`` -> ``get_block_ids_with_load_errors`` ->
    ``clear_connector_metadata``. The rank's KV differs from the other ranks' (its shard)."""

    def __init__(self, connector, cache: VllmCache, rank: int = 0) -> None:
        self.worker = connector
        self.cache = cache
        self.rank = rank

    def execute(self, metadata, work, finished_req_ids):
        """``work``: ``(tokens, blocks, start, n)`` per scheduled request."""
        w = self.worker
        w.bind_connector_metadata(metadata)
        w.start_load_kv(object())
        for l in range(LAYERS):
            name = layer_name(l)
            w.wait_for_layer_load(name)
            for tokens, blocks, start, n in work:
                write_kv(self.cache, tokens, blocks, start, start + n, range(l, l + 1), self.rank)
            w.save_kv_layer(name, self.cache.tensors[name], None)
        w.wait_for_save()
        # One legal interleaving: transfers finish before the step returns (deterministic runs).
        w.wait_idle(10)
        sending, recving = w.get_finished(set(finished_req_ids))
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        assert sending is None or (isinstance(sending, set) and sending)
        assert recving is None or (isinstance(recving, set) and recving)
        assert isinstance(errors, set)
        return sending or set(), recving or set(), errors

    def read_block(self, block: int) -> bytes:
        return self.cache.read_block(block)

    def fill(self, block: int, data: bytes) -> None:
        self.cache.fill(block, data)

    def close(self) -> None:
        pass


class VllmEngine:
    """vLLM v1's engine core in miniature: FCFS scheduling with a token budget (chunked
    prefill), WAITING_FOR_REMOTE_KVS for asynchronous loads, the scheduler-side connector calls,
    one :class:`VllmRunner` per rank (in this process or another), and ``update_from_output``.

    Scheduler, per step: for each waiting request ``get_num_new_matched_tokens`` -> allocate ->
    ``update_state_after_alloc(request, blocks, num_external_tokens)``, then
    ``build_connector_meta(scheduler_output)``; the metadata goes to every rank (pickled, for a
    rank in another process, as vLLM's multiprocess executor sends the scheduler output). An id
    counts as finished sending / receiving once every rank reported it (vLLM's
    ``KVOutputAggregator``). Then sampling, ``request_finished`` for finished requests, and
    ``update_connector_output``.
    """

    def __init__(self, scheduler, runners, num_blocks: int, budget: int = 32) -> None:
        self.sched = scheduler
        self.runners = list(runners)
        self.num_blocks = num_blocks
        self.budget = budget
        # vLLM's block pool keeps block 0 as its null block: no request gets it (the connector
        # never reads or writes it).
        self.free = set(range(1, num_blocks))
        self.reqs: Dict[str, Request] = {}
        self.waiting: List[str] = []
        self.running: List[str] = []
        self.finished_ids: Set[str] = set()
        self.recving: Set[str] = set()
        self.matches: Dict[str, Tuple[int, bool]] = {}
        self.hit_sources: Dict[str, dict] = {}
        self.held: Dict[str, bool] = {}
        self.pending_reports: Dict[Tuple[str, str], int] = {}
        self.verified_blocks = 0
        self.step_no = 0
        for b in range(num_blocks):
            self._clobber(b)

    def _clobber(self, b: int) -> None:
        for r in self.runners:
            r.fill(b, junk(b))

    def add(self, req_id: str, tokens: List[int], max_tokens: int = 1, **kw) -> Request:
        r = Request(req_id, list(tokens), max_tokens, **kw)
        self.reqs[req_id] = r
        self.waiting.append(req_id)
        return r

    def _alloc(self, n: int) -> List[int]:
        out = sorted(self.free)[:n]
        assert len(out) == n, "device out of blocks"
        self.free.difference_update(out)
        return out

    def _free(self, blocks: List[int]) -> None:
        for b in blocks:
            self._clobber(b)
            assert b not in self.free
            self.free.add(b)

    def _schedule(self):
        out = SchedulerOutput(finished_req_ids=self.finished_ids)
        self.finished_ids = set()
        work = []
        budget = self.budget
        for rid in self.running:
            if budget == 0:
                break
            r = self.reqs[rid]
            start = r.num_computed_tokens
            n = min(len(r.all_token_ids) - start, budget)
            need = max(0, -(-(start + n) // BS) - len(r.blocks))
            new = self._alloc(need)
            r.blocks += new
            c = out.scheduled_cached_reqs
            c.req_ids.append(rid)
            c.resumed_from_preemption.append(False)
            c.new_token_ids.append([])  # vLLM fills these only with pipeline parallelism
            c.new_block_ids.append((new,) if new else None)
            c.num_computed_tokens.append(start)
            out.num_scheduled_tokens[rid] = n
            work.append((rid, start, n))
            budget -= n
        skipped = []
        while budget > 0 and self.waiting:
            rid = self.waiting.pop(0)
            r = self.reqs[rid]
            if r.status == "waiting_for_remote_kvs":
                if rid not in self.recving:
                    skipped.append(rid)
                    continue
                self.recving.discard(rid)
                computed = min(len(r.blocks) * BS, len(r.all_token_ids))
                if computed == len(r.all_token_ids):
                    computed -= 1
                r.num_computed_tokens = computed
                r.status = "waiting"
            if r.num_computed_tokens == 0:
                ext, load_async = self.sched.get_num_new_matched_tokens(r, 0)
                assert ext is not None
                self.matches[rid] = (ext, load_async)
                computed = ext
            else:
                ext, load_async, computed = 0, False, r.num_computed_tokens
            n = 0 if load_async else min(len(r.all_token_ids) - computed, budget)
            need = max(0, -(-(computed + n) // BS) - len(r.blocks))
            r.blocks += self._alloc(need)
            self.sched.update_state_after_alloc(r, KVCacheBlocks(r.blocks), ext)
            if ext:  # newer vLLM: which tier served the hit, for its prefix-cache stats
                self.hit_sources[rid] = self.sched.get_external_cache_hit_sources(r, ext)
            if load_async:
                r.status = "waiting_for_remote_kvs"
                r.loading = (0, computed // BS)
                r.num_computed_tokens = computed
                skipped.append(rid)
                continue
            r.status = "running"
            out.scheduled_new_reqs.append(
                NewRequestData(rid, list(r.prompt_token_ids), (list(r.blocks),), computed)
            )
            out.num_scheduled_tokens[rid] = n
            self.running.append(rid)
            work.append((rid, computed, n))
            budget -= n
        self.waiting = skipped + self.waiting
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out, work

    def _aggregate(self, kind: str, per_rank: List[Set[str]]) -> Set[str]:
        done = set()
        for ids in per_rank:
            for rid in ids:
                key = (kind, rid)
                self.pending_reports[key] = self.pending_reports.get(key, 0) + 1
                if self.pending_reports[key] == len(self.runners):
                    del self.pending_reports[key]
                    done.add(rid)
        return done

    def step(self) -> dict:
        self.step_no += 1
        out, work = self._schedule()
        out.kv_connector_metadata = self.sched.build_connector_meta(out)
        for rid, _, n in work:  # the scheduler's _update_after_schedule
            self.reqs[rid].num_computed_tokens += n
        plan = [
            (self.reqs[rid].all_token_ids, self.reqs[rid].blocks, start, n)
            for rid, start, n in work
        ]
        results = [r.execute(out.kv_connector_metadata, plan, out.finished_req_ids) for r in self.runners]
        report = {
            "sending": self._aggregate("sending", [s for s, _, _ in results]),
            "recving": self._aggregate("recving", [v for _, v, _ in results]),
            "errors": set().union(*(e for _, _, e in results)),
        }
        self._update_from_output(work, report)
        self.sched.update_connector_output(report)
        return report

    def _update_from_output(self, work, report) -> None:
        for rid, _, _ in work:
            r = self.reqs[rid]
            if r.num_computed_tokens < len(r.all_token_ids):
                continue
            r.all_token_ids.append(next_token(r.all_token_ids))
            if len(r.all_token_ids) - len(r.prompt_token_ids) >= r.max_tokens:
                self.finish(rid)
        for rid in report["recving"]:
            r = self.reqs.get(rid)
            if r is None or r.status != "waiting_for_remote_kvs":
                continue
            for b in range(*r.loading):
                for runner in self.runners:
                    got = runner.read_block(r.blocks[b])
                    assert got == expected_block(r.all_token_ids, b, runner.rank), (
                        f"rank {runner.rank}: request {rid} block {b} loaded into device block "
                        f"{r.blocks[b]} does not hold its prefix's KV"
                    )
                self.verified_blocks += 1
            self.recving.add(rid)
        for rid in report["sending"]:
            r = self.reqs.pop(rid)
            assert r.status == "finished_held", f"{rid} was not held"
            self._free(r.blocks)

    def finish(self, rid: str) -> bool:
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        r = self.reqs[rid]
        delay, params = self.sched.request_finished(r, list(r.blocks))
        assert params is None and isinstance(delay, bool)
        self.held[rid] = delay
        self.finished_ids.add(rid)
        if delay:
            r.status = "finished_held"
        else:
            self._free(self.reqs.pop(rid).blocks)
        return delay

    def _runnable(self) -> bool:
        """Whether the next step can schedule a request (not only wait for the connector)."""
        return bool(self.running) or any(
            self.reqs[rid].status != "waiting_for_remote_kvs" or rid in self.recving
            for rid in self.waiting
        )

    def run(self) -> None:
        steps, idle_since = 0, None
        while steps < MAX_ITERATIONS:
            if self._runnable():
                steps, idle_since = steps + 1, None
            elif idle_since is None:
                idle_since = time.monotonic()
            else:  # only the connector's work is left: give its threads time
                if time.monotonic() - idle_since > IDLE_LIMIT:
                    break
                time.sleep(IDLE_WAIT)
            self.step()
            if not self.reqs and not self.finished_ids and not self.sched.has_pending_work():
                return
        held = sorted(rid for rid, r in self.reqs.items() if r.status == "finished_held")
        raise AssertionError(
            f"engine does not drain after {steps} steps: waiting {self.waiting}, running "
            f"{self.running}, held {held}, finished {sorted(self.finished_ids)}, pending work "
            f"{self.sched.has_pending_work()}, metrics {self.sched.metrics()}"
        )

    def close(self) -> None:
        for r in self.runners:
            r.close()


# -------------------------------------------------------------------------------------------------
# A rank in another process (vLLM's multiprocess executor)
# -------------------------------------------------------------------------------------------------


def _remote_runner_main(conn, rank: int, world_size: int, env: dict, extra: dict,
                        num_blocks: int, engine_id: Optional[str] = None) -> None:
    """The worker process: builds the worker-role connector as vLLM's worker does (from the
    config the engine pickled to it: ``engine_id`` when given), registers its caches, then serves
    the engine's commands."""
    import os
    import traceback

    os.environ.update(env)
    try:
        from kvbm_connector import vllm as kv

        cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world_size))
        if engine_id is not None:
            cfg.kv_transfer_config.engine_id = engine_id
        cfg.kv_transfer_config.kv_connector_extra_config.update(extra, rank=rank)
        runner = VllmRunner(kv.KvbmConnector(cfg, kv.KVConnectorRole.WORKER),
                            VllmCache(num_blocks), rank)
        runner.worker.register_kv_caches(runner.cache.tensors)
        conn.send(("ok", None))
    except BaseException:  # report anything to the parent instead of hanging it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            return
        try:
            if cmd == "execute":
                result = runner.execute(*args)
            elif cmd == "read_block":
                result = runner.read_block(*args)
            elif cmd == "fill":
                result = runner.fill(*args)
            elif cmd == "wait_ready":
                result = runner.worker.wait_ready(*args)
            else:
                raise ValueError(cmd)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class RemoteVllmRunner:
    """A :class:`VllmRunner` in a child process; arguments and results are pickled."""

    def __init__(self, ctx, rank: int, world_size: int, env: dict, extra: dict,
                 num_blocks: int, engine_id: Optional[str] = None) -> None:
        self.rank = rank
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_remote_runner_main,
            args=(child, rank, world_size, env, extra, num_blocks, engine_id),
            daemon=True,
        )
        self._proc.start()

    def _call(self, cmd: str, *args, timeout: float = 60.0):
        if cmd != "started":
            self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise AssertionError(f"rank {self.rank}: no answer to {cmd} within {timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise AssertionError(f"rank {self.rank}: {cmd} failed in the worker process:\n{value}")
        return value

    def started(self) -> None:
        self._call("started")

    def execute(self, metadata, work, finished_req_ids):
        return self._call("execute", metadata, work, set(finished_req_ids))

    def read_block(self, block: int) -> bytes:
        return self._call("read_block", block)

    def fill(self, block: int, data: bytes) -> None:
        self._call("fill", block, data)

    def wait_ready(self, timeout_secs: float) -> None:
        self._call("wait_ready", timeout_secs)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", ()))
                self._conn.poll(5)
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()


def kvbm_environ() -> dict:
    """This process's ``KVBM_*`` / ``DYN_KVBM_*`` variables, for a worker process."""
    import os

    return {k: v for k, v in os.environ.items() if k.startswith(("KVBM_", "DYN_KVBM_"))}


def serve_a_prefix_again(engine: "VllmEngine") -> None:
    """Prompt A (16 tokens), then A plus 6 more: the second request's first 16 tokens are served
    by the connector (offloaded after the first, loaded back and verified by the engine)."""
    a = prompt(3, 16)
    engine.add("a", a, max_tokens=2)
    engine.run()
    engine.add("b", a + prompt(4, 6), max_tokens=2)
    engine.run()
    assert engine.matches["b"] == (16, True)


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)
