"""Containers: Sequential, ModuleList, ModuleDict, ParameterList."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .module import Module, Parameter


class Sequential(Module):
    """Calls its modules in order, each on the previous one's output.

    >>> import sbpflow
    >>> from sbpflow import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> net(sbpflow.randn(3, 4)).shape, [n for n, _ in net.named_children()]
    (torch.Size([3, 2]), ['0', '1', '2'])
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, index: int | slice) -> Any:
        items = list(self._modules.values())
        if isinstance(index, slice):
            return Sequential(*items[index])
        return items[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self._modules)), module)
        return self


class ModuleList(Module):
    """A list of modules whose parameters the parent sees (names ``"0"``, ``"1"`` ...)."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        for m in modules or ():
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, index: int | slice) -> Any:
        items = list(self._modules.values())
        return ModuleList(items[index]) if isinstance(index, slice) else items[index]

    def __setitem__(self, index: int, module: Module) -> None:
        key = list(self._modules)[index]
        self._modules[key] = module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class ModuleDict(Module):
    """A dict of modules whose parameters the parent sees (names are the keys)."""

    def __init__(self, modules: Mapping[str, Module] | None = None) -> None:
        super().__init__()
        for name, m in (modules or {}).items():
            self[name] = m

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]  # type: ignore[no-any-return]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        self._forget(key)

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def keys(self) -> Any:
        return self._modules.keys()

    def values(self) -> Any:
        return self._modules.values()

    def items(self) -> Any:
        return self._modules.items()


class ParameterList(Module):
    """A list of parameters that the parent sees (names ``"0"``, ``"1"`` ...), as torch's ParameterList."""

    def __init__(self, values: Iterable[Parameter] | None = None) -> None:
        super().__init__()
        for p in values or ():
            self.append(p)

    def append(self, value: Parameter) -> ParameterList:
        self.register_parameter(str(len(self._parameters)), value)
        return self

    def extend(self, values: Iterable[Parameter]) -> ParameterList:
        for p in values:
            self.append(p)
        return self

    def __getitem__(self, index: int) -> Parameter:
        return list(self._parameters.values())[index]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self._parameters.values())  # type: ignore[arg-type]
