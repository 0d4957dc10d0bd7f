"""examples/port_from_torch.py: a torchvision-style ResNet and a ViT written for torch, with only their imports
changed, train dp2 and dp2 x tp2 to torch's one-device numbers (losses and every weight and buffer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sbpflow import sbp as S

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "port_from_torch.py"


def _example() -> object:
    spec = importlib.util.spec_from_file_location("port_from_torch", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["port_from_torch"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["ResNet", "ViT"])
@pytest.mark.parametrize("layout", ["dp2", "dp2xtp2"])
def test_ported_model_trains_like_torch(name: str, layout: str) -> None:
    ours, theirs, gap, model = _example().run(name, layout, steps=2)  # type: ignore[attr-defined]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert gap < 1e-5
    if layout == "dp2xtp2":  # the tensor-parallel plan took hold: split on mesh axis 1, broadcast on the data axis
        column = model.blocks[0].mlp[0].weight if name == "ViT" else model.layer1[0].conv1.weight
        row = model.blocks[0].mlp[2].weight if name == "ViT" else model.layer1[0].conv2.weight
        assert column.sbp == (S.broadcast, S.split(0)) and row.sbp == (S.broadcast, S.split(1))


def test_only_the_imports_differ() -> None:
    example = _example()
    for source in (example.RESNET, example.VIT):  # type: ignore[attr-defined]
        ported = example.PORTED + source[len(example.IMPORTS):]  # type: ignore[attr-defined]
        assert ported.splitlines()[3:] == source.splitlines()[3:]


def _module(name: str, source: str) -> dict[str, object]:
    """``source`` run as module ``name`` (dataclasses look their module up in sys.modules)."""
    import types

    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)  # noqa: S102 (nanoGPT's file, as published)
    return module.__dict__


NANOGPT = EXAMPLE.parents[1] / "benchmarks" / "sources" / "nanogpt" / "model.py.txt"
TORCH_IMPORTS = "import torch\nimport torch.nn as nn\nfrom torch.nn import functional as F"
OUR_IMPORTS = "import sbpflow as torch\nimport sbpflow.nn as nn\nfrom sbpflow.nn import functional as F"


def _nanogpt_pair(tag: str, vocab_size: int) -> tuple[Any, Any]:
    """nanoGPT's GPT as published (torch) and with only its imports changed (sbpflow), with equal weights."""
    import torch

    source = NANOGPT.read_text()
    assert source.count(TORCH_IMPORTS) == 1
    theirs_ns = _module(f"nanogpt_torch{tag}", source)
    ours_ns = _module(f"nanogpt_sbpflow{tag}", source.replace(TORCH_IMPORTS, OUR_IMPORTS))
    config = dict(block_size=16, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    torch.manual_seed(0)
    theirs = theirs_ns["GPT"](theirs_ns["GPTConfig"](**config))  # type: ignore[operator]
    ours = ours_ns["GPT"](ours_ns["GPTConfig"](**config))  # type: ignore[operator]
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def test_nanogpt_model_file_with_only_its_imports_changed() -> None:
    """karpathy/nanoGPT's model.py (kept as text in benchmarks/sources): the same loss, one AdamW step from its own
    configure_optimizers to the same weights, and its generate() (top-k, multinomial, a mask write) running."""
    import torch

    import sbpflow

    ours, theirs = _nanogpt_pair("", vocab_size=50)
    idx, targets = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    _, loss = ours(sbpflow.tensor(idx), sbpflow.tensor(targets))
    _, ref = theirs(idx, targets)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-6)
    opt = ours.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    ref_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    loss.backward()
    ref.backward()
    opt.step()
    ref_opt.step()
    for name, value in ours.state_dict().items():
        np.testing.assert_allclose(value.numpy(), theirs.state_dict()[name].numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    sbpflow.manual_seed(0)
    assert tuple(ours.generate(sbpflow.tensor(idx[:1, :4]), 3, top_k=5).shape) == (1, 7)


@pytest.mark.parametrize("layout", ["dp2", "dp2xtp2"])
def test_nanogpt_model_file_on_global_tensors(layout: str) -> None:
    """The same file laid out dp2 (or dp2 x tp2 on its MLPs): its local ``torch.arange`` positions meet global
    embeddings, taken as broadcast under implicit_broadcast(); loss and one AdamW step equal torch's."""
    import torch

    import sbpflow
    from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, apply_plan

    ours, theirs = _nanogpt_pair("2", vocab_size=48)
    if layout == "dp2":
        placement = sbpflow.placement("cpu", [0, 1])
        ours.to_global(placement)
        batch_sbp: tuple[object, ...] = (S.split(0),)
    else:
        placement = sbpflow.placement("cpu", [[0, 1], [2, 3]])
        apply_plan(ours, {"transformer.h.*.mlp.c_fc": ColwiseParallel(), "transformer.h.*.mlp.c_proj":
                          RowwiseParallel()}, placement, mesh_axis=1)
        batch_sbp = (S.split(0), S.broadcast)
    idx, targets = torch.randint(0, 48, (4, 16)), torch.randint(0, 48, (4, 16))
    with pytest.raises(sbpflow.LocalGlobalError, match="implicit_broadcast"):
        ours(sbpflow.tensor(idx).to_global(placement, S.broadcast if layout == "dp2" else
                                           (S.broadcast, S.broadcast)), None)
    glob = [sbpflow.tensor(t).to_global(placement, (S.broadcast,) * placement.ndim).to_global(placement, batch_sbp)
            for t in (idx, targets)]
    opt = ours.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    ref_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    with sbpflow.implicit_broadcast():
        _, loss = ours(*glob)
    _, ref = theirs(idx, targets)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-6)
    loss.backward()
    ref.backward()
    ref_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), ref_params[name].grad.numpy(), rtol=1e-4, atol=1e-7,
                                   err_msg=name)
    opt.step()
    ref_opt.step()
    for name, value in ours.state_dict().items():  # Adam's m / sqrt(v) turns a 1e-9 gradient gap into lr * 1e-2
        assert value.placement == placement
        np.testing.assert_allclose(value.numpy(), theirs.state_dict()[name].numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_nanogpt_model_file_under_nn_graph() -> None:
    """The file's forward traced by nn.Graph on dp2 (its ``.contiguous()`` and local positions traced too): two
    SGD steps equal torch's losses and weights."""
    import torch

    import sbpflow

    ours, theirs = _nanogpt_pair("3", vocab_size=48)
    placement = sbpflow.placement("cpu", [0, 1])
    ours.to_global(placement)
    opt, ref_opt = sbpflow.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)

    class Step(sbpflow.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = ours
            self.add_optimizer(opt)

        def build(self, idx: sbpflow.Tensor, targets: sbpflow.Tensor) -> sbpflow.Tensor:
            with sbpflow.implicit_broadcast():
                _, loss = self.model(idx, targets)
            loss.backward()
            return loss

    step = Step()
    for _ in range(2):
        idx, targets = torch.randint(0, 48, (4, 16)), torch.randint(0, 48, (4, 16))
        loss = step(*(sbpflow.tensor(t).to_global(placement, S.broadcast).to_global(placement, S.split(0))
                      for t in (idx, targets)))
        _, ref = theirs(idx, targets)
        ref_opt.zero_grad()
        ref.backward()
        ref_opt.step()
        np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-5)
    for name, value in ours.state_dict().items():
        np.testing.assert_allclose(value.numpy(), theirs.state_dict()[name].numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
