"""Atomic directory writes: fill a temporary sibling, fsync it, rename it into place."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then the directory itself."""
    for file in directory.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the complete directory `src` to `dst`; an existing `dst` is moved aside first, then deleted."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex}")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old)
