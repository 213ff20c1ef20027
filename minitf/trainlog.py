"""What a training run tells: OUT/train_log.jsonl (one JSON record a line) and the console's
progress bar. Only rank 0 writes either; on the other ranks both are silent."""
import errno
import json
import os
import shutil
import sys

from .errors import MinitfError


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class TrainLog:
    """OUT/train_log.jsonl, appended to (a resumed run continues the file). Each record is one
    line written whole by one write call and flushed to the OS; a full disk is a one-line
    MinitfError naming the file. A torn last line (a kill or a full disk mid-write) is dropped
    when the file is opened again, so the file stays valid JSONL. `enabled=False` (the ranks
    other than 0) writes nothing."""

    def __init__(self, path, enabled=True):
        self.path, self.fd = path, None
        if enabled:
            self.dropped = drop_torn_last_line(path)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, rec):
        if self.fd is None:
            return
        data = (json.dumps(rec) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            where = os.path.dirname(os.path.abspath(self.path))
            free = f" ({shutil.disk_usage(where).free / 1e6:,.1f} MB free)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise MinitfError(f"{self.path}: cannot append to the training log: {e.strerror}{free}; free some "
                              f"space, then continue with --resume") from None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def drop_torn_last_line(path):
    """Cut a regular file after its last newline; returns the bytes dropped (0 if none)."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - (1 << 20))   # a record is a few hundred bytes
        f.seek(start)
        tail = f.read()
        if not tail or tail.endswith(b"\n"):
            return 0
        keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else start
        f.truncate(keep)
        return size - keep


class Progress:
    """The training progress bar on stderr: updates done of --max-steps, or under --time-budget
    the seconds of the budget spent; its postfix shows the last logged record."""

    def __init__(self, state, max_steps, budget, enabled):
        from tqdm import tqdm
        self.budget = budget
        self.bar = tqdm(initial=round(min(state["train_wall_s"], budget)) if budget else state["step"],
                        total=round(budget) if budget else (max_steps or None), desc="train", file=sys.stderr,
                        unit="s" if budget else "it", disable=not enabled, dynamic_ncols=True)

    def update(self, elapsed):
        """After an update, `elapsed` seconds of training since the run began."""
        self.bar.update(round(min(elapsed, self.budget)) - self.bar.n if self.budget else 1)

    def show(self, rec):
        self.bar.set_postfix(step=rec["step"], loss=rec["loss"], ppl=rec["ppl"], lr=f"{rec['lr']:.2e}",
                             tok_s=int(rec["tokens_per_s"]))

    def close(self):
        self.bar.close()
