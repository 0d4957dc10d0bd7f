"""``sbpflow plan``: the explanation, ``--json`` validated against its schema, fixed plans, and errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sbpflow.autoparallel.explain import PLAN_SCHEMA
from sbpflow.cli import main

GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab", "51200",
        "--batch", "1536", "--devices", "1024", "--device", "a100-80gb"]


def _plan(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["plan", *GPT3, *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_of_a_search_matches_the_schema(capsys):
    code, out, _ = _plan(capsys, "--micro-batch", "1", "--json")
    assert code == 0
    data = json.loads(out)
    jsonschema.validate(data, PLAN_SCHEMA)
    assert data["tp"] * data["pp"] * data["dp"] == 1024 and data["micro_batch"] == 1
    assert data["search"]["candidates"] >= data["search"]["costed"] > 0
    assert len(data["runners_up"]) == 4
    assert sum(data["breakdown"].values()) == pytest.approx(data["step_time_s"])


def test_fully_given_plan_is_predicted_not_searched(capsys):
    code, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--json")
    data = json.loads(out)
    jsonschema.validate(data, PLAN_SCHEMA)
    assert code == 0 and data["search"] is None and data["runners_up"] == []
    assert (data["tp"], data["pp"], data["dp"], data["zero"], data["recompute"]) == (8, 16, 8, 0, "full")
    assert data["tflops_per_device"] == pytest.approx(140, rel=0.15)
    block = data["block"]  # the block ILP's choice that the prediction priced: Megatron's layers (memory is short)
    assert block["layout"] == "ilp" and block["method"] == "ilp" and block["megatron"]
    assert (block["choices"]["qkv"], block["choices"]["fc2"]) == ("column", "row")


def test_schema_rejects_a_block_without_its_choices(capsys):
    _, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--json")
    data = json.loads(out)
    del data["block"]["choices"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, PLAN_SCHEMA)


def test_schema_rejects_output_missing_a_field(capsys):
    _, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--json")
    data = json.loads(out)
    del data["breakdown"]["bubble"]
    with pytest.raises(jsonschema.ValidationError, match="bubble"):
        jsonschema.validate(data, PLAN_SCHEMA)


def test_explanation_names_components_runners_up_and_assumptions(capsys):
    code, out, _ = _plan(capsys, "--tp", "8", "--pp", "16")
    assert code == 0
    for word in ("compute", "recompute", "tp_comm", "pp_comm", "dp_comm", "bubble", "runners-up", "what this rests on",
                 "memory on the fullest device", "tp8 pp16 dp8"):
        assert word in out
    assert "searched" in out
    assert "the SBPs this prediction used (the block ILP's choice on the tp8 group" in out


def test_impossible_plan_is_an_error_not_a_traceback(capsys):
    code, _, err = _plan(capsys, "--tp", "7")
    assert code == 2 and "sbpflow plan:" in err and "tp=7" in err
    code, _, err = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "0")
    assert code == 2 and "--micro-batch must be at least 1" in err
