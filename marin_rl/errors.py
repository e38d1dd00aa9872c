"""Errors the CLI reports as one clear line (no traceback): the user can fix them from the message."""

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what is allowed."""


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (it would lose stored work, or has nothing to resume)."""


class PermanentError(RuntimeError):
    """A run-time failure that retrying cannot fix (a missing data file, a prompt longer than the row, a
    request the server refuses as invalid): the run stops with this one line, after a checkpoint."""


class ProblemSourceError(PermanentError):
    """An env's problem source failed (its file is missing, it raised, an epoch was empty)."""


class PromptTooLong(PermanentError):
    """A prompt alone leaves no room for a completion in the row."""


class BaseMissing(ValueError):
    """A server was sent LoRA adapters alone and holds no base weights to put them on (it restarted, say):
    the sender retries with the base."""


class DiskFull(PermanentError):
    """A write failed for want of space (or quota); the message names the path and the free bytes."""


@contextlib.contextmanager
def naming_full_disk(path: str | os.PathLike):
    """Turn a write to `path` that failed for want of space into `DiskFull`: the cause is otherwise
    buried (numpy says "N requested and M written", Equinox wraps it in a TreePathError)."""
    try:
        yield
    except Exception as e:
        if not _is_disk_full(e):
            raise
        raise DiskFull(f"the disk is full: could not write {path} ({_free_bytes(path):,} bytes free there)") from e


def _is_disk_full(error: BaseException | None) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and (
            error.errno in (errno.ENOSPC, errno.EDQUOT) or _SHORT_WRITE.fullmatch(str(error))
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile, without an errno


def _free_bytes(path: str | os.PathLike) -> int:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
