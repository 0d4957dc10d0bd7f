"""The state a user saves or fills: nested dicts, lists and tuples whose leaves are tensors or Python scalars."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..tensor import Tensor

Key = str | int
Path = tuple[Key, ...]
SCALAR_TYPES = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Leaf:
    """One tensor or scalar of the state and where it sits."""

    path: Path
    value: Any

    @property
    def name(self) -> str:
        return path_name(self.path)

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, (Tensor, torch.Tensor))


# A leaf's path is its keys from the root, ("optim", "state", 0, "exp_avg"), written optim/state/0/exp_avg in the
# index and files; two paths that print alike (keys 0 and "0") are refused on save.
def path_name(path: Path) -> str:
    """``("model", "wte.weight")`` -> ``"model/wte.weight"``."""
    return "/".join(str(k) for k in path)


def leaves(state: Any) -> list[Leaf]:
    """Every leaf of ``state`` in container order; a name that two paths share is a CheckpointError."""
    if not isinstance(state, (Mapping, list)):
        raise CheckpointError(f"a checkpoint state must be a dict or a list at its root (its scalars are replaced "
                              f"in place on load), but got {type(state).__name__}")
    out = list(_walk(state, ()))
    seen: dict[str, Path] = {}
    for leaf in out:
        if leaf.name in seen:
            raise CheckpointError(f"two entries of the state are both named {leaf.name!r} ({list(seen[leaf.name])} "
                                  f"and {list(leaf.path)}); rename one of the keys")
        seen[leaf.name] = leaf.path
    return out


def _walk(node: Any, path: Path) -> Iterator[Leaf]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            _check_key(key, path)
            yield from _walk(value, path + (key,))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _walk(value, path + (i,))
    elif isinstance(node, (Tensor, torch.Tensor, *SCALAR_TYPES)):
        yield Leaf(path, node)
    else:
        raise CheckpointError(
            f"a checkpoint holds dicts, lists and tuples of tensors (sbpflow or torch) and Python scalars "
            f"(bool, int, float, str, None), but {path_name(path) or 'the root'!r} is a {type(node).__name__}"
        )


def _check_key(key: Any, path: Path) -> None:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise CheckpointError(f"checkpoint dict keys must be str or int, but {path_name(path) or 'the root'!r} has "
                              f"the key {key!r} ({type(key).__name__})")
    if isinstance(key, str) and "/" in key:
        raise CheckpointError(f"checkpoint dict keys must not contain '/', which separates the parts of a name, "
                              f"but {path_name(path) or 'the root'!r} has the key {key!r}")


# Dicts and lists change in place; a tuple (Adam's betas) is rebuilt and put back into its parent, which is why
# the root itself must be a dict or a list.
def replace_scalars(state: Any, value_of: Callable[[Path], Any]) -> None:
    """Puts ``value_of(path)`` in place of every scalar leaf of ``state`` (a dict or list, changed in place)."""
    _replace(state, (), value_of)


def _replace(node: Any, path: Path, value_of: Callable[[Path], Any]) -> Any:
    """``node`` with its scalars replaced: the same dict or list, or a new tuple (tuples are immutable)."""
    if isinstance(node, Mapping):
        for key in list(node.keys()):
            node[key] = _replace(node[key], path + (key,), value_of)  # type: ignore[index]
        return node
    if isinstance(node, list):
        for i, value in enumerate(node):
            node[i] = _replace(value, path + (i,), value_of)
        return node
    if isinstance(node, tuple):
        values = [_replace(v, path + (i,), value_of) for i, v in enumerate(node)]
        return type(node)(*values) if hasattr(node, "_fields") else tuple(values)  # named tuples too
    if isinstance(node, SCALAR_TYPES):
        return value_of(path)
    return node
