"""Data-parallel ResNet training equals single-device training (BatchNorm statistics included).

``train_cnn(placement_or_None, steps)`` is the shared entry point: the real-process tier
calls it with its own placement and compares with the same single-device run.
"""

from __future__ import annotations

import numpy as np
import pytest

import sbpflow
from harness import PLACEMENTS
from sbpflow import nn
from sbpflow.comm import record
from sbpflow.models.cnn import ResNet, _batch, _place, train_cnn

P4 = sbpflow.placement("cpu", [0, 1, 2, 3])
STEPS = 3


@pytest.fixture(scope="module")
def single_device() -> tuple[list[float], dict[str, np.ndarray]]:
    return train_cnn(None, STEPS)


def _assert_same(a: tuple[list[float], dict[str, np.ndarray]], b: tuple[list[float], dict[str, np.ndarray]]) -> None:
    np.testing.assert_allclose(a[0], b[0], rtol=1e-4)
    assert list(a[1]) == list(b[1])
    for name in a[1]:
        np.testing.assert_allclose(a[1][name], b[1][name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_data_parallel_4_matches_single_device(single_device: tuple[list[float], dict[str, np.ndarray]]) -> None:
    losses, params = single_device
    assert losses[-1] != losses[0]  # it trained
    assert any(name.endswith("running_var") for name in params)  # BN statistics are compared too
    _assert_same(single_device, train_cnn(P4, STEPS))


def test_uneven_batch_on_3_ranks_and_2x2_mesh() -> None:
    reference = train_cnn(None, 2, batch=10)
    _assert_same(reference, train_cnn(PLACEMENTS["3"], 2, batch=10))  # shards of 4, 3, 3 images
    _assert_same(reference, train_cnn(PLACEMENTS["2x2"], 2, batch=10))  # S(0) on axis 0, replicated on axis 1


def test_data_parallel_step_communicates_statistics_and_gradients_only() -> None:
    model = ResNet(channels=4, num_classes=5).to_global(P4)
    images, labels = _batch(0, 8, 8, 5)
    with record() as forward:
        loss = nn.CrossEntropyLoss()(model(_place(images, P4)), _place(labels, P4))
    with record() as backward:
        loss.backward()
    counts = forward.counts()
    batch_norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert "all_gather" not in counts  # parameters are never gathered, activations stay split
    # mean and variance of every BatchNorm, plus the loss's sample count
    assert counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0) == 2 * batch_norms + 1
    assert "all_gather" not in backward.counts()
    for p in model.parameters():
        assert p.grad is not None and p.grad.sbp == (sbpflow.sbp.broadcast,)
