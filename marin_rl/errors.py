"""Errors the CLI reports as one clear line (no traceback): the user can fix them from the message."""


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
