"""A decoder-only transformer (GPT, Llama) by its sizes alone: FLOPs, kernel times, parameters and activations.

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
MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("unfused", "flash")


@dataclass(frozen=True)
class TransformerSpec:
    """Sizes of a decoder-only transformer: the metadata that planning needs, and nothing else.

    The defaults describe a GPT (MLP 4h with GeLU, learned positions, LayerNorms with biases, the output layer
    tied to the token embedding); a Llama sets ``ffn_hidden``, ``kv_heads`` (grouped-query attention),
    ``mlp="swiglu"``, ``norm="rmsnorm"``, ``position="rope"``, ``bias=False``, ``tied=False`` and usually
    ``attention="flash"`` (no attention scores in memory). The vocabulary is
    padded as Megatron-LM pads it, to a multiple of ``vocab_multiple · tp``.

    >>> llama3_8b = TransformerSpec(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, ffn_hidden=14336,
    ...                             kv_heads=8, mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tied=False)
    >>> round(llama3_8b.params / 1e9, 2)
    8.03
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn_hidden: int = 0  # the MLP's inner width; 0: 4 · hidden
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: heads
    mlp: str = "gelu"  # "gelu" (fc1, GeLU, fc2) or "swiglu" (gate and up, SiLU · up, down)
    norm: str = "layernorm"  # "layernorm" (weight and bias) or "rmsnorm" (weight)
    position: str = "learned"  # "learned" (a seq x hidden table) or "rope" (no parameters)
    bias: bool = True  # linear layers have biases
    tied: bool = True  # the output layer is the token embedding
    vocab_multiple: int = 128  # Megatron's --make-vocab-size-divisible-by
    attention: str = "unfused"  # "unfused": scores in memory (Megatron-LM 2021); "flash": one fused kernel

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise SbpflowError(f"a transformer's {name} must be at least 1, but got {getattr(self, name)}")
        for name in ("ffn_hidden", "kv_heads"):
            if getattr(self, name) < 0:
                raise SbpflowError(f"a transformer's {name} must be at least 1 (or 0 for the default), but got "
                                   f"{getattr(self, name)}")
        if self.hidden % self.heads:
            raise SbpflowError(f"heads must divide hidden, but got hidden={self.hidden}, heads={self.heads}")
        if self.heads % self.kv:
            raise SbpflowError(f"key/value heads must divide the attention heads, but got heads={self.heads}, "
                               f"kv_heads={self.kv_heads}")
        for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("position", POSITIONS), ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise SbpflowError(f"a transformer's {name} is one of {allowed}, but got {getattr(self, name)!r}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def qkv_width(self) -> int:
        """Q, K and V side by side: hidden + 2 · kv_heads · head_dim."""
        return self.hidden + 2 * self.kv * (self.hidden // self.heads)

    @property
    def gated(self) -> bool:
        return self.mlp == "swiglu"

    @property
    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary rounded up to a multiple of ``vocab_multiple · tp`` (Megatron-LM pads, so any tp divides it).

        >>> TransformerSpec(layers=1, hidden=8, heads=1, seq=8, vocab=50257).padded_vocab(8)
        51200
        """
        step = self.vocab_multiple * tp
        return -(-self.vocab // step) * step

    @property
    def layer_params(self) -> int:
        """Weights and biases of one block: attention (QKV and projection), MLP, two norms.
        A GPT's is 12h² + 13h: 4h² + 4h, 8h² + 5h and 4h."""
        h, f, up = self.hidden, self.ffn, 2 if self.gated else 1
        weights = h * self.qkv_width + h * h + (up + 1) * h * f
        biases = self.qkv_width + h + up * f + h if self.bias else 0
        return weights + biases + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions, and an untied output layer."""
        v = self.padded_vocab()
        return v * self.hidden * (1 if self.tied else 2) + (self.seq * self.hidden if self.position == "learned" else 0)

    @property
    def params(self) -> int:
        """All parameters: the blocks, the embeddings and the final norm."""
        return self.layers * self.layer_params + self.embedding_params + self.norm_params

    def _block_flops_per_token(self) -> tuple[float, float]:
        """(matmul, core attention) forward FLOPs of one block per token: 2 · weights, and Q·Kᵀ plus probs·V."""
        h, f, up = self.hidden, self.ffn, 2 if self.gated else 1
        return 2.0 * (h * self.qkv_width + h * h + (up + 1) * h * f), 4.0 * self.seq * h

    def model_flops(self, batch: int) -> float:
        """FLOPs of forward and backward alone (3 passes of every matmul, no recompute): what model TFLOP/s and
        MFU count. A GPT's is 72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V.

        >>> gpt = TransformerSpec(layers=2, hidden=64, heads=4, seq=32, vocab=128)
        >>> gpt.model_flops(3)  # 72·3·32·2·64²·(1 + 32/384) + 6·3·32·64·128
        66060288.0
        """
        mm, attention = self._block_flops_per_token()
        tokens = batch * self.seq
        return tokens * (3 * self.layers * (mm + attention) + 6.0 * self.hidden * self.padded_vocab())

    def hardware_flops(self, batch: int, recompute: str) -> float:
        """FLOPs a plan executes: forward and backward, plus the forward that ``recompute`` reruns (the core
        attention under "selective", every block under "full"). Under "full" this is Megatron-LM's count
        (Narayanan et al. 2021, eq. 3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for a GPT.

        >>> gpt = TransformerSpec(layers=1, hidden=1, heads=1, seq=6, vocab=16, vocab_multiple=1)
        >>> gpt.hardware_flops(1, "full") / (96 * 6)  # 1 + 1 + 1
        3.0
        """
        if recompute not in RECOMPUTE:
            raise SbpflowError(f"recompute must be one of {RECOMPUTE}, but got {recompute!r}")
        mm, attention = self._block_flops_per_token()
        rerun = {"none": 0.0, "selective": attention, "full": mm + attention}[recompute]
        return self.model_flops(batch) + batch * self.seq * self.layers * rerun

    def describe(self) -> str:
        """The sizes in words, for reports and errors."""
        shape = (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads"
                 + (f" ({self.kv} key/value)" if self.kv != self.heads else "")
                 + f", MLP {self.ffn} {self.mlp}, seq {self.seq}, vocab {self.vocab}")
        return (shape + ("" if self.tied else ", untied output layer")
                + (", flash attention" if self.attention == "flash" else ""))


def head_cost(spec: TransformerSpec, micro_batch: int, tp: int, profile: DeviceProfile) -> float:
    """Forward + backward seconds of the output layer (vocab-parallel logits) and cross-entropy, per rank."""
    tokens, vocab = micro_batch * spec.seq, spec.padded_vocab(tp) // tp
    logits = roofline(matmul_flops(tokens, vocab, spec.hidden),
                      ACT_BYTES * (tokens * spec.hidden + spec.hidden * vocab), profile,
                      gemm=(tokens, vocab, spec.hidden, 1))
    loss = roofline(0.0, 3 * 4 * tokens * vocab, profile, matmul=False)  # fp32 softmax, its gradient
    return 3 * logits + 2 * loss


def embedding_cost(spec: TransformerSpec, micro_batch: int, profile: DeviceProfile) -> float:
    """Forward + backward seconds of the token (and learned position) embeddings: gathers and a scatter-add."""
    tables = 1 + (spec.position == "learned")
    nbytes = (1 + tables) * ACT_BYTES * micro_batch * spec.seq * spec.hidden
    return 3 * roofline(0.0, nbytes, profile, matmul=False)


def head_activation_bytes(spec: TransformerSpec, micro_batch: int, tp: int) -> float:
    """The output layer's working memory on the last stage: fp32 logits and their gradient, per rank."""
    return 2 * 4.0 * micro_batch * spec.seq * spec.padded_vocab(tp) / tp
