"""Optional heavy dependencies, imported only by the envs that need them."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, package: str, env_type: str) -> ModuleType:
    """Import `module`, or fail with an error naming the pip package the env needs."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not (e.name and module.startswith(e.name + ".")):
            raise  # the package is there but one of its own imports is broken: show that
        raise ModuleNotFoundError(
            f"env type {env_type!r} needs the package {package!r} (pip install 'marin-rl[envs]' or pip install {package})"
        ) from e
