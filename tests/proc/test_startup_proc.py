"""Start-up failures say what failed, within SBPFLOW_INIT_TIMEOUT, instead of a collective's timeout later.

Each case starts one real process with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) that cannot complete start-up: the port is taken, a peer never comes, or nobody hosts the
store. The process must fail in seconds with a CommError naming the address, port, rank and world size.
"""

from __future__ import annotations

import socket
import time

import pytest
from procrun import PYTHON, free_port, run_command

from sbpflow.distributed import Config
from sbpflow.errors import SbpflowError

START = "import sbpflow; sbpflow.distributed.init(); print('joined')"
INIT_TIMEOUT = 3.0


def _start(rank: int, world: int, port: int) -> tuple[str, float]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "SBPFLOW_INIT_TIMEOUT": str(INIT_TIMEOUT)}
    start = time.monotonic()
    result = run_command([PYTHON, "-c", START], env=env, timeout=90.0)
    assert result.returncode != 0 and "joined" not in result.stdout, result.report()
    return result.stderr, time.monotonic() - start


def test_a_taken_port_is_named_at_once() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err, _ = _start(0, 2, port)
    assert (f"CommError: rank 0 (world size 2) could not host the rendezvous store at 127.0.0.1:{port}: the port "
            "is already in use") in err, err


def test_a_peer_that_never_comes_is_named_after_the_init_timeout() -> None:
    err, seconds = _start(0, 3, free_port())
    assert (f"rank 0 (world size 3) waited {INIT_TIMEOUT:g} s (SBPFLOW_INIT_TIMEOUT) at the rendezvous store "
            "127.0.0.1:") in err and "for ranks [1, 2], which never arrived" in err, err
    assert seconds < 60, seconds  # the start-up bound, not SBPFLOW_TIMEOUT's 300 s


def test_a_store_nobody_hosts_is_named() -> None:
    port = free_port()
    err, seconds = _start(1, 2, port)
    assert (f"rank 1 (world size 2) could not reach the rendezvous store at 127.0.0.1:{port} within "
            f"{INIT_TIMEOUT:g} s (SBPFLOW_INIT_TIMEOUT): rank 0 hosts it") in err, err
    assert seconds < 60, seconds


def test_the_start_up_bound_is_read_from_its_variable() -> None:
    assert Config.from_env({}).init_timeout == 120.0
    assert Config.from_env({"SBPFLOW_INIT_TIMEOUT": "4.5"}).init_timeout == 4.5
    with pytest.raises(SbpflowError, match="SBPFLOW_INIT_TIMEOUT must be a positive number of seconds"):
        Config.from_env({"SBPFLOW_INIT_TIMEOUT": "0"})
