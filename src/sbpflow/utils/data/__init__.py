"""``sbpflow.utils.data``: map-style datasets and a :class:`DataLoader` that places batches on ranks and
prefetches them with a source actor of the runtime (see :mod:`.loader`)."""

from __future__ import annotations

from .dataset import Dataset, TensorDataset
from .loader import Batches, DataLoader

__all__ = ["Batches", "DataLoader", "Dataset", "TensorDataset"]
