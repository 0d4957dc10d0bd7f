"""``sbpflow.env``: OneFlow's names for the job's process layout.

>>> import sbpflow
>>> sbpflow.env.get_rank(), sbpflow.env.get_world_size()
(0, 1)
"""

from __future__ import annotations

from .distributed import rank as get_rank
from .distributed import world_size as get_world_size

__all__ = ["get_rank", "get_world_size"]
