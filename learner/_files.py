"""Atomic directory writes: fill a temporary sibling, fsync it, rename it into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
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


@contextlib.contextmanager
def directory_written_atomically(path: Path) -> Iterator[Path]:
    """Yields a temporary sibling of `path` to fill; then fsyncs it and renames it to `path` (replacing
    what was there), or removes it if the block raised: `path` is whole or as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

