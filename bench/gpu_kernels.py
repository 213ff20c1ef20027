#!/usr/bin/env python
"""Where a GPU training step's time goes: minitf against PyTorch eager, kernel by kernel.

    python bench/gpu_kernels.py                       # base, float32 (TF32) and --fp16
    python bench/gpu_kernels.py --preset big --modes fp16 --top 40

The batch and runners are bench/gpu_report.py's too (bench/data.py's `wmt_batch`: at most 25,000 padded
tokens a side of WMT14-shaped lengths; bench/train_step.py's `make_runners`: the same weights in both). Each contender runs --steps steps under the
PyTorch profiler, whose CUPTI trace records every kernel of the process (CuPy's too). Printed per
contender: wall ms per step, GPU-busy ms per step (the union of kernel intervals: where it is far
below the wall time the step waits on the host, launches and Python), kernels per step, and the
kernels grouped by name, most time first, with their share of the summed kernel time.

Needs cupy and torch, on a CUDA GPU.
"""
import collections
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minitf  # noqa: E402
from minitf import backend  # noqa: E402
from bench.data import wmt_batch  # noqa: E402
from bench.train_step import make_runners  # noqa: E402
from bench.flags import parser  # noqa: E402


def kernel_intervals(prof):
    """(name, start_us, end_us) of every kernel the profiler saw on the device."""
    out = []
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            continue
        out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def busy_us(intervals):
    """Length of the union of the intervals."""
    total, end = 0.0, None
    for _, s, e in sorted(intervals, key=lambda x: x[1]):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def short(name, width=90):
    return name if len(name) <= width else name[:width - 3] + "..."


def profile(runner, steps, torch):
    from torch.profiler import ProfilerActivity, profile as tprofile
    for _ in range(2):          # warm-up: compiled kernels, memory pools
        runner.step()
    runner.sync()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        runner.sync()
        wall = time.perf_counter() - t0
    ivs = kernel_intervals(prof)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in ivs:
        by_name[name][0] += 1
        by_name[name][1] += e - s
    return {"wall_ms": wall * 1e3 / steps, "busy_ms": busy_us(ivs) / 1e3 / steps,
            "kernels": len(ivs) / steps, "by_name": by_name}


def top_kernels(res, steps, top):
    """The `top` kernel names by GPU time: [(name, ms per step, share of the summed kernel time, calls per step)]."""
    total = sum(t for _, t in res["by_name"].values()) or 1.0
    rows = sorted(res["by_name"].items(), key=lambda kv: -kv[1][1])[:top]
    return [(kname, t / 1e3 / steps, t / total, calls / steps) for kname, (calls, t) in rows]


def report(name, res, steps, top):
    print(f"\n--- {name}: wall {res['wall_ms']:.1f} ms/step (under the profiler), GPU busy {res['busy_ms']:.1f} ms/step, "
          f"{res['kernels']:.0f} kernels/step")
    print(f"{'ms/step':>8} {'share':>6} {'calls':>6}  kernel")
    for kname, ms, share, calls in top_kernels(res, steps, top):
        print(f"{ms:8.2f} {100 * share:5.1f}% {calls:6.0f}  {short(kname)}")


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--preset", default="base", choices=sorted(minitf.PRESETS))
    ap.add_argument("--modes", default="float32,fp16", help="comma-separated: float32 (TF32), fp16")
    ap.add_argument("--tokens", type=int, default=25000, help="padded tokens a side in the batch")
    ap.add_argument("--vocab", type=int, default=37000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"gpu_kernels: no GPU: {why}")
    import torch
    cfg = minitf.Config.preset(args.preset, vocab_size=args.vocab)
    batch = wmt_batch(cfg, args.tokens)
    print(f"{args.preset}: {len(batch[0])} sentences, padded source {batch[0].shape}, target {batch[1].shape}, "
          f"{int((batch[2] != cfg.pad_id).sum()):,} target tokens")
    for mode in args.modes.split(","):
        fp16 = mode == "fp16"
        m, t = make_runners(cfg, batch, 1e-4, fp16)
        for label, runner in (("minitf " + mode, m), ("torch " + mode, t)):
            report(label, profile(runner, args.steps, torch), args.steps, args.top)
        del m, t
        backend.cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
