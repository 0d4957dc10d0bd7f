"""(filled in by its op family's issue work)"""

from __future__ import annotations

__all__: list[str] = []
