"""``python -m sbpflow.demo``: the same as ``sbpflow demo``."""

from __future__ import annotations

from .train_gpt import main

main()
