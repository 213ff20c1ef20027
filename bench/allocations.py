#!/usr/bin/env python
"""What an array from CuPy's memory pool costs the host, against a view of a buffer kept between updates.

    python bench/allocations.py              # a step's activation shapes in float16 and float32
    python bench/allocations.py --smoke      # tiny sizes (checks this script, e.g. under the CuPy stand-in)

A training update takes ~420 device arrays of its own from CuPy's memory pool (`PYTHONPATH=tests
MINITF_CUPY_MODULE=strict_cupy python bench/launches.py --allocations` counts them by call site): the products'
outputs, the LayerNorms' outputs and caches, the heads' packing. A workspace kept between updates (a buffer per
call site, as large as the largest batch's array) would hand out views of itself instead. This times, on the host,
--calls arrays of each shape made and dropped three ways: `cupy.empty` (the pool: a cached block found and given
back), a slice of a kept buffer reshaped (`buf[:n].reshape(shape)`), and `cupy.ndarray(shape, dtype,
memptr=buf.data + offset)` (a view made directly at a place in the buffer; not on the CuPy stand-in). Printed: the
median microseconds an array of --rounds rounds, and what the difference from the pool comes to for --per-update
arrays an update. Each is its best case: the pool finds the block just given back (an update holds ~420 of mixed
sizes), and the kept buffer is one. Nothing here
waits for the GPU: these are the host's costs, which set a `--fp16` step where the host is slower than the GPU.
"""
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minitf import backend  # noqa: E402
from bench.rounds import alternate  # noqa: E402
from bench.flags import at_least_one, parser  # noqa: E402

SHAPES = ((19760, 512), (19760, 2048), (3, 19760, 512))   # a [rows, D] activation, a feed-forward's, stacked q|k|v


def ways(cp, shape, dtype):
    """{name: a function that makes one array of `shape` and drops it}; the kept buffers made here."""
    n = int(np.prod(shape))
    buf = cp.empty(n, dtype=dtype)
    out = {"pool": lambda: cp.empty(shape, dtype=dtype),
           "slice": lambda: buf[:n].reshape(shape)}
    try:
        cp.ndarray(shape, dtype, memptr=buf.data + 0)
        out["memptr"] = lambda: cp.ndarray(shape, dtype, memptr=buf.data + 0)   # + offset: a new pointer each time
    except TypeError as e:         # the CuPy stand-in does not emulate memptr=
        print(f"  memptr: skipped ({e})")
    return out


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="arrays made a round")
    p.add_argument("--per-update", type=int, default=417, help="arrays an update takes from the pool")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    at_least_one(p, args, "rounds", "calls", "per_update")
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"allocations: no GPU: {why}")
    shapes = ((70, 8), (3, 70, 8)) if args.smoke else SHAPES
    if args.smoke:
        args.rounds, args.calls = 2, 20
    cp = backend.cupy
    print(f"microseconds an array (host), median of {args.rounds} rounds of {args.calls}; "
          f"ms an update for {args.per_update} arrays")
    for dtype in (np.float16, np.float32):
        for shape in shapes:
            fns = ways(cp, shape, dtype)
            times = alternate({name: (nullcontext, fn) for name, fn in fns.items()}, args.rounds, args.calls)
            us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            line = f"  {np.dtype(dtype).name:8s} {str(list(shape)):16s} pool {us['pool']:6.2f} us"
            for name in ("slice", "memptr"):
                if name in us:
                    saved = (us["pool"] - us[name]) * args.per_update / 1e3
                    line += f"  {name} {us[name]:6.2f} us (saves {saved:+.2f} ms an update)"
            print(line)


if __name__ == "__main__":
    main()
