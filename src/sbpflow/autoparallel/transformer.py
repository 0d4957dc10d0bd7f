"""A GPT-style transformer described by its sizes alone: FLOPs, kernel times, parameters and activations.

The output layer and embeddings are per rank under tensor parallelism of degree ``t`` (vocab-parallel). A
block's kernels, parameters and kept activations per rank depend on the SBP signatures chosen inside it, so
they live with that choice, in ``block_sbp`` (Megatron's choice there gives Korthikanti et al.'s counts).

Notation (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21, and Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys'23): ``b`` micro-batch, ``s`` sequence, ``h`` hidden, ``a`` heads, ``l`` layers, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SbpflowError
from .cost import matmul_flops, roofline
from .profiles import DeviceProfile

ACT_BYTES = 2  # fp16/bf16 activations
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class TransformerSpec:
    """Sizes of a GPT: the metadata that planning needs, and nothing else."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise SbpflowError(f"a transformer's {name} must be at least 1, but got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise SbpflowError(f"heads must divide hidden, but got hidden={self.hidden}, heads={self.heads}")

    @property
    def layer_params(self) -> int:
        """Weights and biases of one block: QKV and projection (4h² + 4h), MLP (8h² + 5h), two LayerNorms (4h)."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq * self.hidden

    @property
    def params(self) -> int:
        """All parameters, the output layer tied to the token embedding."""
        return self.layers * self.layer_params + self.embedding_params + 2 * self.hidden

    def model_flops(self, batch: int) -> float:
        """Megatron's FLOPs per iteration, activation recomputation included (Narayanan et al. 2021, eq. 3):
        96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).

        >>> TransformerSpec(layers=1, hidden=1, heads=1, seq=6, vocab=16).model_flops(1) / (96 * 6)  # 1 + 1 + 1
        3.0
        """
        b, s, n, h, v = batch, self.seq, self.layers, self.hidden, self.vocab
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))

    def useful_flops(self, batch: int) -> float:
        """FLOPs of forward and backward without recomputation (3/4 of Megatron's block count): what MFU counts."""
        b, s, n, h, v = batch, self.seq, self.layers, self.hidden, self.vocab
        return 72.0 * b * s * n * h * h * (1 + s / (6 * h)) + 6.0 * b * s * h * v


def head_cost(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile) -> float:
    """Forward + backward seconds of the output layer (vocab-parallel logits) and cross-entropy, per rank."""
    tokens = micro_batch * spec.seq
    logits = roofline(matmul_flops(tokens, spec.vocab // tp, spec.hidden),
                      ACT_BYTES * (tokens * spec.hidden + spec.hidden * spec.vocab // tp), profile)
    loss = roofline(0.0, 3 * 4 * tokens * spec.vocab // tp, profile, matmul=False)  # fp32 softmax, its gradient
    return 3 * logits + 2 * loss


def embedding_cost(spec: TransformerSpec, micro_batch: int, profile: DeviceProfile) -> float:
    """Forward + backward seconds of the token and position embeddings (gathers and a scatter-add)."""
    nbytes = 3 * ACT_BYTES * micro_batch * spec.seq * spec.hidden
    return 3 * roofline(0.0, nbytes, profile, matmul=False)


def head_activation_bytes(spec: TransformerSpec, micro_batch: int, tp: int) -> float:
    """The output layer's working memory on the last stage: fp32 logits and their gradient, per rank."""
    return 2 * 4.0 * micro_batch * spec.seq * spec.vocab / tp
