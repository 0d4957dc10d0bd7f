"""Cost formulas: compute by roofline, collectives by α-β, memory per rank under ZeRO.

Collectives follow the boxing planner's transition table (``boxing/plan.py``) and price a group with its
:class:`~sbpflow.boxing.plan.CostModel`: a group whose ranks span more than one node pays the inter-node
link. For a group of ``p`` ranks and a logical tensor of ``n`` bytes:

    all_reduce       2(p-1) α + 2(p-1)/p · n β
    all_gather       (p-1) α  +  (p-1)/p · n β      (n: the gathered tensor)
    reduce_scatter   (p-1) α  +  (p-1)/p · n β      (n: the tensor before scattering)
    all_to_all       (p-1) α  +  (p-1)/p² · n β
    send_recv        α + n β

>>> from sbpflow.boxing.plan import CostModel, LinkCost
>>> model = CostModel(links=((("cuda", "intra"), LinkCost(1e-5, 1e-9)),), ranks_per_node=8)
>>> round(collective_time("all_reduce", range(4), 1e6, model, "cuda") * 1e6, 1)  # 6α + 1.5 MB β
1560.0
"""

from __future__ import annotations

from collections.abc import Iterable

from ..boxing.plan import CostModel
from ..errors import SbpflowError
from .profiles import DeviceProfile

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# Bytes per parameter under mixed-precision Adam (Rajbhandari et al., ZeRO, SC'20, §3.1): fp16 weights and
# gradients, and K = 12 bytes of fp32 master weights, momentum and variance.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12
ZERO_STAGES = (0, 1, 2, 3)


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of (m, k) by (k, n): one multiply and one add per term.

    >>> matmul_flops(2, 3, 4)
    48.0
    """
    return 2.0 * batch * m * n * k


def roofline(flops: float, nbytes: float, profile: DeviceProfile, matmul: bool = True) -> float:
    """Seconds for one kernel: the slower of its arithmetic and its memory traffic, plus the launch floor.

    GEMMs run at ``peak · η_matmul``; other kernels (no tensor cores) are taken as memory-bound, so only their
    bytes count.
    """
    compute = flops / profile.matmul_flops if matmul else 0.0
    memory = nbytes / profile.memory_throughput
    return max(compute, memory) + profile.launch_s


def collective_time(kind: str, ranks: Iterable[int], nbytes: float, model: CostModel, device_type: str) -> float:
    """The α-β time of one collective over ``ranks`` (see the table above); a group of one rank is free."""
    group = tuple(ranks)
    p = len(group)
    if kind not in COLLECTIVE_KINDS:
        raise SbpflowError(f"collective kind must be one of {COLLECTIVE_KINDS}, but got {kind!r}")
    if p <= 1 or nbytes == 0:
        return 0.0
    link = model.link(device_type, group)
    if kind == "all_reduce":
        return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta
    if kind == "send_recv":
        return link.alpha + nbytes * link.beta
    if kind == "all_to_all":
        return (p - 1) * link.alpha + (p - 1) / p**2 * nbytes * link.beta
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


def model_state_bytes(params: float, dp: int, zero: int) -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state for ``params`` parameters replicated over ``dp``
    data-parallel ranks, under ZeRO stage ``zero`` (Rajbhandari et al. 2020, Fig. 1):

        stage 0: (2 + 2 + 12) Ψ        stage 2: 2Ψ + (2 + 12) Ψ / N_d
        stage 1: (2 + 2) Ψ + 12Ψ / N_d stage 3: (2 + 2 + 12) Ψ / N_d

    >>> model_state_bytes(7.5e9, 64, 1)["optimizer"] / 1e9   # the paper's 7.5B model on 64 GPUs
    1.40625
    """
    if zero not in ZERO_STAGES:
        raise SbpflowError(f"ZeRO stage must be one of {ZERO_STAGES}, but got {zero!r}")
    shard = 1 / dp
    return {
        "weights": params * WEIGHT_BYTES * (shard if zero >= 3 else 1),
        "gradients": params * GRAD_BYTES * (shard if zero >= 2 else 1),
        "optimizer": params * OPTIMIZER_BYTES * (shard if zero >= 1 else 1),
    }
