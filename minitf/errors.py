"""Errors minitf raises on bad input: each message says what is wrong and what to do.

The command-line entry points catch `MinitfError` and print its message as one line
(no traceback), so every user-facing failure should raise one of these.
"""


class MinitfError(Exception):
    """Base class: a user-facing error with a one-line message."""


class DeviceError(MinitfError):
    """The requested device cannot be used (no CuPy, no GPU, unknown name)."""


class DataError(MinitfError):
    """A data file is missing, unreadable or inconsistent (names the file and line)."""


class CheckpointError(MinitfError):
    """A checkpoint is missing, truncated, tampered with or does not fit the model."""


class ConfigError(MinitfError):
    """A configuration value is out of range or inconsistent."""


class Interrupted(BaseException):
    """Training stopped by a signal after saving a checkpoint: the command exits 128 + the
    signal's number (143 for SIGTERM, 130 for Ctrl-C), so a scheduler can tell it from a
    finished run. A BaseException, like KeyboardInterrupt: no `except Exception` swallows it."""

    def __init__(self, signame):
        super().__init__(signame)
        self.signame = signame
        self.exit_code = {"SIGTERM": 143, "SIGINT": 130}.get(signame, 130)
