"""Tier 3: real processes. Test files import the runner (procrun) from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
