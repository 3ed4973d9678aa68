"""Name-to-class registries: config selects a backend or formula by its type name."""

from __future__ import annotations

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
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(sorted(self._by_name))
            raise ValueError(f"unknown {self.role} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._by_name)

    def items(self) -> list[tuple[str, T]]:
        """(name, class) pairs, sorted by name."""
        return sorted(self._by_name.items())
