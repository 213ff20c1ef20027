#!/usr/bin/env python
"""The gradient sums alone: `column_sums_into` (and `column_sums_relu_into`) at a training step's sizes.

    python bench/column_sums.py                          # float32, --fp16, --bf16 at 19,760 rows
    python bench/column_sums.py --against old_kernels.py # and the kernels of another copy of minitf/kernels.py
    python bench/column_sums.py --smoke                  # tiny sizes (checks this script, e.g. under the CuPy stand-in)

The sums a `base` update adds into its gradient buffers, each one launch (kernels.py): a post-norm LayerNorm's three
($dy \\odot \\hat x$ with $\\hat x$ computed again from the sum, mean and rstd; $dy$; the sublayer's output gradient)
and a pre-norm one's two, over D = 512 columns; a bias over 512 and over 2,048; a self-attention's stacked q|k|v
bias gradients (three planes of 512) and a cross-attention's k|v (two); a feed-forward's first bias with ReLU's
backward (2,048). Random inputs in the mode's dtype, --rows rows (19,760: the target rows of bench/gpu_report.py's
batch). Each case is launched --calls times between two device synchronisations, in --rounds rounds; printed: the
median microseconds a launch. With --against FILE (another version of minitf/kernels.py, e.g. `git show
REV:minitf/kernels.py > old_kernels.py`), its CUDA source is compiled too and launched with the same arguments,
the two alternating round by round: printed beside, with the ratio (above 1, this version is faster) and whether
the two versions' sums have the same bits. The kernels' argument lists and launch geometry (threads a block, slabs
of rows) must be the same in both versions: the other version is launched as this one launches, and the script
refuses a file where they differ. A launch
that takes the GPU less time than the host takes to make it (~10-20 us of Python and CuPy) is timed at the host's
rate, the same for both versions.
"""
import importlib.util
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minitf import backend, kernels  # noqa: E402
from bench.rounds import alternate  # noqa: E402
from bench.flags import at_least_one, parser  # noqa: E402

DTYPES = {"float32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def cases(xp, dtype, n, rng):
    """[(name, a function that makes one launch adding into its buffers, the buffers)]: the step's sums."""
    a = kernels.accum_dtype(dtype)

    def rand(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def out(width):
        return xp.zeros(width, dtype=dtype)

    d, f = 512, 2048
    s = rand(n, d)
    mean = s.astype(a).mean(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt(((s.astype(a) - mean) ** 2).mean(axis=1, keepdims=True) + a(1e-5))
    cache = kernels.NormCache(s, mean, rstd.astype(a))
    dy, sub, wide, planes3, planes2 = rand(n, d), rand(n, d), rand(n, f), rand(3, n, d), rand(2, n, d)
    relu_dy, relu_y = rand(n, f), xp.maximum(rand(n, f), 0)
    ln3, ln2, b1, b2, q3, q2, r1 = out(3 * d), out(2 * d), out(d), out(f), out(3 * d), out(2 * d), out(f)
    return [
        ("LayerNorm, 3 sums, 512", lambda: kernels.column_sums_pair(dy, cache, ln3[:d], ln3[d:2 * d], sub, ln3[2 * d:]),
         ln3),
        ("LayerNorm, 2 sums, 512", lambda: kernels.column_sums_pair(dy, cache, ln2[:d], ln2[d:]), ln2),
        ("bias, 512", lambda: kernels.column_sums(dy, out=b1), b1),
        ("bias, 2048", lambda: kernels.column_sums(wide, out=b2), b2),
        ("q|k|v biases, 3 x 512", lambda: kernels.column_sums_planes(planes3, q3[:d], d), q3),
        ("k|v biases, 2 x 512", lambda: kernels.column_sums_planes(planes2, q2[:d], d), q2),
        # relu_dy is zeroed where relu_y is not > 0 at the first call; the later calls do the same work
        ("ReLU + bias, 2048", lambda: kernels.relu_backward_sums(relu_dy, relu_y, r1), r1),
    ]


def other_kernels(path):
    """The module of another copy of minitf/kernels.py (its CUDA source), imported beside minitf's."""
    spec = importlib.util.spec_from_file_location("minitf._kernels_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differing_kernels(other, env=None):
    """The kernels of minitf that `other` (other_kernels' module) lacks or declares with other arguments than minitf's
    launchers pass: only a copy where this is empty runs under them. A kernel minitf launches only under a switch that
    is off by default (kernels.OPT_IN_KERNELS) may be missing there unless `env` (a variant's variables) switches it
    on: a copy from before it was written still times the defaults. A kernel of TRAILING declared without its last
    argument runs where `env` sets MINITF_ATTN_PITCH=0."""
    theirs, env = getattr(other, "SIGNATURES", {}), env or {}

    def needed(name):
        switch = kernels.OPT_IN_KERNELS.get(name)
        return switch is None or env.get(switch) == "1"

    def same(name, sig):
        return theirs.get(name) == sig or (tight_rows(other, name) and env.get("MINITF_ATTN_PITCH") == "0")
    return [name for name, sig in kernels.SIGNATURES.items() if not same(name, sig) and (name in theirs or needed(name))]


# Kernels that took a trailing argument later, which a copy from before reads as a count it already had:
# {name: (the position of the new argument, the position of the one it then equals)}. The softmax kernels' rows lie
# `pitch` apart (kernels.row_pitch), where a copy from before takes them n apart: such a copy runs under minitf's
# launchers where MINITF_ATTN_PITCH=0 makes every pitch n, and is launched without the trailing argument.
TRAILING = {"masked_softmax_warp": (11, 4), "softmax_backward_warp": (5, 4), "masked_softmax": (10, 3),
            "softmax_backward": (4, 3)}


def tight_rows(module, name=None):
    """Whether `module` (a copy of minitf/kernels.py) declares kernel `name` (None: any of TRAILING) as minitf does
    but for TRAILING's last argument."""
    theirs = getattr(module, "SIGNATURES", {})
    names = TRAILING if name is None else [name] if name in TRAILING else []
    return any(n in theirs and theirs[n] == kernels.SIGNATURES[n][:-1] for n in names)


def same_geometry(module, rows):
    """Why `module` (another kernels.py) would not launch its sums as this one does, or None."""
    for name in ("COLUMN_BLOCK", "COLUMN_BLOCKS", "COLUMN_MIN_ROWS"):
        if getattr(module, name, None) != getattr(kernels, name):
            return f"{name} is {getattr(module, name, None)} there, {getattr(kernels, name)} here"
    for d in (512, 2048):
        if module._slabs(rows, d) != kernels._slabs(rows, d):
            return f"{rows} rows of {d} take {module._slabs(rows, d)} (slabs, rows a slab) there, {kernels._slabs(rows, d)} here"
    return None


# Kernels whose grid is their rows over the rows a block takes, a count a copy of minitf/kernels.py may set otherwise:
# {name: the position of the rows among its arguments}. The warp softmax took a row a warp before it took
# WARP_ROW_RUN (a copy without that name: 1).
ROWS_ARG = {"masked_softmax_warp": 3, "softmax_backward_warp": 3}


def rows_a_block(module):
    """The rows a block of the warp softmax takes in `module` (a copy of minitf/kernels.py, or kernels itself)."""
    return module.WARP_ROWS * getattr(module, "WARP_ROW_RUN", 1)


def launcher(module):
    """kernels.LAUNCH's launch function for the kernels compiled from `module`'s source (minitf's own: None). A kernel
    of ROWS_ARG is launched with `module`'s geometry (its blocks over the rows), which minitf's launchers work out
    with their own."""
    if module is None:
        return kernels._cupy_launch
    compiled, functions, strip = {}, {}, {}
    rows_each = rows_a_block(module)

    def launch(name, dtype, grid, block, args):
        key = (kernels.dtype_name(dtype), name)
        if key not in functions:     # checked once a kernel, when it is first looked up (not on every launch)
            tight = tight_rows(module, name)
            if module.SIGNATURES.get(name) != kernels.SIGNATURES.get(name) and not tight:
                raise SystemExit(f"column_sums: {name} takes other arguments in the --against file "
                                 f"({module.SIGNATURES.get(name)} against {kernels.SIGNATURES.get(name)})")
            if key[0] not in compiled:
                compiled[key[0]] = backend.cupy.RawModule(code=module.source(dtype), options=("-std=c++14",))
            functions[key] = compiled[key[0]].get_function(name)
            strip[key] = TRAILING[name] if tight else None
        if strip[key] is not None:
            new, same = strip[key]
            if int(args[new]) != int(args[same]):
                raise SystemExit(f"column_sums: {name} of the --against file takes rows n apart, and this launch's "
                                 f"are {int(args[new])} apart: time that file with MINITF_ATTN_PITCH=0")
            args = args[:new] + args[new + 1:]
        if name in ROWS_ARG:
            grid, block = -(-int(args[ROWS_ARG[name]]) // rows_each), 32 * module.WARP_ROWS
        functions[key]((grid,), (block,), args)
    return launch


@contextmanager
def using(launch, buf):
    """kernels' launches made by `launch` (a version's) inside the block, `buf` (the case's buffers) zeroed first."""
    saved, kernels.LAUNCH["launch"] = kernels.LAUNCH["launch"], launch
    try:
        buf.fill(0)
        yield
    finally:
        kernels.LAUNCH["launch"] = saved


def same_bits(fn, buf, versions):
    """Whether one launch of each version, into zeroed buffers, gives the same bits."""
    got = []
    for launch in versions.values():
        with using(launch, buf):
            fn()
        got.append(backend.to_numpy(buf).view(np.uint16 if buf.dtype.itemsize == 2 else f"u{buf.dtype.itemsize}"))
    return all(np.array_equal(got[0], g) for g in got[1:])


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--modes", default="float32,fp16,bf16", help="comma-separated: float32, fp16, bf16")
    p.add_argument("--rows", type=int, default=19760)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=100, help="launches timed a round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--against", metavar="FILE", help="another version of minitf/kernels.py to time beside this one")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    at_least_one(p, args, "rows", "rounds", "calls")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"column_sums: no GPU: {why}")
    if args.against and not os.path.isfile(args.against):
        sys.exit(f"column_sums: --against {args.against}: no such file")
    if args.smoke:
        args.rows, args.rounds, args.calls, args.warmup = 70, 1, 2, 1
    versions = {"this": launcher(None)}
    if args.against:
        other = other_kernels(args.against)
        why = same_geometry(other, args.rows)
        if why:
            sys.exit(f"column_sums: --against {args.against} launches its sums another way ({why})")
        versions["against"] = launcher(other)
    xp = backend.cupy
    print(f"{args.rows} rows; microseconds a launch, median of {args.rounds} rounds of {args.calls}")
    for mode in args.modes.split(","):
        dtype = backend.dtype_named(DTYPES[mode])
        try:
            backend.check_gpu_dtype(dtype)
        except backend.DeviceError as e:
            print(f"  {mode}: skipped ({e})")
            continue
        if kernels._module(dtype) is None:
            sys.exit(f"column_sums: the kernels did not compile for {DTYPES[mode]}: "
                     f"{kernels.COMPILE_ERRORS[kernels.dtype_name(dtype)]}")
        for name, fn, buf in cases(xp, dtype, args.rows, np.random.default_rng(0)):
            times = alternate({v: (lambda launch=launch: using(launch, buf), fn) for v, launch in versions.items()},
                              args.rounds, args.calls, args.warmup, sync=lambda: backend.synchronize(xp))
            us = {v: statistics.median(ts) * 1e6 for v, ts in times.items()}
            line = f"  {mode:8s} {name:24s} {us['this']:9.1f} us"
            if "against" in versions:
                line += (f"  against {us['against']:9.1f} us x{us['against'] / us['this']:.3f}  "
                         f"same bits: {'yes' if same_bits(fn, buf, versions) else 'no'}")
            print(line)


if __name__ == "__main__":
    main()
