"""Demos on virtual CPU devices: a tour of matmul under SBP, then training a GPT (``sbpflow demo``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .train_gpt import main as run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs ``sbpflow demo`` with command-line style ``argv`` (see ``sbpflow demo --help``)."""
    return run(argv)
