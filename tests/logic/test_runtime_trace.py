"""Timeline files (runtime.trace): readable when a job died before closing them, merged with one lane group per rank."""

from __future__ import annotations

import json
from pathlib import Path

from sbpflow.runtime.trace import TraceWriter, load, merge, trace_path


def write(path: Path, pid: int, close: bool) -> None:
    w = TraceWriter(path, pid=pid)
    w.span("cpu:0/compute", "#1 compute relu", "relu", micro=0, start=1.0, end=1.25, nbytes=64)
    w.span("cpu/comm:0,1", "#2 boxing all_reduce", "boxing", micro=0, start=1.1, end=1.3, nbytes=32)
    w.flush()
    if close:
        w.close()


def test_an_unclosed_file_still_loads_and_files_merge_with_distinct_pids(tmp_path: Path) -> None:
    write(tmp_path / "a.json", 0, close=True)
    write(tmp_path / "b.json", 0, close=False)  # a process that died before close(): no closing bracket
    json.loads((tmp_path / "a.json").read_text())  # a closed file is strict JSON
    assert [e["args"]["micro_batch"] for e in load(tmp_path / "b.json") if e["ph"] == "X"] == [0, 0]
    assert merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "m.json")) == 4
    merged = load(tmp_path / "m.json")
    assert sorted({e["pid"] for e in merged}) == [0, 1]
    span = next(e for e in merged if e["ph"] == "X")
    assert (span["ts"], span["dur"]) == (1e6, 0.25e6)


def test_paths_per_rank_and_per_runtime(tmp_path: Path) -> None:
    base = str(tmp_path / "t.json")
    assert trace_path(base, 3, 1) == base
    assert trace_path(base, 3, 4) == str(tmp_path / "t.rank3.json")
    writers = [TraceWriter(base, pid=0) for _ in range(3)]  # e.g. a training and two evaluation graphs
    assert [w.path.name for w in writers] == ["t.json", "t.2.json", "t.3.json"]
    writers[0].close()
    assert TraceWriter(base, pid=0).path.name == "t.json"  # free again once its writer closed
