from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import sbpflow  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    sbpflow.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny kernels on a shared machine: extra torch threads only contend (4x slower here)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
