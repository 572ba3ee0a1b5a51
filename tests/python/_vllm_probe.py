"""A test-only subclass of ``kvbm_connector.vllm.KvbmConnector`` for tests/python/test_vllm_forward.py
(named by ``kv_connector_module_path="_vllm_probe"``; in-process engines only).

It records the cache tensors vLLM registers (to check their layout against an independent
computation) and, when ``zero_after_load`` is set, zeroes them right after the connector reports
a load finished: the negative control, bytes loaded wrong, which must change the output.
"""

from __future__ import annotations

from typing import Any

from kvbm_connector import detect_vllm_layout
from kvbm_connector import vllm as kv


class ProbeConnector(kv.KvbmConnector):
    zero_after_load = False
    zeroed = 0
    _caches: dict = {}
    _layout_kind = None

    @classmethod
    def reset_probe(cls) -> None:
        cls.zero_after_load = False
        cls.zeroed = 0
        cls._caches = {}
        cls._layout_kind = None

    @classmethod
    def caches(cls) -> dict:
        return cls._caches

    @classmethod
    def layout_kind(cls):
        return cls._layout_kind

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        type(self)._caches = dict(kv_caches)
        hint = kv._backend_layout(self._kvbm_vllm_config, list(dict(kv_caches)))
        type(self)._layout_kind = detect_vllm_layout(kv_caches, self.block_size, layout=hint)["kind"]

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        if recving and type(self).zero_after_load:
            for t in type(self)._caches.values():
                t.zero_()
            type(self).zeroed += 1
        return sending, recving
