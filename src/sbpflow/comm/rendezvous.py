"""Start-up: a launched process meets its peers, then joins the default gloo group; a failure says what failed.

Each step is bounded by ``SBPFLOW_INIT_TIMEOUT`` and fails with a CommError naming address, port, rank and
world size (port taken, store unreachable, ranks that never arrived), instead of one timeout for all.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ..distributed import Config
from ..errors import CommError

T = TypeVar("T")
POLL_S = 0.02  # how often step 2 looks for the missing ranks


# The steps, on every process:
#   1. connect to the job's TCP store at MASTER_ADDR:MASTER_PORT (rank 0 hosts it, or torchrun's agent does,
#      TORCHELASTIC_USE_AGENT_STORE);
#   2. say "rank r arrived" under this attempt's prefix (a restarted job's agent store keeps the previous
#      attempt's keys) and wait until every rank of WORLD_SIZE has;
#   3. join the gloo group through that store (peers are known to be up, so this is quick).
def join_default_group(cfg: Config, collective_timeout: datetime.timedelta) -> None:
    """Steps 1-3 for this process (``cfg`` from its environment); the group's collectives then wait at most
    ``collective_timeout``."""
    store = dist.PrefixStore(f"sbpflow/attempt-{cfg.restart_count}", _connect(cfg))
    _wait_for_peers(store, cfg)
    store.set_timeout(collective_timeout)
    dist.init_process_group("gloo", store=store, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=collective_timeout)


def _who(cfg: Config) -> str:
    return f"rank {cfg.rank} (world size {cfg.world_size})"


def _where(cfg: Config) -> str:
    return f"{cfg.master_addr}:{cfg.master_port}"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _connect(cfg: Config) -> dist.TCPStore:
    """Step 1: the store, hosted here (rank 0 without an agent store) or reached as a client."""
    hosts = cfg.rank == 0 and not cfg.agent_store
    try:
        return dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=hosts,
                             timeout=datetime.timedelta(seconds=cfg.init_timeout), wait_for_workers=False)
    except (RuntimeError, ValueError) as e:  # DistNetworkError, DistStoreError
        raise CommError(_store_failure(cfg, hosts, e)) from e


def _store_failure(cfg: Config, hosts: bool, error: Exception) -> str:
    text = str(error)
    if hosts and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return (f"{_who(cfg)} could not host the rendezvous store at {_where(cfg)}: the port is already in use "
                "(another job, or a process left from an earlier run); free it or choose another MASTER_PORT "
                "(sbpflow launch without --master-port picks a free one)")
    if hosts:
        return f"{_who(cfg)} could not host the rendezvous store at {_where(cfg)}: {_first_line(error)}"
    host = "torchrun's agent" if cfg.agent_store else "rank 0"
    return (f"{_who(cfg)} could not reach the rendezvous store at {_where(cfg)} within {cfg.init_timeout:g} s "
            f"(SBPFLOW_INIT_TIMEOUT): {host} hosts it; is it running, and are MASTER_ADDR and MASTER_PORT the "
            f"same on every process? ({_first_line(error)})")


def _wait_for_peers(store: dist.Store, cfg: Config) -> None:
    """Step 2: this rank's arrival, then every rank's (or the ranks still missing at the deadline, named)."""
    keys = [f"arrived/{r}" for r in range(cfg.world_size)]  # one key per rank: the missing ones can be named
    deadline = time.monotonic() + cfg.init_timeout
    _ask(cfg, lambda: store.set(keys[cfg.rank], "1"))
    while not _ask(cfg, lambda: store.check(keys)):
        if time.monotonic() > deadline:
            missing = [r for r in range(cfg.world_size) if not _arrived(store, cfg, r)]
            raise CommError(
                f"{_who(cfg)} waited {cfg.init_timeout:g} s (SBPFLOW_INIT_TIMEOUT) at the rendezvous store "
                f"{_where(cfg)} for ranks {missing}, which never arrived: they did not start, failed before "
                "joining, or were given another MASTER_ADDR, MASTER_PORT or WORLD_SIZE")
        time.sleep(POLL_S)


def _arrived(store: dist.Store, cfg: Config, rank: int) -> bool:
    return _ask(cfg, lambda: store.check([f"arrived/{rank}"]))


def _ask(cfg: Config, call: Callable[[], T]) -> T:
    """A store call; a lost store (its host ended) is a CommError that says so."""
    try:
        return call()
    except (RuntimeError, ValueError) as e:
        raise CommError(f"{_who(cfg)} lost the rendezvous store at {_where(cfg)} while waiting for its peers "
                        f"(the process hosting it ended?): {_first_line(e)}") from e
