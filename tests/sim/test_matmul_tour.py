"""The matmul tour (``sbpflow demo`` runs it first): three strategies, each checked against one device."""

from __future__ import annotations

import pytest

import sbpflow
from sbpflow.demo import matmul_tour


def test_tour_runs_checks_and_reports_layouts_and_plans() -> None:
    lines: list[str] = []
    result = matmul_tour.run(print_fn=lines.append)
    assert result["data_parallel"]["sbp"] == "(S(0))" and result["data_parallel"]["shape"] == (4, 8)
    assert result["model_parallel"]["sbp"] == "(S(1))" and result["model_parallel"]["shape"] == (4, 8)
    # Data and model parallel matmuls need no communication at all.
    assert result["data_parallel"]["collectives"] == {} and result["model_parallel"]["collectives"] == {}
    pipe = result["pipeline"]
    assert pipe["shape"] == (4, 3) and pipe["placement"] == "cpu:[2, 3]"
    assert pipe["collectives"] == {"send_recv": 1}  # stage 0's output crosses once, nothing else moves
    assert "send_recv(pairwise)" in pipe["plans"][0] and "cpu:[0, 1] (B) -> cpu:[2, 3] (B)" in pipe["plans"][0]
    text = "\n".join(lines)
    for name in ("data parallel", "model parallel", "two-stage pipeline"):
        assert name in text
    assert "all_gather" in text  # the plan .numpy() runs for the split outputs


def test_tour_raises_when_a_result_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A wrong single-device reference must make the tour fail loudly, not print a wrong table.
    original = matmul_tour._reference

    def skewed():  # type: ignore[no-untyped-def]
        x, w0, w1 = original()
        return x + 1.0, w0, w1

    monkeypatch.setattr(matmul_tour, "_reference", skewed)
    with pytest.raises(sbpflow.SbpflowError, match="data parallel.*differs from the single-device product"):
        matmul_tour.run(print_fn=lambda line: None)
