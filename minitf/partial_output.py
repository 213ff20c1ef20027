"""What `minitf translate --output FILE` has translated so far, kept beside FILE as FILE.partial, so that a stopped
translation (Ctrl-C, SIGTERM, a killed process) is not begun again: the same command goes on from the lines it holds.

FILE.partial is JSON lines: a header naming what it was made from (a hash of the model's files' paths, sizes and
modification times, the input's text and the decoding flags that choose the translations), then {"i": line, "out":
text} as each line is done, in the order they finish, each written through to the file at once. FILE itself is
still written whole at the end (fileio.atomic_write), and FILE.partial then removed. A header of another model,
input or flags, or a damaged file, starts it afresh; a record cut short by a kill is dropped.
"""
import hashlib
import json
import os
import threading

from .errors import ConfigError, DataError, report
from .fileio import fit_name

HEADER = "minitf translate: the lines done so far"
DECODING_FLAGS = ("beam", "alpha", "max_len_b", "stop", "nbest", "scores")   # not --batch-size, --device: see run_key


def partial_path(output):
    """FILE.partial beside the file --output names (through a link: beside the file it points to, where it is
    written), or None where nothing is kept: standard output, a pipe, a device (/dev/stdout: the shell's file)."""
    if not output:
        return None
    real = os.path.realpath(output)
    streams = ("/dev/std", "/dev/fd/", "/proc/")   # a process's own streams (a file under /dev/shm is a file)
    if os.path.abspath(output).startswith(streams) or real.startswith("/proc/") or (os.path.exists(real) and
                                                                                    not os.path.isfile(real)):
        return None
    folder, name = os.path.split(real)
    return os.path.join(folder, fit_name(name, 255 - len(".partial"), 150) + ".partial")


def model_files(checkpoint):
    """The files a model is read from: a minitf checkpoint's file, or a Marian model's .npz, vocabulary and
    SentencePiece models (and its decoder.yml), where the model is one (marian.marian_files)."""
    from .marian import is_marian, marian_files
    if is_marian(checkpoint):
        model, vocabs, src_spm, tgt_spm = marian_files(checkpoint)
        decoder = [os.path.join(checkpoint, "decoder.yml")] if os.path.isdir(checkpoint) else []
        return [model, *vocabs, src_spm, tgt_spm, *[f for f in decoder if os.path.isfile(f)]]
    return [checkpoint]


def run_key(checkpoint, lines, options):
    """A hash of what the output is made from: the model's files (their real paths, sizes and modification times: a
    file saved again is another), the input's lines and the decoding flags (options, a dict). --batch-size and
    --device are left out: they change no translation, though the last bits of float32 sums (a score's last printed
    digit, rarely a near-tie between two hypotheses), as the lines done after a stop are decoded in other batches
    anyway; and a smaller batch, or the CPU, is what an out-of-memory stop is told to try."""
    made_from = [[os.path.realpath(p), st.st_size, st.st_mtime_ns] for p in model_files(checkpoint)
                 for st in [os.stat(p)]]
    text = hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()
    blob = json.dumps({"checkpoint": made_from, "input": [len(lines), text], "options": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class PartialOutput:
    """Open with --output's FILE and run_key's key: `done` maps line numbers to the texts kept by a run of the same key
    (empty otherwise, `dropped` saying why an earlier file was not taken), `add(i, text)` keeps another line (written
    through at once: a kill loses at most the line being written), `kept()` counts the lines the file holds, and
    `remove()` deletes it once FILE is whole. OSError where FILE.partial cannot be made. An exclusive lock (where
    the file system locks) refuses a second translation into the same FILE while one runs."""

    def __init__(self, output, key):
        self.output, self.path, self.key, self.done, self.dropped = output, partial_path(output), key, {}, None
        self._adding, self._stopped = threading.Lock(), False
        # FILE's permissions (its owner may always read and write it: a read-only FILE's had refused the next run),
        # or the umask's
        mode = (os.stat(output).st_mode & 0o777) | 0o600 if os.path.isfile(output) else 0o666
        for attempt in range(5):   # until the file locked is the one at the path (a run ending unlinks its file)
            self._file = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, mode), "a+b", buffering=0)
            try:
                if self._lock() or attempt == 4:
                    break
            except BaseException:
                self._file.close()
                raise
            self._file.close()
        try:
            self._read()
        except BaseException:
            self._file.close()
            raise

    def _lock(self):
        """Lock the file open: True where it is still the one at self.path. ConfigError where another run holds it."""
        try:
            import fcntl
        except ImportError:   # no fcntl (Windows): no lock
            return True
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--output {self.output}: another translation into it is running (it holds "
                              f"{self.path}); wait for it, or name another output") from None
        except OSError:   # ENOLCK, EOPNOTSUPP: a file system that does not lock (as fileio.folder_lock: unlocked)
            return True
        try:
            return os.path.samestat(os.fstat(self._file.fileno()), os.stat(self.path))
        except FileNotFoundError:
            return False

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
                self.dropped = "it was made from another model, input or decoding flags"
        except (ValueError, KeyError, TypeError, AttributeError):
            self.dropped = "it is damaged"
        self._file.truncate(0)
        self._write({"minitf": HEADER, "key": self.key})

    def _write(self, record):
        """One record, whole: a write cut short (a full disk, the file-size limit) is taken back and said."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
        start = os.fstat(self._file.fileno()).st_size
        try:
            written = 0
            while written < len(data):
                n = self._file.write(data[written:])
                if not n:
                    raise OSError(f"{written} of {len(data)} bytes written")
                written += n
        except OSError as e:   # said of FILE.partial, not of stdout; its whole records kept
            try:
                self._file.truncate(start)
            except OSError:
                pass   # a cut record is dropped when the file is read
            kept = f"the {len(self.done):,} kept so far stay" if self.done else "none was kept yet; it stays"
            raise DataError(f"--output {self.output}: cannot keep the lines translated in {self.path} "
                            f"({e.strerror or e}); {kept} there for the same command to go on from") from None

    def add(self, i, text):
        with self._adding:
            if not self._stopped:
                self._write({"i": i, "out": text})
                self.done[i] = text

    def stop(self):
        """No line is kept after this: a search thread that finishes its batch after an interruption adds nothing, so
        that kept() then counts what the file keeps (those lines had been added after the count: 233 said, 235 kept)."""
        with self._adding:
            self._stopped = True

    def kept(self):
        """The lines the file holds (an interruption between a line's write and `done` counted: the file says)."""
        self._file.seek(0)
        return max(self._file.read().count(b"\n") - 1, 0)

    def close(self):
        self.stop()   # (a line a search thread finishes later is not written into a closed file)
        self._file.close()

    def remove(self):
        """Delete the file (FILE is whole): before the lock goes with it, so that no second run locks a file unlinked;
        one that cannot be deleted is said, FILE being written."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            report(f"note: {self.output} is written; {self.path} could not be removed ({e.strerror or e}): remove it")
        finally:
            self.close()
