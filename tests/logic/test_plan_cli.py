"""``sbpflow plan``: the explanation, ``--json`` validated against its schema, fixed plans, and errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sbpflow.autoparallel import PROFILES, Cluster, TransformerSpec, search
from sbpflow.autoparallel.explain import PLAN_SCHEMA
from sbpflow.cli import main
from sbpflow.errors import PlanError

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


def test_hardware_and_model_tflops_are_both_reported_and_labelled(capsys):
    # Megatron counted full recompute: for its plan the hardware figure is its count, the model figure 3/4 of blocks
    _, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--json")
    full = json.loads(out)
    assert full["tflops_per_device"] > full["model_tflops_per_device"] > 0.74 * full["tflops_per_device"]
    _, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--recompute", "none",
                      "--json")
    none = json.loads(out)
    jsonschema.validate(none, PLAN_SCHEMA)
    assert none["tflops_per_device"] == none["model_tflops_per_device"]  # nothing rerun: every FLOP is the model's
    _, text, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1")
    assert "hardware (the FLOPs this plan executes, recompute=full included)" in text
    assert "model (forward and backward alone)" in text and "attention scores stored" in text


LLAMA_70B = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
CLUSTER = ["--batch", "512", "--devices", "256", "--device", "h100-80gb"]


def test_hf_config_plans_a_llama_with_its_real_parameter_count(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    code = main(["plan", "--hf-config", str(config), *CLUSTER, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    jsonschema.validate(data, PLAN_SCHEMA)
    assert data["model"]["parameters"] == 70_553_706_496 and data["model"]["kv_heads"] == 8
    assert data["model"]["mlp"] == "swiglu" and data["model"]["tied"] is False
    assert data["tp"] * data["pp"] * data["dp"] == 256 and data["fits"]


def test_same_llama_by_flags_and_by_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    fixed = ["--tp", "8", "--pp", "4", "--dp", "8", "--micro-batch", "1", "--json"]
    assert main(["plan", "--hf-config", str(config), *CLUSTER, *fixed]) == 0
    by_config = json.loads(capsys.readouterr()[0])
    flags = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--seq", "8192", "--vocab", "128256",
             "--ffn-hidden", "28672", "--kv-heads", "8", "--mlp", "swiglu", "--norm", "rmsnorm", "--position",
             "rope", "--no-bias", "--untied", "--attention", "flash"]
    assert main(["plan", *flags, *CLUSTER, *fixed]) == 0
    assert json.loads(capsys.readouterr()[0]) == by_config


def test_an_unpadded_vocabulary_no_longer_forces_tp1(capsys):
    flags = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "50257",
             "--batch", "64", "--devices", "8", "--device", "a100-80gb", "--tp", "4", "--json"]
    assert main(["plan", *flags]) == 0
    data = json.loads(capsys.readouterr()[0])
    assert data["tp"] == 4 and data["model"]["padded_vocab"] == 50688  # a multiple of 128 · 4


def test_plan_errors_read_as_words(capsys, tmp_path):
    code, _, err = _plan(capsys, "--tp", "7")
    assert code == 2 and "TransformerSpec(" not in err and "Fixed(" not in err
    assert "96 layers, hidden 12288, 96 heads" in err and "with tp=7 fixed" in err
    mixtral = tmp_path / "mixtral.json"
    mixtral.write_text(json.dumps({**LLAMA_70B, "model_type": "mixtral", "num_local_experts": 8}))
    assert main(["plan", "--hf-config", str(mixtral), *CLUSTER]) == 2
    assert "mixture-of-experts" in capsys.readouterr()[1]
    assert main(["plan", "--layers", "4", *CLUSTER]) == 2
    assert "needs the model's sizes: --hidden, --heads, --seq, --vocab" in capsys.readouterr()[1]
    code = main(["plan", "--hf-config", str(tmp_path / "missing.json"), *CLUSTER])
    assert code == 2 and "cannot read a JSON config" in capsys.readouterr()[1]


def test_no_plan_in_memory_names_where_the_bytes_go():
    spec = TransformerSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    with pytest.raises(PlanError, match=r"no plan of 96 layers.* fits in memory: the smallest, .* needs .* GB per "
                                        r"device \(weights .*, activations .* GB\)"):
        search(spec, Cluster(8, PROFILES["a100-40gb"], 8), 64)


def test_json_carries_stages_and_parameter_sbps_as_the_graph_planner_does(capsys):
    """The sizes planner's ``--json`` has the graph planner's ``stages`` (modules per stage, cut as
    ``stage_layers``) and ``sbp`` (per parameter, on the stage's (data, tensor) mesh): Megatron's block on tp 8."""
    _, out, _ = _plan(capsys, "--tp", "8", "--pp", "16", "--dp", "8", "--micro-batch", "1", "--json")
    data = json.loads(out)
    jsonschema.validate(data, PLAN_SCHEMA)
    stages = data["stages"]
    assert [sum(m.startswith("layers.") for m in s) for s in stages] == data["stage_layers"]
    blocks = [m for s in stages for m in s if m.startswith("layers.")]
    assert blocks == [f"layers.{i}" for i in range(96)]  # every block once, in order
    assert stages[0][0] == "embedding" and stages[-1][-2:] == ["final_norm", "output"]  # tied: a copy, pp > 1
    sbp = data["sbp"]
    assert (sbp["layers.*.qkv.weight"], sbp["layers.*.proj.weight"]) == ("(B, S(0))", "(B, S(1))")
    assert (sbp["layers.*.fc1.weight"], sbp["layers.*.fc2.weight"]) == ("(B, S(0))", "(B, S(1))")
    assert (sbp["layers.*.qkv.bias"], sbp["layers.*.fc2.bias"], sbp["layers.*.ln1.weight"]) == ("(B, S(0))", "(B, B)",
                                                                                               "(B, B)")
    assert sbp["embedding.word.weight"] == "(B, S(0))" and "output.weight" not in sbp  # tied


def test_json_stages_of_an_interleaved_untied_zero3_plan(capsys):
    code = main(["plan", "--layers", "8", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "1024",
                 "--batch", "16", "--devices", "8", "--device", "h100-80gb", "--tp", "1", "--pp", "2", "--dp", "4",
                 "--micro-batch", "1", "--virtual", "2", "--zero", "3", "--untied", "--json"])
    data = json.loads(capsys.readouterr()[0])
    jsonschema.validate(data, PLAN_SCHEMA)
    assert code == 0 and [len([m for m in s if m.startswith("layers.")]) for s in data["stages"]] == [2, 2, 2, 2]
    assert data["stages"][-1][-2:] == ["final_norm", "output"]
    assert data["sbp"]["output.weight"] == data["sbp"]["layers.*.qkv.weight"] == "(S(0), B)"  # ZeRO-3, tp 1
