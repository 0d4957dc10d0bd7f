"""The cost model's formulas against hand-computed cases: FLOPs, roofline, ring collectives, ZeRO memory,
activations under recompute, and the α-β times agreeing with the boxing planner's own."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import sbpflow
from sbpflow.autoparallel import (
    PROFILES,
    DeviceProfile,
    collective_time,
    get_profile,
    matmul_flops,
    model_state_bytes,
    roofline,
    save_profile,
)
from sbpflow.autoparallel.block_sbp import MEGATRON_CHOICES, evaluate_block
from sbpflow.autoparallel.profiles import with_efficiency
from sbpflow.autoparallel.transformer import TransformerSpec
from sbpflow.boxing.plan import Layout, plan, target_factors
from sbpflow.errors import SbpflowError
from sbpflow.sbp import broadcast, partial_sum, split

# A round-number device: 100 TFLOP/s at η 0.5, 1 TB/s at η 0.5, 10 us launch floor, links 100 / 10 GB/s.
TOY = DeviceProfile(name="toy", device_type="cpu", peak_flops=100e12, mem_bandwidth=1e12, memory_bytes=16e9,
                    intra_bandwidth=100e9, inter_bandwidth=10e9, intra_alpha=1e-5, inter_alpha=1e-4,
                    eta_matmul=0.5, eta_memory=0.5, eta_intra=1.0, eta_inter=1.0, launch_s=1e-5, gpus_per_node=4,
                    reserved_bytes=0.0)


def test_matmul_flops_by_hand():
    # (128 x 64) @ (64 x 256): 128 * 256 outputs, each 64 multiplies and 64 adds
    assert matmul_flops(128, 256, 64) == 128 * 256 * 64 * 2 == 4_194_304
    assert matmul_flops(4, 4, 4, batch=3) == 3 * 128


def test_roofline_compute_bound_and_memory_bound():
    # 1e12 FLOPs at 50 TFLOP/s sustained = 20 ms; its 1 GB at 0.5 TB/s = 2 ms: compute bound
    assert roofline(1e12, 1e9, TOY) == pytest.approx(20e-3 + 1e-5)
    # an elementwise kernel over 5 GB: 10 ms of memory traffic, FLOPs ignored
    assert roofline(1e15, 5e9, TOY, matmul=False) == pytest.approx(10e-3 + 1e-5)
    # a tiny kernel costs its launch floor
    assert roofline(0.0, 0.0, TOY) == pytest.approx(1e-5)


def test_ring_all_reduce_by_hand():
    model = TOY.cost_model()
    n = 64e6  # 64 MB over 4 ranks of one node: 2*3 rounds of 10 us, 2*3/4 * 64 MB at 100 GB/s
    assert collective_time("all_reduce", range(4), n, model, "cpu") == pytest.approx(6 * 1e-5 + 1.5 * n / 100e9)
    # 8 ranks over two nodes of 4: one rank per node on the inter-node link prices every round
    assert collective_time("all_reduce", (0, 4), n, model, "cpu") == pytest.approx(2 * 1e-4 + n / 10e9)
    # all 4 ranks of each node: reduce-scatter inside, 4 all-reduces of n/4 across at once, all-gather inside
    inside = 3 * 1e-5 + 0.75 * n / 100e9
    assert collective_time("all_reduce", range(8), n, model, "cpu") == pytest.approx(2 * inside + 2e-4 + n / 4 / 10e9)
    assert collective_time("all_gather", range(4), n, model, "cpu") == pytest.approx(3 * 1e-5 + 0.75 * n / 100e9)
    assert collective_time("send_recv", (0, 4), n, model, "cpu") == pytest.approx(1e-4 + n / 10e9)
    assert collective_time("all_reduce", (3,), n, model, "cpu") == 0.0


def test_collective_times_agree_with_the_boxing_planner():
    """The analytic formulas and the boxing planner price the same transitions the same (one α-β model)."""
    model = TOY.cost_model()
    placement = sbpflow.placement("cpu", [0, 1, 2, 3])
    shape, dtype = (1024, 512), torch.float16
    nbytes = 1024 * 512 * 2
    cases = [(partial_sum, broadcast, "all_reduce"), (split(0), broadcast, "all_gather"),
             (partial_sum, split(0), "reduce_scatter")]
    with target_factors(()):
        for src, dst, kind in cases:
            boxed = plan(shape, dtype, Layout(placement, (src,)), Layout(placement, (dst,)), model)
            assert boxed.collectives() == [kind]
            assert collective_time(kind, range(4), nbytes, model, "cpu") == pytest.approx(boxed.time)


def test_zero_memory_matches_the_paper():
    """ZeRO (Rajbhandari et al. 2020), Figure 1: a 7.5B model on 64 GPUs with Adam in mixed precision."""
    gb = {stage: sum(model_state_bytes(7.5e9, 64, stage).values()) / 1e9 for stage in range(4)}
    assert gb[0] == pytest.approx(120.0)
    assert gb[1] == pytest.approx(30 + 12 * 7.5 / 64)  # 31.4
    assert gb[2] == pytest.approx(15 + 14 * 7.5 / 64)  # the paper rounds to 16.6
    assert gb[3] == pytest.approx(1.875)
    with pytest.raises(SbpflowError, match="ZeRO stage"):
        model_state_bytes(1e9, 8, 4)


def _kept(spec, micro_batch, tp, recompute):
    return evaluate_block(spec, micro_batch, tp, TOY, MEGATRON_CHOICES, recompute).kept


def test_activations_under_recompute_by_hand():
    """Korthikanti et al.: 34 sbh + 5 a s² b without parallelism; selective keeps 34 sbh; full keeps 2 sbh; under
    Megatron's tensor parallelism 10 sbh stay whole and the rest is split."""
    spec = TransformerSpec(layers=2, hidden=64, heads=4, seq=32, vocab=100)
    sbh = 32 * 2 * 64
    assert _kept(spec, 2, 1, "none") == 34 * sbh + 5 * 4 * 32 * 32 * 2
    assert _kept(spec, 2, 1, "selective") == 34 * sbh
    assert _kept(spec, 2, 4, "selective") == (10 + 6) * sbh
    assert _kept(spec, 2, 4, "none") == (10 + 6) * sbh + 5 * 4 * 32 * 32 * 2 / 4
    assert _kept(spec, 2, 4, "full") == 2 * sbh
    with pytest.raises(SbpflowError, match="recompute"):
        _kept(spec, 2, 1, "some")


def test_block_kernels_by_hand():
    """A block's forward on one rank under Megatron's choice, kernel by kernel on TOY (50 TFLOP/s GEMMs, 500 GB/s
    elementwise, 10 us per kernel): h = 1024, 8 heads of 128, b·s = 2 · 512 tokens, t = 2."""
    spec = TransformerSpec(layers=1, hidden=1024, heads=8, seq=512, vocab=100)
    n, h, s, t, units = 1024, 1024, 512, 2, 2 * 8 // 2  # units: (sequence, head) pairs on a rank

    def kernel(flops, nbytes):
        return max(flops / 50e12, nbytes / 500e9) + 1e-5

    gemms = [kernel(2 * n * h * 3 * h / t, 2 * (n * h + 3 * h * h / t + 3 * n * h / t)),  # qkv, column
             kernel(2 * s * s * 128 * units, 2 * units * (2 * s * 128 + s * s)),  # scores
             kernel(2 * s * s * 128 * units, 2 * units * (s * s + 2 * s * 128)),  # context
             kernel(2 * n * h * h / t, 2 * (n * h / t + h * h / t + n * h)),  # proj, row
             kernel(2 * n * h * 4 * h / t, 2 * (n * h + 4 * h * h / t + 4 * n * h / t)),  # fc1
             kernel(2 * n * 4 * h * h / t, 2 * (4 * n * h / t + 4 * h * h / t + n * h))]  # fc2
    scores = units * s * s
    elementwise = [kernel(0, 4 * scores), kernel(0, 5 * scores),  # softmax, dropout (+ its mask)
                   kernel(0, 4 * n * h), kernel(0, 4 * n * h),  # LayerNorms
                   kernel(0, 7 * n * h), kernel(0, 7 * n * h),  # bias, dropout, residual add
                   kernel(0, 4 * n * 4 * h / t)]  # GeLU
    block = evaluate_block(spec, 2, t, TOY, MEGATRON_CHOICES, "selective")
    assert block.forward_s == pytest.approx(sum(gemms) + sum(elementwise))
    assert block.attention_s == pytest.approx(gemms[1] + gemms[2] + elementwise[0] + elementwise[1])
    assert block.recompute_s == block.attention_s
    assert block.params == (12 * h * h + 7 * h) / t + 6 * h


def test_megatron_flops_and_gpt3_parameters():
    gpt3 = TransformerSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    assert gpt3.params / 1e9 == pytest.approx(174.6, abs=0.1)  # "175B"
    by_hand = 96 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))
    assert gpt3.hardware_flops(1536, "full") == pytest.approx(by_hand)  # Megatron's count: full recompute
    forward_backward = 72 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288)) + 6 * 1536 * 2048 * 12288 * 51200
    assert gpt3.model_flops(1536) == pytest.approx(forward_backward)
    assert gpt3.hardware_flops(1536, "none") == gpt3.model_flops(1536)
    attention_rerun = 4 * 1536 * 2048**2 * 12288 * 96  # Q·Kᵀ and probs·V once more per layer
    assert gpt3.hardware_flops(1536, "selective") == pytest.approx(gpt3.model_flops(1536) + attention_rerun)


LLAMA3_70B = TransformerSpec(layers=80, hidden=8192, heads=64, seq=8192, vocab=128256, ffn_hidden=28672, kv_heads=8,
                             mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied=False)


@pytest.mark.parametrize(("spec", "published"), [
    (LLAMA3_70B, 70_553_706_496),  # transformers' LlamaForCausalLM(config of Llama-3-70B).num_parameters()
    (TransformerSpec(layers=126, hidden=16384, heads=128, seq=8192, vocab=128256, ffn_hidden=53248, kv_heads=8,
                     mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied=False), 405_853_388_800),
    (TransformerSpec(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, ffn_hidden=14336, kv_heads=8,
                     mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied=False), 8_030_261_248),
])
def test_llama_shapes_count_their_published_parameters(spec, published):
    assert spec.params == published


def test_llama_flops_count_gate_up_down_and_grouped_kv():
    h, f, kv, s, layers, v = 8192, 28672, 1024, 8192, 80, 128256
    per_token = 2 * (h * (h + 2 * kv) + h * h + 3 * h * f) + 4 * s * h  # forward: matmuls and core attention
    assert LLAMA3_70B.model_flops(2) == pytest.approx(2 * s * (3 * layers * per_token + 6 * h * v))
    # Kaplan et al.'s 6·N + 12·l·s·h per token, N the matmul weights (no input embedding, no norms)
    weights = LLAMA3_70B.params - h * v - (2 * layers + 1) * h
    assert LLAMA3_70B.model_flops(1) == pytest.approx(s * (6 * weights + 12 * layers * s * h))


def test_vocab_is_padded_as_megatron_pads_it():
    spec = TransformerSpec(layers=2, hidden=64, heads=8, seq=16, vocab=50257)
    assert [spec.padded_vocab(t) for t in (1, 2, 8)] == [50304, 50432, 51200]
    assert TransformerSpec(layers=2, hidden=64, heads=8, seq=16, vocab=50257, vocab_multiple=1).padded_vocab(8) == 50264


def test_shape_errors_say_what_is_wrong():
    with pytest.raises(SbpflowError, match="key/value heads must divide the attention heads.*kv_heads=3"):
        TransformerSpec(layers=2, hidden=64, heads=8, seq=16, vocab=64, kv_heads=3)
    with pytest.raises(SbpflowError, match="mlp is one of.*'relu'"):
        TransformerSpec(layers=2, hidden=64, heads=8, seq=16, vocab=64, mlp="relu")


def test_profiles_public_specs_and_files(tmp_path):
    assert PROFILES["h100-80gb"].peak_flops == 989e12 and PROFILES["a100-40gb"].memory_bytes == 40e9
    path = tmp_path / "p.json"
    save_profile(with_efficiency(TOY, eta_matmul=0.7), path)
    assert get_profile(str(path)) == replace(TOY, eta_matmul=0.7)
    path.write_text(json.dumps({**json.loads(path.read_text()), "eta_matmull": 0.5}))
    with pytest.raises(SbpflowError, match="eta_matmull"):
        get_profile(str(path))
    with pytest.raises(SbpflowError, match="built-in profile"):
        get_profile("v100")
    with pytest.raises(SbpflowError, match="eta_"):
        with_efficiency(TOY, peak_flops=1.0)


def test_block_shapes_follow_the_model():
    from sbpflow.autoparallel.block_sbp import KEPT, OPS, op_shapes
    from sbpflow.autoparallel.predict import min_block_params

    gpt = TransformerSpec(layers=2, hidden=64, heads=8, seq=16, vocab=128)
    assert op_shapes(gpt) == tuple((float(w), None if wt is None else tuple(map(float, wt)), float(KEPT[name]))
                                   for name, _, _, w, wt in OPS)  # a GPT's block is the table's
    h, f, kv, t = 64, 160, 2, 4
    llama = TransformerSpec(layers=2, hidden=h, heads=8, seq=16, vocab=128, ffn_hidden=f, kv_heads=kv, mlp="swiglu",
                            norm="rmsnorm", position="rope", bias=False, tied=False)
    qkv = h + 2 * kv * (h // 8)
    shapes = dict(zip([op[0] for op in OPS], op_shapes(llama), strict=True))
    assert shapes["qkv"][:2] == (qkv / h, (1.0, qkv / h)) and shapes["fc1"][1] == (1.0, 2 * f / h)
    assert shapes["gelu"][0] == f / h and shapes["fc2"][1] == (f / h, 1.0)
    block = evaluate_block(llama, 2, t, TOY, MEGATRON_CHOICES, "none")
    assert block.params == (h * qkv + h * h + 3 * h * f) / t + 2 * h  # weights split, the two RMSNorms whole
    assert block.params == min_block_params(llama, t)
    assert llama.layer_params == h * qkv + h * h + 3 * h * f + 2 * h


def test_a_group_with_several_ranks_per_node_crosses_nodes_on_every_rail():
    from sbpflow.autoparallel.cost import collective_time
    from sbpflow.boxing.plan import CostModel, LinkCost

    intra, inter = LinkCost(1e-6, 1 / 200e9), LinkCost(1e-5, 1 / 20e9)
    model = CostModel(links=((("cuda", "inter"), inter), (("cuda", "intra"), intra)), ranks_per_node=8)
    n, group = 1e9, tuple(range(32))  # 4 nodes of 8
    local_rs = 7 * intra.alpha + 7 / 8 * n * intra.beta
    across = 2 * 3 * inter.alpha + 2 * 3 / 4 * (n / 8) * inter.beta  # 8 all-reduces of n/8 at once, one per NIC
    assert collective_time("all_reduce", group, n, model, "cuda") == pytest.approx(2 * local_rs + across)
    assert collective_time("reduce_scatter", group, n, model, "cuda") == pytest.approx(local_rs + across / 2)
    flat = 2 * 3 * inter.alpha + 2 * 3 / 4 * n * inter.beta  # one rank per node: its own NIC carries everything
    assert collective_time("all_reduce", group[::8], n, model, "cuda") == pytest.approx(flat)
    assert collective_time("all_reduce", range(8), n, model, "cuda") == pytest.approx(2 * 7 * intra.alpha
                                                                                      + 2 * 7 / 8 * n * intra.beta)


def test_flash_attention_keeps_no_scores_and_runs_at_gemm_speed():
    unfused = TransformerSpec(layers=2, hidden=1024, heads=16, seq=4096, vocab=128)
    flash = replace(unfused, attention="flash")
    t = 2
    a, b = (evaluate_block(s, 1, t, TOY, MEGATRON_CHOICES, "none") for s in (unfused, flash))
    tokens, heads = 4096, 16
    assert a.kept - b.kept == pytest.approx((5.0 * 4096 - 4.0) * heads * tokens / t)  # the scores, less the LSE
    units, s, d = heads / t, 4096, 1024 // heads
    gemm = 2 * (2.0 * s * s * d) * units / TOY.matmul_flops + TOY.launch_s
    assert b.attention_s == pytest.approx(max(gemm - TOY.launch_s, 2 * units * 4 * s * d / TOY.memory_throughput)
                                          + TOY.launch_s)
    assert b.attention_s < a.attention_s
    with pytest.raises(SbpflowError, match="attention is one of"):
        replace(unfused, attention="paged")
