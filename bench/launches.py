#!/usr/bin/env python
"""Kernel launches of one training update, counted on the strict CuPy stand-in (no GPU needed).

    PYTHONPATH=tests MINITF_CUPY_MODULE=strict_cupy python bench/launches.py            # base: float32, --fp16, --bf16
    PYTHONPATH=tests MINITF_CUPY_MODULE=strict_cupy python bench/launches.py --by-name  # and which kernels
    PYTHONPATH=tests MINITF_CUPY_MODULE=strict_cupy python bench/launches.py --allocations  # and new arrays, by site
    PYTHONPATH=tests MINITF_CUPY_MODULE=strict_cupy python bench/launches.py --memory   # and the peak of live bytes

tests/strict_cupy.py counts what CuPy would launch for each call minitf makes (one kernel per
elementwise or reduction call, advanced index, assignment or conversion; CuPy matmul's copies and GEMM;
minitf's RawKernels; the cuBLAS calls; memsets as `cupy.zeros`), so this counts the launches of
the GPU code path on any machine. The structure decides the count, not the widths: the update is
the preset's layers, heads and stacks at width 64 (d_ff 128, 64 pieces) on a short batch, with
the step's second update counted (the first compiles and sets up). On a GPU, bench/gpu_report.py
and bench/gpu_ab.py count the kernels the profiler sees.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minitf  # noqa: E402
from minitf import backend  # noqa: E402
from bench.env import Env  # noqa: E402
from bench.flags import parser  # noqa: E402


MODES = (("float32", False), ("fp16", True), ("bf16", "bfloat16"))   # (name, count_update's fp16)


def _second_update(preset, fp16, env, around):
    """Runs two updates of `preset`'s structure at width 64 on the stand-in (the first compiles and sets
    up) and returns what `around` (a function of the update to run) gives for the second."""
    from bench.data import wmt_batch
    from bench.train_step import MinitfRunner
    if not hasattr(backend.cupy, "launches"):
        raise SystemExit("bench/launches.py counts on the strict CuPy stand-in: run it with PYTHONPATH=tests "
                         "MINITF_CUPY_MODULE=strict_cupy")
    with Env(env or {}):
        cfg = minitf.Config.preset(preset, vocab_size=64, d_model=64, d_ff=128)
        runner = MinitfRunner(cfg, "gpu", wmt_batch(cfg, 120), 1e-4, fp16)
        runner.step()
        return around(runner.step)


def count_update(preset="base", fp16=False, env=None):
    """({kernel name: launches}, total) of one update (forward, backward, Adam) of `preset`'s
    structure at width 64 on the stand-in; fp16: False (float32), True (--fp16) or "bfloat16"
    (--bf16); env: variables set for the count (e.g. a fusion off)."""
    cupy = backend.cupy

    def around(step):
        before = cupy.launches()
        step()
        return cupy.launches_between(before, cupy.launches())
    return _second_update(preset, fp16, env, around)


def count_allocations(preset="base", fp16=False, env=None):
    """({call site: arrays}, total): the device arrays of one update that take memory of their own
    (from CuPy's memory pool on a GPU), as count_update's update makes them."""
    def around(step):
        with backend.cupy.record_allocations() as sites:
            step()
        return sites, sum(sites.values())
    return _second_update(preset, fp16, env, around)


def peak_bytes(preset="base", fp16=False, env=None):
    """(bytes of the live device arrays before the update, the most they reach during it) for
    count_update's update: the memory pool's peak use at width 64, not a GPU's at the report's sizes."""
    def around(step):
        with backend.cupy.record_peak_bytes() as rec:
            step()
        return tuple(rec)
    return _second_update(preset, fp16, env, around)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--by-name", action="store_true", help="list the kernels launched, most launched first")
    ap.add_argument("--allocations", action="store_true",
                    help="also count the update's device arrays that take memory of their own (CuPy's pool on a "
                         "GPU), by call site")
    ap.add_argument("--memory", action="store_true",
                    help="also give the most bytes the update's live device arrays reach (at width 64), and those "
                         "live before it (the weights, their gradients, Adam's moments and scratch buffers, the "
                         "positional table; the float32 master weights of a 16-bit model; a few KB of kept buffers)")
    args = ap.parse_args(argv)
    for mode, fp16 in MODES:
        by_name, total = count_update(args.preset, fp16)
        print(f"launches per update: {args.preset} {mode} {total}")
        if args.by_name:
            for name, n in sorted(by_name.items(), key=lambda kv: -kv[1]):
                print(f"    {n:5d}  {name}")
        if args.allocations:
            sites, total = count_allocations(args.preset, fp16)
            print(f"allocations per update: {args.preset} {mode} {total}")
            for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                print(f"    {n:5d}  {site}")
        if args.memory:
            before, peak = peak_bytes(args.preset, fp16)
            print(f"peak live bytes per update: {args.preset} {mode} {peak:,} ({before:,} before it)")


if __name__ == "__main__":
    main()
