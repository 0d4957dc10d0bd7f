"""graph.select's compute prices: attention's FLOPs on local shards (what makes a split of heads or queries pay off)."""

from __future__ import annotations

from sbpflow.graph.select import flops

Q, K = (2, 4, 8, 16), (2, 4, 12, 16)  # (batch, heads, T queries, d), (batch, heads, S keys, d)


def test_attention_flops_count_both_products_over_queries_times_keys() -> None:
    """q k^T and p v each take T x S x d multiply-adds per head: 2 FLOPs each, so 4 T S d; the keys' length S
    comes from k and the queries' count from q (cross-attention tells them apart)."""
    out = 2 * 4 * 8 * 16
    assert flops("scaled_dot_product_attention", [Q, K, K], out) == 4 * (2 * 4 * 8 * 16) * 12
    assert flops("scaled_dot_product_attention", [K, Q, Q], out) == 4 * (2 * 4 * 12 * 16) * 8


def test_unbatched_attention_is_priced_too() -> None:
    """(T, d) queries over (S, d) keys: torch's attention takes them without batch or head dims."""
    assert flops("scaled_dot_product_attention", [(8, 16), (12, 16), (12, 16)], 8 * 16) == 4 * 8 * 16 * 12


def test_attention_backward_costs_two_and_a_half_forwards() -> None:
    """sdpa_backward's inputs are (dy, q, k, v): it recomputes the scores and takes both products' gradients."""
    forward = 4 * (2 * 4 * 8 * 16) * 12
    assert flops("sdpa_backward", [Q, Q, K, K], 0) == 2 * forward + forward // 2
    assert flops("sdpa_backward", [(8, 16), (8, 16), (12, 16), (12, 16)], 0) == 10 * 8 * 16 * 12


def test_a_shard_pays_for_its_share() -> None:
    """Half the heads on a rank: half the FLOPs. A vector (no (T, d) matrix) has none."""
    half = (2, 2, 8, 16), (2, 2, 12, 16)
    assert flops("scaled_dot_product_attention", [half[0], half[1], half[1]], 0) * 2 == \
        flops("scaled_dot_product_attention", [Q, K, K], 0)
    assert flops("scaled_dot_product_attention", [(16,), (16,), (16,)], 0) == 0
