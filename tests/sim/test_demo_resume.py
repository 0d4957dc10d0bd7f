"""The demo's --checkpoint-every and --resume: a resumed run continues the uninterrupted one bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sbpflow.demo.train_gpt import main
from sbpflow.runtime.trace import load

TINY = ["--n-layer", "1", "--n-embd", "32", "--batch-size", "8", "--block-size", "16", "--lr", "1e-2",
        "--no-tour", "--sample-length", "8", "--steps", "6", "--checkpoint-every", "3"]


def _files(checkpoint: Path) -> dict[str, object]:
    return json.loads((checkpoint / "index.json").read_text())["files"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    out = tmp_path_factory.mktemp("full")
    return out, main(["--out", str(out), *TINY], print_fn=lambda _: None)["losses"]


def test_resume_continues_bit_for_bit(full_run: tuple[Path, list[float]], tmp_path: Path) -> None:
    out, losses = full_run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    lines: list[str] = []
    resumed = main(["--out", str(tmp_path), *TINY, "--resume", str(out / "checkpoints" / "step-00000003")],
                   print_fn=lines.append)
    assert resumed["losses"] == losses[3:]
    # the final checkpoints hold the same bytes: parameters, AdamW moments and steps, schedule, random stream
    assert _files(tmp_path / "checkpoints" / "step-00000006") == _files(out / "checkpoints" / "step-00000006")
    assert any(line.startswith("resumed from ") and line.endswith("step-00000003 at step 3") for line in lines)


def test_resume_under_another_strategy_and_from_a_folder(full_run: tuple[Path, list[float]], tmp_path: Path) -> None:
    out, losses = full_run
    args = ["--out", str(tmp_path), *TINY, "--steps", "8", "--devices", "2", "--strategy", "tp=2"]
    resumed = main([*args, "--resume", str(out / "checkpoints")], print_fn=lambda _: None)  # the newest: step 6
    assert len(resumed["losses"]) == 2
    again = main([*args, "--resume", str(out / "checkpoints" / "step-00000003")], print_fn=lambda _: None)
    np.testing.assert_allclose(again["losses"][:3], losses[3:], rtol=1e-4)  # resharded: same values, other sums


def test_resume_errors_end_the_demo_with_a_message(full_run: tuple[Path, list[float]], tmp_path: Path) -> None:
    out, _ = full_run
    with pytest.raises(SystemExit, match="is at step 6, and --steps is 6: nothing is left to train"):
        main(["--out", str(tmp_path), *TINY, "--resume", str(out / "checkpoints")])
    with pytest.raises(SystemExit, match="--resume .*: the checkpoint has no entry 'model/h.1.ln_1.weight'"):
        main(["--out", str(tmp_path), *TINY, "--n-layer", "2", "--resume", str(out / "checkpoints" / "step-00000003")])
    with pytest.raises(SystemExit, match="is not an sbpflow checkpoint: it has no index.json"):
        main(["--out", str(tmp_path), *TINY, "--resume", str(tmp_path)])


def test_compiled_steps_resume_bit_for_bit_too(tmp_path: Path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    losses = main(["--out", str(full), *TINY, "--graph"], print_fn=lambda _: None)["losses"]
    again = main(["--out", str(resumed), *TINY, "--graph", "--resume", str(full / "checkpoints" / "step-00000003")],
                 print_fn=lambda _: None)["losses"]
    assert again == losses[3:]
    assert _files(resumed / "checkpoints" / "step-00000006") == _files(full / "checkpoints" / "step-00000006")
    events = load(full / "timeline.json")  # the demo's loader feeds the compiled step: its lane is on the timeline
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sum(1 for e in events if e.get("ph") == "X" and lanes[e["tid"]] == "cpu/source:loader") == 6
    entries = json.loads((full / "checkpoints" / "step-00000003" / "index.json").read_text())["entries"]
    assert (entries["data/epoch"]["value"], entries["data/index"]["value"]) == (0, 3)  # the loader's position
