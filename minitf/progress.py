"""Progress of long work (a download, a pass over a corpus, translating a test set) on stderr:
a tqdm bar on a terminal; elsewhere (a log file, a pipe) a plain line every `every` seconds and a
last one when the work took that long, so a log never holds a bar's carriage-return fragments."""
import sys
import time


def on_terminal(stream=None):
    """Whether `stream` (stderr by default) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a closed or replaced stream
        return False


def bar(total, desc, enabled=True, unit="B", initial=0, stream=None, every=30.0, **tqdm_options):
    """An object with tqdm's `update(k)`, `set_postfix_str(s)`, `close()`, `n` and `with`: a tqdm
    bar on a terminal (with `tqdm_options`), `Lines` elsewhere, silent when not `enabled`."""
    stream = sys.stderr if stream is None else stream
    if enabled and on_terminal(stream):
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=stream, **tqdm_options)
    return Lines(total, desc, unit, initial, stream, every if enabled else None)


def amount(n, unit):
    """'1.1 GB' for bytes, '1,234 sent' for anything else."""
    if unit != "B":
        return f"{n:,.0f} {unit}"
    for name in ("B", "KB", "MB", "GB"):
        if n < 1024 or name == "GB":
            return f"{n:,.0f} B" if name == "B" else f"{n:,.1f} {name}"
        n /= 1024


class Lines:
    """tqdm's interface as plain lines: `desc: 45%, 520.0 MB of 1.1 GB, 30s[, postfix]` at most
    every `every` seconds (None: silent), and `desc: done, ...` at the end if a line was written."""

    def __init__(self, total, desc, unit="B", initial=0, stream=None, every=30.0):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = sys.stderr if stream is None else stream
        self.n, self.postfix, self.written, self.closed = initial, "", False, False
        self.t0 = self.last = time.monotonic()

    def update(self, k=1):
        self.n += k
        now = time.monotonic()
        if self.every is not None and now - self.last >= self.every:
            self.last = now
            self._line()

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s

    def _line(self, done=False):
        of = f" of {amount(self.total, self.unit)}" if self.total else ""
        share = "done" if done else f"{100 * self.n / self.total:.0f}%" if self.total else "so far"
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {share}, {amount(self.n, self.unit)}{of}, {time.monotonic() - self.t0:.0f}s{extra}",
              file=self.stream, flush=True)
        self.written = True

    def close(self):
        if not self.closed:
            self.closed = True
            if self.written:
                self._line(done=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
