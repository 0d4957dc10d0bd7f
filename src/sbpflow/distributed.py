"""Real processes: start-up from torchrun's environment, rank queries, and the fault machinery.

Without torchrun's environment one process owns every rank (the simulated backend); under ``torchrun`` or
``sbpflow launch`` each process owns its own global rank. sbpflow initialises itself on first use, so the
same script runs both ways, and faults end a job instead of hanging it.

>>> import sbpflow
>>> sbpflow.rank(), sbpflow.world_size()          # a plain `python script.py`
(0, 1)
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import CommError, SbpflowError
from .placement import WORLD_SIZE

if TYPE_CHECKING:
    from .comm.base import Backend

DEFAULT_TIMEOUT = 300.0
DEFAULT_INIT_TIMEOUT = 120.0
RESTART_BASE = "SBPFLOW_RESTART_BASE"  # restarts made by `sbpflow launch -n MIN:MAX` before this torchrun job


@dataclass(frozen=True)
class Config:
    """What this process learns from its environment, read once at start-up."""

    launched: bool  # torchrun (or sbpflow launch) started this process: RANK and WORLD_SIZE are set
    rank: int  # this process's global rank (RANK)
    world_size: int  # number of processes in the job (WORLD_SIZE)
    local_rank: int  # rank within this node; picks the GPU of cuda placements (LOCAL_RANK)
    master_addr: str  # host of the rendezvous store (MASTER_ADDR)
    master_port: int  # its port (MASTER_PORT)
    timeout: float  # seconds a collective waits for its peers before CommError (SBPFLOW_TIMEOUT)
    debug: bool  # compare every collective's fingerprint across its group first (SBPFLOW_DEBUG=1)
    error_file: str | None = None  # where torchrun wants a failed worker's error (TORCHELASTIC_ERROR_FILE)
    host_cache: bool = True  # malloc keeps freed host memory for the next step (SBPFLOW_HOST_CACHE=0: not)
    restart_count: int = 0  # which attempt of a restarted job this is (TORCHELASTIC_RESTART_COUNT + RESTART_BASE)
    agent_store: bool = False  # torchrun's agent hosts the store, kept across restarts (TORCHELASTIC_USE_AGENT_STORE)
    init_timeout: float = DEFAULT_INIT_TIMEOUT  # start-up's wait for the store and every peer (SBPFLOW_INIT_TIMEOUT)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Reads torchrun's variables and sbpflow's own; a malformed value raises SbpflowError."""
        env = os.environ if env is None else env
        launched = "RANK" in env and "WORLD_SIZE" in env
        return cls(
            launched=launched,
            rank=_int(env, "RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_rank=_int(env, "LOCAL_RANK", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            timeout=_float(env, "SBPFLOW_TIMEOUT", DEFAULT_TIMEOUT),
            debug=_flag(env, "SBPFLOW_DEBUG", False),
            error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
            host_cache=_flag(env, "SBPFLOW_HOST_CACHE", True),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0) + _int(env, RESTART_BASE, 0),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            init_timeout=_float(env, "SBPFLOW_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT),
        )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None:
        return default
    return text.strip().lower() not in ("", "0", "false", "no", "off")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise SbpflowError(f"environment variable {name} must be an integer, but it is {text!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SbpflowError(f"environment variable {name} must be a positive number of seconds, but it is {text!r}")
    return value


# ----------------------------------------------------------------------------- start-up


@dataclass
class _State:
    config: Config | None = None
    backend: Backend | None = None


_state = _State()
_init_lock = threading.Lock()


@dataclass(frozen=True)
class CommHooks:
    """How `sbpflow.comm` makes and installs backends: comm sits above this module and registers these at import."""

    make: Callable[[Config], Backend]  # a launched process's backend, or the simulated one
    installed: Callable[[], Backend | None]  # the backend comm hands out now
    install: Callable[[Backend | None], object]  # comm.set_backend


_comm: CommHooks | None = None


def register_comm(hooks: CommHooks) -> None:
    global _comm
    _comm = hooks


def _hooks() -> CommHooks:
    if _comm is None:
        raise SbpflowError("sbpflow.comm is not imported: import sbpflow before starting up its processes")
    return _comm


def config() -> Config:
    """This process's :class:`Config` (the environment is read on the first call only)."""
    if _state.config is None:
        _state.config = Config.from_env()
    return _state.config


def init(cfg: Config | None = None) -> Backend:
    """Sets up this process's comm backend once and returns it; later calls return the same one.

    Under torchrun this joins the default process group (gloo; cuda placements
    get NCCL groups of their own) and binds cuda placements to GPU
    ``LOCAL_RANK``. Otherwise it installs the simulated backend.

    Faults end a job instead of hanging it. Start-up waits at most
    ``SBPFLOW_INIT_TIMEOUT`` seconds (:mod:`sbpflow.comm.rendezvous`); every
    collective at most ``SBPFLOW_TIMEOUT`` seconds, then raises a CommError
    naming the op or boxing step it waited in (:func:`activity`).
    ``SBPFLOW_DEBUG=1`` makes every group compare what its members are about
    to issue before each collective, and checks that the replicas of a B tensor
    built from per-process data are equal on every rank. An uncaught exception
    in a launched process names the rank and exits at once, so its peers see
    closed connections instead of waiting. The environment is read once, into
    :class:`Config`; library code never writes ``os.environ``.
    """
    comm = _hooks()
    with _init_lock:
        if _state.backend is not None:
            if comm.installed() is None:  # someone cleared it with set_backend(None): put ours back
                comm.install(_state.backend)
            return _state.backend
        if cfg is not None:
            _state.config = cfg
        cfg = config()

        backend = comm.make(cfg)
        if cfg.launched:
            _install_excepthook(cfg)
            # Leave the process group before the interpreter tears down: gloo's threads still joinable at
            # exit make the C++ runtime abort ("terminate called without an active exception", SIGABRT).
            atexit.register(shutdown)
        _state.backend = backend
        comm.install(backend)
        return backend


def is_initialized() -> bool:
    return _state.backend is not None


def shutdown() -> None:
    """Leaves the process group (if any) and goes back to the simulated backend; init() may run again."""
    with _init_lock:
        backend, _state.backend = _state.backend, None
        _state.config = None
        _hooks().install(None)
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def init_process_group(backend: str | None = None, **_: Any) -> None:
    """torch's name for :func:`init`: the backend follows the launcher and the placements (gloo, NCCL for cuda), so
    ``backend`` and torch's other arguments (init_method, rank, world_size from the environment) are not needed."""
    init()


def destroy_process_group() -> None:
    """torch's name for :func:`shutdown`."""
    shutdown()


def get_rank() -> int:
    return rank()


def get_world_size() -> int:
    return world_size()


def rank() -> int:
    """This process's global rank: 0 in a plain (simulated) run.

    >>> import sbpflow
    >>> sbpflow.rank()
    0
    """
    return _this_rank()


def world_size() -> int:
    """The number of processes in the job: 1 in a plain run, where one process owns every rank."""
    init()
    return config().world_size if config().launched else 1


WORLD_SIZE.append(world_size)  # placement.all(type): every process of the job


def _this_rank() -> int:
    init()
    return config().rank if config().launched else 0


def print0(*objects: Any, rank: int = 0, **kwargs: Any) -> None:
    """``print`` on process ``rank`` only (0 by default); other processes print nothing.

    >>> import sbpflow
    >>> sbpflow.print0("loss", 0.25)
    loss 0.25
    """
    if _this_rank() == rank:
        kwargs.setdefault("flush", True)
        print(*objects, **kwargs)


# ----------------------------------------------------------------------------- what is running now

_activity = threading.local()


class activity:
    """Context manager naming what this thread is doing (an op, a boxing step) for comm error messages.

    ``what`` is a string, or a callable that makes one: it is only formatted if
    an error needs it, so dispatch pays next to nothing.

    >>> with activity("op 'matmul'"), activity(lambda: "boxing step 1/1: all_reduce"):
    ...     current_activity()
    "op 'matmul' > boxing step 1/1: all_reduce"
    """

    __slots__ = ("what",)

    def __init__(self, what: str | Callable[[], str]) -> None:
        self.what = what

    def __enter__(self) -> None:
        stack = getattr(_activity, "stack", None)
        if stack is None:
            stack = _activity.stack = []
        stack.append(self.what)

    def __exit__(self, *exc: object) -> None:
        _activity.stack.pop()


def current_activity() -> str:
    """What this thread is doing, outermost first, e.g. ``"op 'matmul' > boxing step 1/2: all_gather ..."``."""
    return _describe(getattr(_activity, "stack", None))


def activity_now() -> Callable[[], str]:
    """:func:`current_activity` as of now, formatted only when called (a collective in flight keeps it for the
    error its wait may raise: formatting a boxing step's name at every issue would cost more than the issue).

    >>> with activity(lambda: "boxing step 1/1: send_recv"):
    ...     issued = activity_now()
    >>> issued()
    'boxing step 1/1: send_recv'
    """
    stack = tuple(getattr(_activity, "stack", None) or ())
    return lambda: _describe(stack)


def _describe(stack: Sequence[str | Callable[[], str]] | None) -> str:
    if not stack:
        return "no sbpflow op (a direct comm call)"
    return " > ".join(w if isinstance(w, str) else w() for w in stack)


# ----------------------------------------------------------------------------- failures

PEER_FAILURE_GRACE = 5.0  # seconds a rank that only saw a peer fail waits before it exits (see below)


def peer_failed(error: BaseException) -> bool:
    """Whether ``error`` says another process went away (a consequence, not the cause, of a failed job)."""
    return isinstance(error, CommError) and getattr(error, "peer_failed", False)


def _install_excepthook(cfg: Config) -> None:
    """On an uncaught exception: print it, name the rank, and leave at once.

    Leaving with ``os._exit`` skips interpreter teardown, where a process group
    whose peers are gone can block; the peers then see a closed connection and
    fail fast instead of waiting for their timeout. A rank that fails only
    because a peer went away waits ``PEER_FAILURE_GRACE`` seconds first, so that
    the launcher sees the failed rank exit first and names it as the root cause
    (torchrun then stops the waiting ranks itself). Under torchrun the error
    also goes to its error file, so torchrun's summary shows the message.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(kind, value, tb)
            secondary = peer_failed(value)
            note = " (a peer failed first)" if secondary else ""
            print(f"sbpflow: rank {cfg.rank} failed with {kind.__name__}: {value}{note}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if secondary:
                time.sleep(PEER_FAILURE_GRACE)
            if cfg.error_file:
                _write_error_file(cfg.error_file, f"{kind.__name__}: {value}", "".join(traceback.format_tb(tb)))
        except Exception:  # noqa: BLE001 - the exit below must happen whatever printing does
            traceback.print_exc()
        finally:
            os._exit(1)

    sys.excepthook = hook


def _write_error_file(path: str, message: str, callstack: str) -> None:
    """The error file format torchrun reads back into its failure summary."""
    import json

    body = {"message": {"message": message, "extraInfo": {"py_callstack": callstack,
                                                          "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(body, f)
