"""Cost formulas: compute by roofline, collectives by α-β, memory per rank under ZeRO.

Collectives follow the boxing planner's transition table (``boxing/plan.py``) and price a group with its
:class:`~sbpflow.boxing.plan.CostModel`: a group whose ranks span more than one node pays the inter-node
link. For a group of ``p`` ranks and a logical tensor of ``n`` bytes:

    all_reduce       2(p-1) α + 2(p-1)/p · n β
    all_gather       (p-1) α  +  (p-1)/p · n β      (n: the gathered tensor)
    reduce_scatter   (p-1) α  +  (p-1)/p · n β      (n: the tensor before scattering)
    all_to_all       (p-1) α  +  (p-1)/p² · n β
    send_recv        α + n β

A group of ``k`` nodes with ``r > 1`` of its ranks on each is priced as NCCL runs it over a node's ``r`` NICs
(one channel per rail): the bytes cross nodes in ``r`` parallel pieces. An all-reduce is a reduce-scatter
inside each node, ``r`` all-reduces of ``n / r`` bytes across the nodes at once, and an all-gather inside each
node; a reduce-scatter or an all-gather keeps its half of that.

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
MIXED_STATE = (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)  # bytes per parameter: weights, gradients, optimizer
ZERO_STAGES = (0, 1, 2, 3)


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of (m, k) by (k, n): one multiply and one add per term.

    >>> matmul_flops(2, 3, 4)
    48.0
    """
    return 2.0 * batch * m * n * k


def roofline(flops: float, nbytes: float, profile: DeviceProfile, matmul: bool = True,
             gemm: tuple[float, float, float, float] | None = None) -> float:
    """Seconds for one kernel: the slower of its arithmetic and its memory traffic, plus the launch floor.

    GEMMs run at ``peak · η_matmul``, times the profile's tile efficiency when ``gemm`` gives their local
    ``(m, n, k, batch)``; other kernels (no tensor cores) are taken as memory-bound, so only their bytes count.
    """
    rate = profile.matmul_flops * (profile.gemm_efficiency(*gemm) if gemm is not None else 1.0)
    compute = flops / rate if matmul else 0.0
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
    rails = _rails(group, model.ranks_per_node)
    if rails > 1 and kind in ("all_reduce", "all_gather", "reduce_scatter"):
        return _over_rails(kind, group, rails, nbytes, model, device_type)
    link = model.link(device_type, group)
    if kind == "all_reduce":
        return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta
    if kind == "send_recv":
        return link.alpha + nbytes * link.beta
    if kind == "all_to_all":
        return (p - 1) * link.alpha + (p - 1) / p**2 * nbytes * link.beta
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


def _rails(group: tuple[int, ...], ranks_per_node: int) -> int:
    """Ranks of ``group`` on each of its nodes when it spans several nodes with the same count on each, else 1."""
    per_node: dict[int, int] = {}
    for r in group:
        per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
    counts = set(per_node.values())
    return counts.pop() if len(per_node) > 1 and len(counts) == 1 else 1


def _over_rails(kind: str, group: tuple[int, ...], rails: int, nbytes: float, model: CostModel,
                device_type: str) -> float:
    """A collective over ``rails`` ranks per node: inside each node, then one rail per rank across nodes."""
    inside = group[:rails]  # the first node's ranks (every node looks the same)
    across = group[::rails]  # one rank per node
    halves = {"all_reduce": ("reduce_scatter", "all_gather"), "reduce_scatter": ("reduce_scatter", None),
              "all_gather": (None, "all_gather")}[kind]
    local = sum(collective_time(h, inside, nbytes, model, device_type) for h in halves if h is not None)
    return local + collective_time(kind, across, nbytes / rails, model, device_type)


def model_state_bytes(params: float, dp: int, zero: int,
                      per_param: tuple[float, float, float] = MIXED_STATE) -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state for ``params`` parameters replicated over ``dp``
    data-parallel ranks, under ZeRO stage ``zero`` (Rajbhandari et al. 2020, Fig. 1):

        stage 0: (2 + 2 + 12) Ψ        stage 2: 2Ψ + (2 + 12) Ψ / N_d
        stage 1: (2 + 2) Ψ + 12Ψ / N_d stage 3: (2 + 2 + 12) Ψ / N_d

    >>> model_state_bytes(7.5e9, 64, 1)["optimizer"] / 1e9   # the paper's 7.5B model on 64 GPUs
    1.40625

    ``per_param`` replaces the paper's (2, 2, 12) bytes by a step's own (an fp32 Adam step: (4, 4, 8)).
    """
    if zero not in ZERO_STAGES:
        raise SbpflowError(f"ZeRO stage must be one of {ZERO_STAGES}, but got {zero!r}")
    shard = 1 / dp
    weight, grad, optimizer = per_param
    return {
        "weights": params * weight * (shard if zero >= 3 else 1),
        "gradients": params * grad * (shard if zero >= 2 else 1),
        "optimizer": params * optimizer * (shard if zero >= 1 else 1),
    }
