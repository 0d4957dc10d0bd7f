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
