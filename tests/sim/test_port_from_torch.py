"""examples/port_from_torch.py: a torchvision-style ResNet and a ViT written for torch, with only their imports
changed, train dp2 and dp2 x tp2 to torch's one-device numbers (losses and every weight and buffer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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


def test_nanogpt_model_file_with_only_its_imports_changed() -> None:
    """karpathy/nanoGPT's model.py (kept as text in benchmarks/sources): the same loss, one AdamW step from its own
    configure_optimizers to the same weights, and its generate() (top-k, multinomial, a mask write) running."""
    import torch

    import sbpflow

    source = (EXAMPLE.parents[1] / "benchmarks" / "sources" / "nanogpt" / "model.py.txt").read_text()
    imports = "import torch\nimport torch.nn as nn\nfrom torch.nn import functional as F"
    assert source.count(imports) == 1
    ported = source.replace(imports, "import sbpflow as torch\nimport sbpflow.nn as nn\n"
                                     "from sbpflow.nn import functional as F")
    theirs_ns, ours_ns = _module("nanogpt_torch", source), _module("nanogpt_sbpflow", ported)
    config = dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    torch.manual_seed(0)
    theirs = theirs_ns["GPT"](theirs_ns["GPTConfig"](**config))  # type: ignore[operator]
    ours = ours_ns["GPT"](ours_ns["GPTConfig"](**config))  # type: ignore[operator]
    ours.load_state_dict(theirs.state_dict())
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
