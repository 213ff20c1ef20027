"""What a training run tells: OUT/train_log.jsonl (one JSON record a line) and the console's
progress bar. Only rank 0 writes either; on the other ranks both are silent."""
import json
import sys


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class TrainLog:
    """OUT/train_log.jsonl, appended to (a resumed run continues the file), flushed after
    every record; `enabled=False` (ranks other than 0) writes nothing."""

    def __init__(self, path, enabled=True):
        self.path = path
        self.f = open(path, "a") if enabled else None

    def write(self, rec):
        if self.f is not None:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None


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
