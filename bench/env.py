"""Environment variables set for a block and restored after it: the benchmarks' switches (MINITF_FUSED_*, ...),
which minitf reads on every call, so one process can time the variants one after another."""
import os


class Env:
    """Sets the variables of `env` for the block, restores them after (unset where they were unset)."""

    def __init__(self, env):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
