"""Tier-3 runner: a Python callable on N real processes, one global rank each (gloo on 127.0.0.1).

The hook for multi-process tests is :func:`run_ranks`: it runs a module-level
function of a test file in ``nprocs`` fresh interpreters with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port), so sbpflow starts its torch.distributed
backend by itself, and returns what each rank returned:

    def train(steps):                       # module level, in any test file
        ...
        return loss_history                  # anything picklable

    per_rank = run_ranks(train, 2, args=(5,))   # [rank 0's result, rank 1's result]

Every job ends by itself: a process that outlives ``timeout`` seconds is
killed with its whole process group, and the error then lists every rank's
exit code and output. :func:`spawn` returns the full :class:`Job` (exit codes,
stdout, stderr, results, errors) for tests that expect failures, and
:func:`run_command` runs a command line (``sbpflow launch``, ``python script.py``)
under the same timeout rules.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent
PYTHON = sys.executable


@dataclass
class RankOutcome:
    """What one process did."""

    rank: int
    returncode: int | None  # None: still running at the timeout, then killed
    stdout: str
    stderr: str
    result: Any = None  # the callable's return value
    error: str | None = None  # "Type: message" when the callable raised


@dataclass
class Job:
    """Every rank's outcome, the wall time, and whether the runner had to kill anything."""

    ranks: list[RankOutcome]
    elapsed: float
    timed_out: bool
    env: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[int]:
        return [o.rank for o in self.ranks if o.returncode != 0]

    def report(self) -> str:
        """Every rank's exit code, error and output, for assertion messages."""
        lines = [f"job of {len(self.ranks)} processes, {self.elapsed:.1f} s"
                 f"{' (timed out: killed the survivors)' if self.timed_out else ''}; failed ranks: {self.failed}"]
        for o in self.ranks:
            lines.append(f"--- rank {o.rank}: exit code {o.returncode}" + (f", {o.error}" if o.error else ""))
            lines += [f"  out| {line}" for line in o.stdout.splitlines()[-40:]]
            lines += [f"  err| {line}" for line in o.stderr.splitlines()[-40:]]
        return "\n".join(lines)


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment, minus torchrun's variables, plus one thread per process and gloo on loopback."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    env.update(extra or {})
    return env


def spawn(fn: Callable[..., Any], nprocs: int, *, args: Sequence[Any] = (), env: dict[str, str] | None = None,
          timeout: float = 90.0) -> Job:
    """Runs ``fn(*args)`` in ``nprocs`` processes with ranks 0..nprocs-1; never raises for a failed rank."""
    file = inspect.getsourcefile(fn)
    if file is None or "<" in fn.__qualname__:
        raise ValueError(f"run_ranks needs a module-level function of a file, but got {fn!r}")
    with tempfile.TemporaryDirectory(prefix="sbpflow-proc-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"file": file, "qualname": fn.__qualname__, "args": tuple(args),
                                       "sys_path": [str(HERE), str(TESTS)]}))
        common = base_env(env)
        common.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
        procs = []
        start = time.monotonic()
        for rank in range(nprocs):
            penv = dict(common, RANK=str(rank), LOCAL_RANK=str(rank))
            out = open(Path(tmp) / f"out{rank}.txt", "w")  # noqa: SIM115 - closed after the wait below
            err = open(Path(tmp) / f"err{rank}.txt", "w")  # noqa: SIM115
            cmd = [PYTHON, str(Path(__file__).resolve()), str(spec), tmp]
            procs.append((subprocess.Popen(cmd, env=penv, stdout=out, stderr=err, cwd=str(REPO),
                                           start_new_session=True), out, err))
        timed_out = _wait_all([p for p, _, _ in procs], start + timeout)
        elapsed = time.monotonic() - start
        outcomes = []
        for rank, (p, out, err) in enumerate(procs):
            out.close()
            err.close()
            outcomes.append(_outcome(rank, p.returncode, Path(tmp)))
    return Job(outcomes, elapsed, timed_out, common)


def run_ranks(fn: Callable[..., Any], nprocs: int, *, args: Sequence[Any] = (), env: dict[str, str] | None = None,
              timeout: float = 90.0) -> list[Any]:
    """``fn(*args)`` on ``nprocs`` real processes; the per-rank return values, or AssertionError with all output."""
    job = spawn(fn, nprocs, args=args, env=env, timeout=timeout)
    if job.failed or job.timed_out:
        raise AssertionError(f"{fn.__qualname__} failed on ranks {job.failed}\n{job.report()}")
    return [o.result for o in job.ranks]


def _wait_all(procs: list[subprocess.Popen[bytes]], deadline: float) -> bool:
    """Waits for every process; at the deadline kills the survivors' process groups. True if it killed any."""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p.pid)
            for p in procs:
                p.wait()
            return True
        time.sleep(0.05)
    return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _outcome(rank: int, code: int | None, tmp: Path) -> RankOutcome:
    result_file = tmp / f"rank{rank}.pkl"
    payload = pickle.loads(result_file.read_bytes()) if result_file.exists() else {}
    return RankOutcome(rank, code, (tmp / f"out{rank}.txt").read_text(), (tmp / f"err{rank}.txt").read_text(),
                       payload.get("result"), payload.get("error"))


@dataclass
class CommandResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    elapsed: float

    def report(self) -> str:
        return f"exit code {self.returncode} after {self.elapsed:.1f} s\n--- stdout\n{self.stdout}\n--- stderr\n" \
               f"{self.stderr}"


def run_command(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 90.0) -> CommandResult:
    """Runs ``cmd`` in its own process group (stdout, stderr captured); kills the whole group at the timeout."""
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=str(REPO), start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        code = None
    return CommandResult(code, out, err, time.monotonic() - start)


# ----------------------------------------------------------------------------- the worker side


def _worker(spec_path: str, out_dir: str) -> None:
    """Runs in each spawned process: load the target, call it, pickle what happened, leave at once."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    sys.path[:0] = spec["sys_path"]
    rank = int(os.environ["RANK"])
    code, payload = 0, {}
    try:
        fn = _load(spec["file"], spec["qualname"])
        payload["result"] = fn(*spec["args"])
    except SystemExit as e:  # a rank that exits on purpose
        code = e.code if isinstance(e.code, int) else 1
        payload["error"] = f"SystemExit: {e.code}"
    except BaseException as e:  # noqa: BLE001 - report whatever the rank raised
        code = 1
        payload["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        print(f"procrun: rank {rank} failed with {type(e).__name__}: {e}", file=sys.stderr)
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(payload))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group whose peers are gone can block there.
    os._exit(code)


def _load(file: str, qualname: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location("sbpflow_proc_target", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sbpflow_proc_target"] = module
    spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
