"""How a scheduler finds its workers: configuration and transports.

* Rendezvous (vLLM's default; any executor, any number of ranks on one machine): the scheduler
  listens on an ephemeral loopback port with a fresh random token and publishes ``{address,
  token, pid}`` in a file named from a hash of the *instance* id (vLLM: ``kv_transfer_config.
  engine_id``, which the frontend makes and pickles to the scheduler's and the workers'
  processes) in a private per-user directory (``$KVBM_RENDEZVOUS_DIR``, else
  ``$XDG_RUNTIME_DIR/kvbm-<uid>``, else ``<temp dir>/kvbm-<uid>``; 0700, ownership checked).
  Workers find the file on first use (the worker side may start before the scheduler) and
  connect with the token. It works whether or not the halves share a process; two engines on a
  machine never meet (different ids, different ports); another user cannot read the token.
* One process (tests; TensorRT-LLM with one rank, whose scheduler and worker always share rank
  0's process): the in-process transport. The scheduler and the workers are built separately by
  the engine, so the ends are handed out through a process-wide registry keyed by an *instance*
  name: the first side to ask creates the connected ends, the others take theirs; once every end
  is taken the entry is dropped, so a later engine in the same process gets a fresh set.
* A configured address (several nodes; TensorRT-LLM under MPI): the TCP transport. The scheduler
  listens on ``$KVBM_LEADER_ADDR`` and every worker connects to it as its rank
  (``$KVBM_AUTH_TOKEN``, when set, must match on both sides).

The choice (:func:`choose_transport`): an explicit ``transport``; else TCP when an address is
given or ``$KVBM_LEADER_ADDR`` is set; else the caller's ``default`` (vLLM: ``"rendezvous"``);
else TCP with several ranks and in process with one.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import operator
import os
import threading
import weakref
from typing import Optional

from . import _kvbm
from ._kvbm import Config, KvbmError

LEADER_ADDR_ENV = "KVBM_LEADER_ADDR"
"""The leader's TCP address (``ip:port`` or ``host:port``)."""

RANK_ENV = "KVBM_RANK"
"""A worker's rank when the engine does not say (TensorRT-LLM without MPI, tests)."""

_TRANSPORTS = ("in_process", "tcp", "rendezvous")


def error(kind: str, message: str, **context: object) -> KvbmError:
    """A :class:`KvbmError` shaped like the ones the Rust side raises."""
    text = f"{kind}: {message}"
    if context:
        text += " (" + ", ".join(f"{k}={v}" for k, v in context.items()) + ")"
    e = KvbmError(text)
    e.kind = kind
    e.message = message
    e.context = {k: str(v) for k, v in context.items()}
    return e


def load_config(path: Optional[str] = None) -> Config:
    """The effective configuration: built-in defaults, then the TOML file at ``path`` (else
    ``$KVBM_CONFIG``, else none), then the ``DYN_KVBM_*`` and ``KVBM_*`` environment variables.
    The same ``Config::load`` as the Rust side and the ``kvbm`` CLI."""
    return Config.load(None if path is None else os.fspath(path))


def _check_transport(transport: str, setting: str) -> str:
    if transport not in _TRANSPORTS:
        raise error(
            "invalid_config",
            f"unknown transport {transport!r}: expected 'in_process', 'tcp' or 'rendezvous'",
            setting=setting,
        )
    return transport


def choose_transport(
    world_size: int,
    transport: Optional[str],
    address: Optional[str],
    default: Optional[str] = None,
) -> str:
    """The transport to use (see the module documentation for the order)."""
    if transport is not None:
        return _check_transport(transport, "transport")
    if address or os.environ.get(LEADER_ADDR_ENV):
        return "tcp"
    if default is not None:
        return _check_transport(default, "default")
    return "tcp" if world_size > 1 else "in_process"


def _rendezvous_dir(config: Optional[Config]) -> Optional[str]:
    return None if config is None else os.fspath(config.rendezvous_dir)


# Rendezvous leaders of this process. A leader removes its file when dropped, but an engine
# process that exits (vLLM's EngineCore on SIGTERM) may never drop it: remove the files at exit,
# from atexit (a plain interpreter) and from multiprocessing's exit finalizers (a
# multiprocessing child, such as vLLM's EngineCore, ends with os._exit and runs no atexit hook).
# A process killed outright leaves its file behind; workers ignore it (its pid is dead) and the
# next leader to publish in the directory removes it.
_published: "weakref.WeakSet" = weakref.WeakSet()


def _unpublish_all() -> None:
    for leader in list(_published):
        try:
            leader.unpublish()
        except Exception:  # best effort at exit
            pass


atexit.register(_unpublish_all)
multiprocessing.util.Finalize(None, _unpublish_all, exitpriority=10)


class _Ends:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.leader, workers = _kvbm.in_process_transport(world_size)
        self.workers: list = list(workers)

    def done(self) -> bool:
        return self.leader is None and all(w is None for w in self.workers)


_registry: dict = {}
_registry_lock = threading.Lock()


def _take(instance: str, world_size: int, rank: Optional[int]):
    with _registry_lock:
        ends = _registry.get(instance)
        if ends is None:
            ends = _registry[instance] = _Ends(world_size)
        if ends.world_size != world_size:
            raise error(
                "invalid_argument",
                f"in-process instance {instance!r} was created for {ends.world_size} ranks, "
                f"not {world_size}",
                instance=instance,
            )
        if rank is None:
            end, ends.leader = ends.leader, None
            what = "the leader end"
        else:
            if not 0 <= rank < world_size:
                raise error(
                    "out_of_range",
                    f"rank {rank} out of range (0..{world_size})",
                    rank=rank,
                )
            end, ends.workers[rank] = ends.workers[rank], None
            what = f"the end of rank {rank}"
        if end is None:
            raise error(
                "already_exists",
                f"{what} of in-process instance {instance!r} is taken already; give each "
                "engine in this process its own instance name",
                instance=instance,
            )
        if ends.done():
            del _registry[instance]
        return end


def leader_transport(
    world_size: int,
    *,
    instance: str = "default",
    transport: Optional[str] = None,
    address: Optional[str] = None,
    default: Optional[str] = None,
    config: Optional[Config] = None,
) -> _kvbm.LeaderTransport:
    """The scheduler's end: TCP (listening on ``address``, else ``$KVBM_LEADER_ADDR``), the
    rendezvous of ``instance`` (in ``config``'s rendezvous directory, else
    ``$KVBM_RENDEZVOUS_DIR`` or the default) or the leader end of in-process ``instance``."""
    kind = choose_transport(world_size, transport, address, default)
    if kind == "tcp":
        return _kvbm.tcp_leader(world_size, address)
    if kind == "rendezvous":
        leader = _kvbm.rendezvous_leader(world_size, instance, _rendezvous_dir(config))
        _published.add(leader)
        return leader
    return _take(instance, world_size, None)


def worker_transport(
    rank: int,
    world_size: int,
    *,
    instance: str = "default",
    transport: Optional[str] = None,
    address: Optional[str] = None,
    connect_timeout_secs: float = 60.0,
    default: Optional[str] = None,
    config: Optional[Config] = None,
) -> _kvbm.WorkerTransport:
    """A worker's end: TCP (connecting on first use to ``address``, else
    ``$KVBM_LEADER_ADDR``), the rendezvous of ``instance`` (resolved and connected on first use,
    within ``connect_timeout_secs``) or rank ``rank``'s end of in-process ``instance``."""
    kind = choose_transport(world_size, transport, address, default)
    if kind == "tcp":
        return _kvbm.tcp_worker(
            rank, world_size, address, connect_timeout_secs=connect_timeout_secs
        )
    if kind == "rendezvous":
        return _kvbm.rendezvous_worker(
            rank,
            world_size,
            instance,
            _rendezvous_dir(config),
            connect_timeout_secs=connect_timeout_secs,
        )
    return _take(instance, world_size, rank)


def env_rank(default: int = 0) -> int:
    """``$KVBM_RANK`` as an int, else ``default``."""
    raw = os.environ.get(RANK_ENV)
    if raw is None or raw.strip() == "":
        return default
    try:
        rank = int(raw)
    except ValueError:
        raise error(
            "invalid_config", f"invalid value {raw!r} for {RANK_ENV}: expected an integer",
            setting=RANK_ENV,
        ) from None
    if rank < 0:
        raise error("invalid_config", f"{RANK_ENV} must be >= 0, got {rank}", setting=RANK_ENV)
    return rank


def as_bytes(metadata: object, what: str) -> bytes:
    """Metadata as bytes: ``None`` is empty metadata."""
    if metadata is None:
        return b""
    if isinstance(metadata, bytes):
        return metadata
    if isinstance(metadata, (bytearray, memoryview)):
        return bytes(metadata)
    raise error(
        "invalid_argument",
        f"{what} must be the bytes the scheduler built, got {type(metadata).__name__}",
        argument=what,
    )


def int_list(values: object, what: str) -> list:
    """A list of ints from any iterable of ints (lists, tuples, numpy arrays)."""
    if values is None:
        return []
    try:
        out = [operator.index(v) for v in values]  # type: ignore[union-attr]
    except (TypeError, ValueError) as e:
        raise error("invalid_argument", f"{what} must be a sequence of integers ({e})",
                    argument=what) from None
    return out
