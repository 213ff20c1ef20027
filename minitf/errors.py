"""Errors minitf raises on bad input: each message says what is wrong and what to do.

The command-line entry points catch `MinitfError` and print its message as one line
(no traceback), so every user-facing failure should raise one of these.
"""
import contextlib
import signal as _signal
import sys
import warnings


def one_line(text, limit=400):
    """`text` (e.g. a library's multi-line exception message) as one line of at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def report(message):
    """Print `message` on stderr as ONE line, in one write, flushed: the lines of several processes
    (MPI ranks sharing a terminal) never run into each other."""
    sys.stderr.write(one_line(message, limit=4000) + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def one_line_warnings():
    """Within the block, a Python warning (a tokenizer trained smaller than asked, kernels that did not compile) is
    printed as one line, `warning: MESSAGE`, not as Python's `FILE:LINE: UserWarning: MESSAGE` and the source line
    under it; the command-line entry points run in it."""
    before = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        report(f"warning: {message}")
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


def out_of_memory(e, knobs=None):
    """The one-line message for a MemoryError: what could not be allocated, and the flags that size it."""
    what = f" ({one_line(e, 120)})" if str(e) else ""
    return f"out of memory{what}; " + (f"lower {knobs}" if knobs else "free some memory or use a larger machine")


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


class SameOnEveryRank(ConfigError):
    """A ConfigError that every rank of a job raises alike (the ranks disagree, the batches of a resume): rank 0 says
    it, the others end without repeating it (train.train)."""


class Interrupted(BaseException):
    """Training stopped by a signal (after saving a checkpoint, unless a second Ctrl-C came first): the command exits 128 + the
    signal's number (143 for SIGTERM, 130 for Ctrl-C), so a scheduler can tell it from a
    finished run. A BaseException, like KeyboardInterrupt: no `except Exception` swallows it."""

    def __init__(self, signame):
        super().__init__(signame)
        self.signame = signame
        self.exit_code = {"SIGTERM": 143, "SIGINT": 130}.get(signame, 130)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler cancelling the job), raised where the command is, as Ctrl-C's
    KeyboardInterrupt is: what it was writing is removed (fileio.atomic_write) and the command exits 143."""


def terminate_as_interrupt():
    """SIGTERM raises Terminated in the main thread from now on; returns the handler before (None where signals
    cannot be set: not the main thread)."""
    def handler(signum, frame):
        raise Terminated()
    try:
        return _signal.signal(_signal.SIGTERM, handler)
    except ValueError:
        return None
