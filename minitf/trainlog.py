"""What a training run tells: OUT/train_log.jsonl (one JSON record a line) and the console (a
progress bar on a terminal, plain lines elsewhere). Only rank 0 writes either."""
import errno
import json
import os
import shutil
import sys
import time

from .errors import MinitfError
from .fileio import atomic_write
from .progress import on_terminal
from .validation import shown_ppl


def log(msg):
    sys.stderr.write(f"{msg}\n")   # one write: the lines of several ranks never run into each other
    sys.stderr.flush()


def plural(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def reported_model(results):
    """The model a run reports, in words: the average of its checkpoints, or the last checkpoint (also where the
    average was of the final checkpoint alone, when no other one was in the run's second half)."""
    checkpoints = results["model_checkpoints"]
    if results["model"] == "averaged" and len(checkpoints) > 1:
        return f"the average of {plural(len(checkpoints), 'checkpoint')}"
    return f"the last checkpoint ({checkpoints[0]})"


def summary_lines(results, out, tgt):
    """The end of a run in a few lines for stdout: the updates and time, the model reported, each set's
    scores (sacreBLEU with the run's beam on the whole set; the paper's tokenized BLEU where computed),
    and the files to look at."""
    wall = round(results["train_wall_s"])   # as the stop's line rounds it (int() had shown 5 s where it said 6)
    model = reported_model(results)
    lines = [f"summary: {plural(results['steps'], 'update')}, {results['epochs']:.1f} epochs, {wall // 60}m "
             f"{wall % 60:02d}s of training; reported: {model}; scores: sacreBLEU and chrF, beam {results['beam']}, "
             f"whole sets"]
    width = max(map(len, results["bleu"]), default=0)
    for name, bleu in results["bleu"].items():
        paper = results["bleu_paper"].get(name)
        lines.append(f"  {name:{width}}  BLEU {bleu:5.2f}  chrF {results['chrf'][name]:5.2f}"
                     + (f"  (the paper's tokenized BLEU {paper:.2f})" if paper is not None else ""))
    join = os.path.join
    lines.append(f"files: {join(out, 'results.json')} (the scores), {join(out, 'model.npz')} (the model), "
                 f"{join(out, '<set>.hyp.' + tgt)} (the translations), {join(out, 'train_log.jsonl')} (the log)")
    return lines


def print_summary(lines):
    """The summary on stdout (where `cmd > file` puts it), flushed."""
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


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


def last_step(path):
    """The largest step a record of `path` (train_log.jsonl) names, or None (no file, no record)."""
    steps = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                    steps.append(rec["step"])
    except OSError:
        return None
    return max(steps) if steps else None


def cut_after(path, step):
    """Drop the records of `path` (train_log.jsonl) that a run resumed from `step` makes again: those of later steps
    (a run killed after its last checkpoint had gone on), and the end's records of `step` itself: its scores ("eval")
    and its training record between two --log-every records ("tail"). Rewritten atomically; returns how many were
    dropped: (of later steps, the end's scores, the end's training records); all 0: the file untouched."""
    if not os.path.isfile(path):
        return 0, 0, 0
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    kept, later, scores, tails = [], 0, 0, 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None             # not a record of ours: kept as it is
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            later += 1
        elif isinstance(rec, dict) and rec.get("step") == step and "eval" in rec:
            scores += 1
        elif isinstance(rec, dict) and rec.get("step") == step and rec.get("tail") is True:
            tails += 1
        else:
            kept.append(line)
    if later or scores or tails:
        atomic_write(path, lambda f: f.write(b"".join(kept)))
    return later, scores, tails


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


class Console:
    """The run's progress on stderr (rank 0 only): on a terminal, a progress bar (the updates of
    --max-steps, or under --time-budget the budget's time spent, with the update count and rate
    beside it); elsewhere (a file, a pipe) one plain line per log record, every --log-every
    updates. --quiet: neither. `line` prints a message (a validation result) in every case."""

    def __init__(self, state, max_steps, budget, quiet, enabled=True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled, self.budget, self.max_steps = enabled, budget, max_steps
        self.mode = "off" if quiet or not enabled else "bar" if on_terminal(self.stream) else "lines"
        self.bar = None
        self.t0, self.step0 = time.time(), state["step"]
        if self.mode == "bar":
            from tqdm import tqdm
            if budget:   # the bar is the budget's seconds; the postfix counts the updates
                self.bar = tqdm(initial=round(min(state["train_wall_s"], budget)), total=round(budget), desc="train",
                                file=self.stream, dynamic_ncols=True,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")
            else:
                self.bar = tqdm(initial=state["step"], total=max_steps or None, desc="train", unit="upd",
                                file=self.stream, dynamic_ncols=True)
        self.postfix = {}

    def update(self, step, elapsed):
        """After an update: `step` updates done, `elapsed` seconds of training since the run began."""
        if self.bar is None:
            return
        if self.budget:
            rate = (step - self.step0) / max(time.time() - self.t0, 1e-9)
            self.postfix.update(step=step, upd_s=f"{rate:.2f}")
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(round(min(elapsed, self.budget)) - self.bar.n)
        else:
            self.bar.update(1)

    def show(self, rec):
        """A training record of the log: the bar's postfix, or a plain line."""
        if self.bar is not None:
            self.postfix.update(loss=rec["loss"], ppl=rec["ppl"], lr=f"{rec['lr']:.2e}", tok_s=int(rec["tokens_per_s"]))
            if self.budget:
                self.postfix["step"] = rec["step"]
            self.bar.set_postfix(self.postfix)
        elif self.mode == "lines":   # a log file: where the run is, as the bar shows it on a terminal
            budget = f" of {self.budget:.0f}s" if self.budget else ""
            of = f"/{self.max_steps:,}" if self.max_steps else ""
            done = rec["step"] - self.step0
            left = ""
            if self.max_steps and not self.budget and done > 0:   # this start's pace over what the run has left
                secs = (time.time() - self.t0) / done * max(self.max_steps - rec["step"], 0)
                left = f", about {secs / 3600:.1f} h left" if secs >= 3600 else f", about {secs / 60:.0f} min left" \
                    if secs >= 60 else f", about {secs:.0f}s left"
            # loss: label-smoothed (what is minimised); nll: the plain one, whose exp is ppl
            self.line(f"train: step {rec['step']}{of} | epoch {rec['epoch']:.3f} | loss {rec['loss']:.3f} | nll "
                      f"{rec['nll']:.3f} | ppl {shown_ppl(rec['ppl'])} | lr {rec['lr']:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
                      f"{rec['wall_s']:.0f}s{budget}{left}")

    def line(self, text):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def line_from_a_signal_handler(self, text):
        """`line` for a signal handler: one unbuffered write (the handler may run while the main
        thread is inside a write to stderr), off the bar's line when a bar is drawn."""
        if not self.enabled:
            return
        line = f"{chr(10) if self.bar is not None else ''}{text}\n"
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):   # a stream of no file (a notebook's, io.StringIO): written to it
            self.stream.write(line)
            return
        os.write(fd, line.encode())

    def close(self):
        if self.bar is not None:
            self.bar.close()
