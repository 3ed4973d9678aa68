"""Name-to-class registries: config selects a backend or formula by its type name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes of one role (puller, pusher, formula) registered under their type name.

    Registering a name twice is an error: two modules claiming one name would make config
    ambiguous.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self._by_name: dict[str, T] = {}
        self._modules: dict[str, str] = {}

    def declare(self, name: str, module: str) -> None:
        """Say which module registers ``name``, to be imported the first time it is asked for.

        Backends bring client libraries that take a tenth of a second or more to import
        (influxdb-client, pymongo); a service that uses none of them should not wait for them.
        """
        self._modules[name] = module

    def _load(self, name: str) -> None:
        module = self._modules.pop(name, None)
        if module is not None and name not in self._by_name:
            importlib.import_module(module)
        # A module may register several names (the Extra-P formats): they are loaded now too.
        for other, its_module in list(self._modules.items()):
            if its_module == module and other in self._by_name:
                del self._modules[other]

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator that registers the class under ``name``."""

        def add(cls: T) -> T:
            if name in self._by_name:
                raise ValueError(f"{self.role} {name!r} is registered twice")
            self._by_name[name] = cls
            return cls

        return add

    def get(self, name: str) -> T:
        """The class registered under ``name``.

        Raises:
            ValueError: for an unknown name, listing the known ones.
        """
        self._load(name)
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self.role} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """Registered and declared names, sorted."""
        return sorted({*self._by_name, *self._modules})

    def items(self) -> list[tuple[str, T]]:
        """(name, class) pairs, sorted by name; every declared module is imported."""
        for name in list(self._modules):
            self._load(name)
        return sorted(self._by_name.items())
