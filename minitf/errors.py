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
