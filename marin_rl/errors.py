"""Errors the CLI reports as one clear line (no traceback): the user can fix them from the message."""


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what is allowed."""


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (it would lose stored work, or has nothing to resume)."""
