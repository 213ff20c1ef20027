"""What `minitf translate --output FILE` has translated so far, kept beside FILE as FILE.partial, so that a stopped
translation (Ctrl-C, SIGTERM, a killed process, a full disk) is not begun again: the same command goes on from the
lines it holds.

FILE.partial is JSON lines: a header naming what it was made from (a hash of the checkpoint file's name, size and
modification time, the input's text and every decoding flag), then {"i": line, "out": text} as each line is done,
in the order they finish. FILE itself is still written whole at the end (fileio.atomic_write), and FILE.partial then
removed. A header of another checkpoint, input or flags starts it afresh; a record cut short by a kill is dropped.
"""
import hashlib
import json
import os
import time

from .errors import ConfigError

HEADER = "minitf translate: the lines done so far"
FLUSH_S = 1.0   # the most seconds of finished lines a kill -9 can take with it


def partial_path(output):
    return output + ".partial"


def run_key(checkpoint, lines, options):
    """A hash of what the output is made from: the checkpoint (its files' paths, sizes and modification times: a file
    saved again is another), the input's lines and the decoding options (a dict)."""
    files = [checkpoint] if not os.path.isdir(checkpoint) else sorted(
        os.path.join(checkpoint, name) for name in os.listdir(checkpoint))
    made_from = [[os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in files if os.path.isfile(p)]
    text = hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()
    blob = json.dumps({"checkpoint": made_from, "input": [len(lines), text], "options": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class PartialOutput:
    """Open with the output's path and run_key's key: `done` maps line numbers to the text kept from a run of the same
    key (empty otherwise, with `dropped` saying why an earlier file was not taken), `add(i, text)` keeps another line
    (written through within FLUSH_S seconds: a kill -9 loses at most the last second's lines; Ctrl-C and SIGTERM
    none, `close`), `remove()` deletes the file once the output is whole. An exclusive lock (where the system has
    fcntl) refuses a second translation into the same output while one runs."""

    def __init__(self, output, key):
        self.path, self.key, self.done, self.dropped = partial_path(output), key, {}, None
        self._flushed = time.monotonic()
        self._file = open(self.path, "a+b")
        try:
            self._lock()
            self._read()
        except BaseException:
            self._file.close()
            raise

    def _lock(self):
        try:
            import fcntl
        except ImportError:   # Windows: no lock
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--output {self.path[:-len('.partial')]}: another translation into it is running "
                              f"(it holds {self.path}); wait for it, or name another output") from None

    def _read(self):
        """The lines kept under this key, the file cut back to its last whole record; or, for another key or a damaged
        file, an empty file with this key's header."""
        self._file.seek(0)
        data = self._file.read()
        whole = data[: data.rfind(b"\n") + 1]   # a record cut short by a kill has no newline yet
        records = whole.splitlines()
        try:
            header = json.loads(records[0]) if records else None
            if header is not None and header.get("key") == self.key:
                done = {}
                for line in records[1:]:
                    r = json.loads(line)
                    done[int(r["i"])] = r["out"]
                self.done = done
                if len(whole) < len(data):
                    self._file.truncate(len(whole))
                return
            if header is not None:
                self.dropped = "it was made from another checkpoint, input or decoding flags"
        except (ValueError, KeyError, TypeError, AttributeError):
            self.dropped = "it is damaged"
        self._file.truncate(0)
        self._write({"minitf": HEADER, "key": self.key})
        self._file.flush()

    def _write(self, record):
        """One record; through to the file at least every FLUSH_S seconds (a record's own flush cost 3% of a tiny
        model's translation), and at close."""
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass"))
        if time.monotonic() - self._flushed >= FLUSH_S:
            self._file.flush()
            self._flushed = time.monotonic()

    def add(self, i, text):
        self._write({"i": i, "out": text})
        self.done[i] = text

    def close(self):
        self._file.close()

    def remove(self):
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
