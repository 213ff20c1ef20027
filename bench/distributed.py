#!/usr/bin/env python
"""Data-parallel cost on CPU ranks: step time, all-reduce time and bytes per update vs w, the ranks.

For each w it launches `mpiexec -n w` of this file in worker mode: every rank builds the same
model, takes a fixed random batch (--sentences x --len tokens a side), and times --rounds updates
as the training loop runs them (zero_grad, forward+loss, backward, all-reduce of the flat
gradient buffer, Adam), median over rounds after one warm-up; rank 0 prints one JSON line.
The processing rate counts all ranks' target tokens. Threads per rank: --threads (default
cores // w, so w ranks share the machine's cores as one process would use them all).

usage: python bench/distributed.py --preset small --ranks 1 2 --rounds 7
On several GPUs: add --device gpu (each rank takes its local GPU; NCCL all-reduce).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.shape import add_shape_flags, shape_overrides  # noqa: E402
from bench.flags import parser  # noqa: E402


def worker(args):
    import numpy as np
    from minitf import distributed
    from minitf.backend import synchronize
    from minitf.config import Config
    from minitf.model import Transformer
    from minitf.optim import Adam
    from minitf.schedule import NoamSchedule
    world = distributed.init()
    if args.device == "gpu" and world.size > 1:
        world.use_gpu()
    cfg = Config.preset(args.preset, vocab_size=args.vocab, **shape_overrides(args))
    model = Transformer(cfg, device=args.device, dtype="float32", seed=1)
    opt = Adam(model, lr=NoamSchedule(cfg.d_model, cfg.warmup, cfg.lr_factor))
    rng = np.random.default_rng(world.rank)
    src = rng.integers(4, args.vocab, (args.sentences, args.len))
    tgt = rng.integers(4, args.vocab, (args.sentences, args.len + 1))
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    times = {"step": [], "compute": [], "allreduce": []}
    for r in range(args.rounds + 1):
        world.barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        model.forward_loss(src, tgt_in, tgt_out)
        model.backward(loss_weight=1.0 / world.size)
        synchronize(model.xp)
        t1 = time.perf_counter()
        world.allreduce_sum(model.flat_grads)
        synchronize(model.xp)
        t2 = time.perf_counter()
        opt.step()
        synchronize(model.xp)
        t3 = time.perf_counter()
        if r:
            times["step"].append(t3 - t0)
            times["compute"].append(t1 - t0)
            times["allreduce"].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    every = world.allgather(med)
    if world.rank == 0:
        slowest = {k: max(m[k] for m in every) for k in med}
        tokens = world.size * args.sentences * args.len
        print(json.dumps({"ranks": world.size, "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
                          "preset": args.preset, "parameters": model.num_parameters(),
                          "allreduce_bytes": int(model.flat_grads.nbytes),
                          "step_ms": round(1000 * slowest["step"], 1),
                          "compute_ms": round(1000 * slowest["compute"], 1),
                          "allreduce_ms": round(1000 * slowest["allreduce"], 2),
                          "target_tokens_per_s": round(tokens / slowest["step"], 1)}), flush=True)


def main():
    p = parser(__doc__)
    p.add_argument("--preset", default="small")
    add_shape_flags(p)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, help="BLAS threads per rank (default: cores // ranks)")
    p.add_argument("--sentences", type=int, default=32, help="sentences per rank and update")
    p.add_argument("--len", type=int, default=24, help="tokens per sentence and side")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    for n in args.ranks:
        threads = args.threads or max(1, (os.cpu_count() or 1) // n)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker"] + \
              [a for a in sys.argv[1:] if a != "--worker"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
