"""kvbm_connector: a KV-cache block manager for inference engines.

It offloads full KV blocks from the engine's cache to host memory and disk, and onboards them
back when a later request shares a prefix, so the engine skips recomputing it. The work is done
by the Rust crate `kvbm-connector`; this package is its Python face:

* :mod:`kvbm_connector.trtllm` -- ``KvbmConnectorScheduler`` and ``KvbmConnectorWorker`` for
  TensorRT-LLM's ``kv_connector_config``;
* :mod:`kvbm_connector.vllm` -- ``KvbmConnector`` (a ``KVConnectorBase_V1``) for vLLM's
  ``--kv-transfer-config``;
* :class:`Config` -- the configuration, read by :func:`load_config` from the same file
  (``$KVBM_CONFIG``) and environment variables (``KVBM_*``, ``DYN_KVBM_*``) as the Rust side;
* :class:`KvbmError` -- every error, with ``.kind``, ``.message`` and ``.context``.

The engine modules are not imported here: importing ``kvbm_connector`` never imports an engine.
See docs/python.md.
"""

from ._kvbm import (
    ERROR_KINDS,
    Config,
    KvbmError,
    LeaderTransport,
    WorkerTransport,
    __version__,
    detect_trtllm_layout,
    detect_vllm_layout,
    env_vars,
    in_process_transport,
    rendezvous_leader,
    rendezvous_worker,
    tcp_leader,
    tcp_worker,
)
from ._wiring import LEADER_ADDR_ENV, RANK_ENV, leader_transport, load_config, worker_transport

__all__ = [
    "ERROR_KINDS",
    "Config",
    "KvbmError",
    "LEADER_ADDR_ENV",
    "LeaderTransport",
    "RANK_ENV",
    "WorkerTransport",
    "__version__",
    "detect_trtllm_layout",
    "detect_vllm_layout",
    "env_vars",
    "in_process_transport",
    "leader_transport",
    "load_config",
    "rendezvous_leader",
    "rendezvous_worker",
    "tcp_leader",
    "tcp_worker",
    "worker_transport",
]
