from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import sbpflow  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    sbpflow.manual_seed(0)
