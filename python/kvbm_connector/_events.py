"""vLLM's KV-cache events for the blocks our tiers hold (``take_events``).

A cache-aware router (Dynamo's, vLLM's own router examples) learns which instance holds which
prefix from the events vLLM publishes (``kv_events_config``): ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``. vLLM announces its device cache; a connector announces its own tiers
through ``take_events``. Ours: ``BlockStored`` when a block reaches the host tier (medium
``CPU``) or the disk tier (``STORAGE``), ``BlockRemoved`` when it leaves one, and for the shared
store (Redis/Valkey) ``BlockStored`` from the instance that wrote the block (medium ``STORAGE``,
locality ``REMOTE``, ownership ``kvbm-shared``; the store evicts on its own, so its removals are
not announced); ``AllBlocksCleared`` after ``reset_cache``.

Our block keys are not vLLM's block hashes, so the leader says, for each store it decides,
which block of which request the key is (``take_block_events``' *submitted* list), and this
module reads that block's hash, its parent's, its tokens and its LoRA from vLLM's ``Request``
while vLLM still has it. The payload is kept while a tier holds the block, so its removal names
the same hashes; payloads of stores that never completed are bounded (the oldest forgotten).

Bounded on both sides: the leader's log drops the oldest events when nobody takes them (vLLM
takes them every step) and counts the drops (``dropped``, logged as a warning).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

_log = logging.getLogger("kvbm_connector")

#: Events (and submitted stores) the leader keeps between two ``take_events`` at most.
DEFAULT_CAPACITY = 1 << 16
#: Payloads of stores decided but not yet completed, kept at most (the oldest forgotten).
PENDING_PAYLOADS = 1 << 16
#: ``ownership`` of the shared store's events (vLLM: "secondary tier identifier").
SHARED_OWNERSHIP = "kvbm-shared"


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (``kv_events_config.enable_kv_cache_events``)."""
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))


def group_specs(kv_cache_config: Any, groups: int) -> List[Tuple[Optional[str], Optional[int]]]:
    """``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` of each KV-cache group, as vLLM's
    own events fill them (``None`` where vLLM cannot say)."""
    out: List[Tuple[Optional[str], Optional[int]]] = [(None, None)] * max(groups, 1)
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )
    except Exception:  # an older vLLM: the fields stay unset
        return out
    for i, g in enumerate(list(getattr(kv_cache_config, "kv_cache_groups", None) or ())[:groups]):
        spec = getattr(g, "kv_cache_spec", None)
        if spec is None:
            continue
        try:
            out[i] = (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec))
        except Exception:
            pass
    return out


class BlockEventTranslator:
    """Turns the leader's block events into vLLM's ``KVCacheEvent`` objects (scheduler side)."""

    def __init__(self, scheduler: Any, block_size: int, specs: List[Tuple[Optional[str], Optional[int]]],
                 capacity: int = DEFAULT_CAPACITY) -> None:
        from vllm.distributed.kv_events import (  # only built when vLLM publishes events
            MEDIUM_CPU,
            MEDIUM_STORAGE,
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls, self._cleared_cls = (
            BlockStored, BlockRemoved, AllBlocksCleared)
        self._convert = maybe_convert_block_hash
        # tier -> (medium, locality, ownership)
        self._media = {
            "host": (MEDIUM_CPU, "LOCAL", None),
            "disk": (MEDIUM_STORAGE, "LOCAL", None),
            "remote": (MEDIUM_STORAGE, "REMOTE", SHARED_OWNERSHIP),
        }
        self._sched = scheduler
        self._block_size = int(block_size)
        self._specs = specs
        scheduler.record_block_events(int(capacity))
        # vLLM's Request of each request between update_state_after_alloc and the take after its
        # request_finished (a store decided at its finish is read then).
        self._live: Dict[str, Any] = {}
        self._finished: List[str] = []
        # key -> payload: decided, not yet in a tier (bounded) ...
        self._pending: "OrderedDict[int, tuple]" = OrderedDict()
        # ... and key -> [payload, tiers holding it].
        self._resident: Dict[int, list] = {}
        self.dropped = 0

    # -- requests ----------------------------------------------------------------------------

    def alloc(self, request: Any) -> None:
        self._live[str(request.request_id)] = request

    def finished(self, request_id: str) -> None:
        self._finished.append(str(request_id))

    # -- payloads ----------------------------------------------------------------------------

    def _payload(self, req: Any, group: int, i: int) -> Optional[tuple]:
        hashes = getattr(req, "block_hashes", None) or ()
        if i >= len(hashes) or hashes[i] is None:
            return None
        bs = self._block_size
        parent = hashes[i - 1] if i > 0 else None
        # Kept while a tier holds the block: 8 bytes a token, not a Python int each.
        tokens = array("q", req.all_token_ids[i * bs:(i + 1) * bs])
        if len(tokens) != bs:
            return None
        lora = getattr(req, "lora_request", None)
        lora_id = getattr(lora, "adapter_id", None) if lora is not None else None
        lora_name = getattr(lora, "name", None) if lora is not None else None
        return (hashes[i], parent, tokens, lora_id, lora_name, group)

    def resolve(self) -> List[Any]:
        """Reads the payloads of the stores decided since the last call (vLLM calls
        ``take_events`` at the end of every step, after that step's ``request_finished`` calls,
        so every request whose store was decided is still here), then forgets the finished
        requests; returns the tier events taken with them."""
        submitted, events, dropped = self._sched.take_block_events()
        if dropped:
            self.dropped += dropped
            _log.warning("kvbm connector: %d KV events dropped (nobody took them in time)", dropped)
        for rid, group, i, key in submitted:
            if key in self._resident or key in self._pending:
                continue
            req = self._live.get(rid)
            if req is None:
                continue
            p = self._payload(req, group, i)
            if p is None:
                continue
            self._pending[key] = p
            if len(self._pending) > PENDING_PAYLOADS:
                self._pending.popitem(last=False)
        for rid in self._finished:
            self._live.pop(rid, None)
        self._finished.clear()
        return events

    # -- events ------------------------------------------------------------------------------

    def take(self) -> List[Any]:
        """vLLM's events for what our tiers stored and removed since the last call."""
        out: List[Any] = []
        for kind, tier, key in self.resolve():
            if kind == "cleared":
                self._pending.clear()
                self._resident.clear()
                out.append(self._cleared_cls())
                continue
            medium, locality, ownership = self._media.get(tier, (None, None, None))
            if kind == "stored":
                entry = self._resident.get(key)
                if entry is None:
                    p = self._pending.pop(key, None)
                    if p is None:
                        continue  # not decided by a request of this engine (e.g. adopted from disk)
                    entry = [p, set()]
                    self._resident[key] = entry
                if tier != "remote":
                    entry[1].add(tier)
                elif not entry[1]:
                    del self._resident[key]  # only the shared store has it: no removal will come
                out.append(self._stored(entry[0], medium, locality, ownership))
            elif kind == "removed":
                entry = self._resident.get(key)
                if entry is None:
                    continue
                entry[1].discard(tier)
                if not entry[1]:
                    del self._resident[key]
                h, _parent, _tokens, _lid, _lname, group = entry[0]
                out.append(self._removed_cls(
                    block_hashes=[self._convert(h)], medium=medium, group_idx=group,
                    locality=locality, ownership=ownership))
        return out

    def _stored(self, p: tuple, medium: Any, locality: Any, ownership: Any) -> Any:
        h, parent, tokens, lora_id, lora_name, group = p
        kind, window = self._specs[group] if group < len(self._specs) else (None, None)
        return self._stored_cls(
            block_hashes=[self._convert(h)],
            parent_block_hash=self._convert(parent) if parent is not None else None,
            token_ids=tokens.tolist(),
            block_size=self._block_size,
            lora_id=lora_id,
            medium=medium,
            lora_name=lora_name,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=locality,
            ownership=ownership,
        )

    def tracked(self) -> Tuple[int, int, int]:
        """``(live requests, pending payloads, resident payloads)``, for tests."""
        return len(self._live), len(self._pending), len(self._resident)
