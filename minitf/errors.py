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


SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}   # 128 + the signal's number: the exit status a scheduler reads


def nothing_half_written(e):
    """What an interruption `e` (KeyboardInterrupt) left: nothing half-written, or what a command keeps (as `e.kept`, a
    path, and `e.kept_what`, what it holds) for the same command to go on from: a download's part (data.download), the
    lines a translation has done (partial_output)."""
    kept, what = getattr(e, "kept", None), getattr(e, "kept_what", None)
    if kept and what:
        return f"{what} kept in {kept}, and the same command again goes on from them; nothing else half-written was kept"
    return (f"the download so far is kept in {kept}, and the same command again resumes it; nothing else "
            f"half-written was kept" if kept else "nothing half-written was kept")


class Interrupted(BaseException):
    """Training stopped by a signal (after saving a checkpoint, unless a second Ctrl-C came first): the command exits 128 + the
    signal's number (143 for SIGTERM, 130 for Ctrl-C), so a scheduler can tell it from a
    finished run. A BaseException, like KeyboardInterrupt: no `except Exception` swallows it."""

    def __init__(self, signame):
        super().__init__(signame)
        self.signame = signame
        self.exit_code = SIGNAL_EXIT.get(signame, 130)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler cancelling the job), raised where the command is, as Ctrl-C's
    KeyboardInterrupt is: what it was writing is removed (fileio.atomic_write) and the command exits 143."""
    signame = "SIGTERM"


@contextlib.contextmanager
def sigterm_raises(make=Terminated):
    """SIGTERM raises make() wherever it lands in the block, as Ctrl-C raises KeyboardInterrupt; the handler before is
    back after it (outside the main thread, where no handler can be set, the block runs as it is)."""
    def handler(signum, frame):
        raise make()
    try:
        before = _signal.signal(_signal.SIGTERM, handler)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        _signal.signal(_signal.SIGTERM, before)


@contextlib.contextmanager
def signals_held(replay=False):
    """Ctrl-C and SIGTERM recorded (the yielded list of their numbers) instead of handled while the block runs; the
    handlers before are back after it, and with `replay` each recorded signal is then handled by them. Python runs a
    handler in the main thread whichever thread the kernel gave the signal to (a thread's signal mask does not hold
    back a signal another thread, such as BLAS's, takes); outside the main thread nothing is held."""
    arrived, before = [], {}
    try:
        for sig in (_signal.SIGINT, _signal.SIGTERM):
            before[sig] = _signal.signal(sig, lambda signum, frame: arrived.append(signum))
    except ValueError:   # not the main thread: signals are not this thread's to handle
        pass
    try:
        yield arrived
    finally:
        for sig, handler in before.items():
            _signal.signal(sig, handler)
        for sig in arrived if replay else ():   # handled now, as it would have been
            handler = before.get(sig)
            if callable(handler):
                handler(sig, None)
            elif handler == _signal.SIG_DFL:
                _signal.raise_signal(sig)
