"""Package attributes imported on first use: a package's configs import at once, the modules that need
JAX or Levanter (seconds) when one of their names is first read."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, where: dict[str, str], prepare: Callable[[], None] | None = None) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: `where` maps each lazy name to its submodule;
    `prepare` runs before the first of them is imported."""
    prepared = []

    def __getattr__(name: str) -> Any:
        if name in where:
            if prepare is not None and not prepared:
                prepare()
                prepared.append(True)
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
