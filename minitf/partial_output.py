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

from .errors import ConfigError, DataError

HEADER = "minitf translate: the lines done so far"
DECODING_FLAGS = ("beam", "alpha", "max_len_b", "stop", "nbest", "scores", "device")   # not --batch-size: see run_key


def partial_path(output):
    """FILE.partial beside the file --output names (through a link: beside the file it points to, where it is
    written), or None where nothing is kept: standard output, a pipe, a device (/dev/stdout: the shell's file)."""
    if not output:
        return None
    real = os.path.realpath(output)
    devices = ("/dev/", "/proc/")
    if os.path.abspath(output).startswith(devices) or real.startswith(devices) or (os.path.exists(real) and
                                                                                   not os.path.isfile(real)):
        return None
    folder, name = os.path.split(real)
    if len(os.fsencode(name)) > 255 - len(".partial"):   # a name near the file system's 255 bytes: cut, told apart
        name = os.fsencode(name)[:150].decode(errors="ignore") + "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    return os.path.join(folder, name + ".partial")


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
    file saved again is another), the input's lines and the decoding flags (options, a dict). --batch-size is left
    out: it changes no translation, though the last bits of float32 sums (a score's last printed digit, rarely a
    near-tie between two hypotheses), as the lines done after a stop are decoded in other batches anyway."""
    made_from = [[os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in model_files(checkpoint)]
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
        mode = os.stat(output).st_mode & 0o777 if os.path.isfile(output) else 0o666   # FILE's own, or the umask's
        self._file = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, mode), "a+b", buffering=0)
        try:
            self._lock()
            self._read()
        except BaseException:
            self._file.close()
            raise

    def _lock(self):
        try:
            import fcntl
        except ImportError:   # no fcntl (Windows): no lock
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--output {self.output}: another translation into it is running (it holds "
                              f"{self.path}); wait for it, or name another output") from None
        except OSError:   # ENOLCK, EOPNOTSUPP: a file system that does not lock (as fileio.folder_lock: unlocked)
            pass

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
        try:
            self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass"))
        except OSError as e:   # a full disk, the file-size limit, an I/O error: said of FILE.partial, not of stdout
            raise DataError(f"--output {self.output}: cannot keep the lines translated in {self.path} "
                            f"({e.strerror or e}); the {len(self.done):,} kept so far stay there for the same "
                            f"command to go on from") from None

    def add(self, i, text):
        self._write({"i": i, "out": text})
        self.done[i] = text

    def kept(self):
        """The lines the file holds (an interruption between a line's write and `done` counted: the file says)."""
        self._file.seek(0)
        return max(self._file.read().count(b"\n") - 1, 0)

    def close(self):
        self._file.close()

    def remove(self):
        try:
            os.unlink(self.path)   # before the lock goes with the file: no second run takes the lock of a file unlinked
        except FileNotFoundError:
            pass
        self.close()
