from __future__ import annotations

import os
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


@pytest.fixture
def native_collectives() -> Iterator[None]:
    """Plans and eager dispatch cost collectives for transports that have every one natively (NCCL), instead of
    the cpu target's gloo, which runs a reduce-scatter as an all-reduce (``comm.base.TARGET_COST_FACTORS``):
    for tests of what the α-β table alone prefers, such as reduce-scatter over all-reduce + slice."""
    with sbpflow.boxing.target_factors(()):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under CI=true, cases marked ``long`` are skipped: each has a representative in the CI set."""
    if os.environ.get("CI") != "true":
        return
    skip = pytest.mark.skip(reason="long: run by make test outside CI")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
