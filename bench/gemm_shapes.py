#!/usr/bin/env python
"""The step's matrix products alone: every distinct cuBLAS call of one training update, as minitf makes it and
as PyTorch makes the same product: the time a call takes, and the host's time to issue one.

    python bench/gemm_shapes.py                  # base at bench/gpu_report.py's batch: float32 (TF32), --fp16, --bf16
    python bench/gemm_shapes.py --modes float32  # one mode
    python bench/gemm_shapes.py --smoke          # tiny sizes (checks this script, e.g. under the CuPy stand-in)

One `base` update (bench/gpu_ab.py's batch: 568 sentences, 19,760 target tokens) runs with `gemm.matmul`
recorded: each call's operands (rows, columns, leading dimension, batch stride), transposes, alpha, beta, batch
count and dtype. Each distinct call is then made again on arrays of its geometry (random values) --calls times
between two device synchronisations, in --rounds rounds alternating with PyTorch's same product
(`addmm_`/`baddbmm_` on views with the same strides, in place, with the same alpha and beta; TF32 for float32 as
minitf's CUPY_TF32); printed per call, the most time an update first: its calls an update, the median
microseconds a call (the wall time of the --calls calls between the two synchronisations, divided by --calls: a
product the GPU takes longer over than the host takes to issue it is timed at the GPU's pace) and the TFLOP/s that
makes, PyTorch's, and the host's microseconds to issue one
(--calls calls issued after a synchronisation, none waited for: what a call costs a step that the host sets).
Then the update's whole: the products' ms (the sum over calls), their TFLOP and the rate, both engines. The
yardstick, timed the same way first: a square --square x --square x --square product in the mode's dtype (8192: as
near the tensor cores' peak as cuBLAS gets on an H100), each product's rate also given as a share of minitf's rate
for it ("of square").

What it answers: how near the hardware the update's products run (float32's step is bound by its TF32 GEMMs), and
whether minitf's cuBLAS calls (cublasGemmEx, cublasGemmStridedBatchedEx) take longer than PyTorch's choice for
the same product (PyTorch goes through cuBLASLt) on the GPU or on the host.
"""
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")   # read at the first float32 product: TF32 float32 matmuls, as torch's below

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minitf  # noqa: E402
from minitf import backend, gemm, kernels  # noqa: E402
from bench.data import wmt_batch  # noqa: E402
from bench.rounds import alternate  # noqa: E402
from bench.flags import at_least_one, known_modes, parser  # noqa: E402
from bench.gpu_ab import cuda_torch  # noqa: E402
from bench.launches import MODES as LAUNCH_MODES  # noqa: E402
from bench.train_step import MinitfRunner  # noqa: E402

MODES = dict(LAUNCH_MODES)   # --modes -> MinitfRunner's fp16


def geometry(m):
    """(rows, cols, ld, batch stride) of a gemm.Mat, or of a C-contiguous array taken whole (as gemm.matmul
    takes it)."""
    if type(m) is gemm.Mat:
        return m.rows, m.cols, m.ld, m.stride
    r, c = m.shape[-2], m.shape[-1]
    return r, c, c, r * c


@contextmanager
def recording(calls):
    """gemm.matmul counted into calls {(dtype, trans_a, trans_b, alpha, beta, batch, a, b, c geometry): count}
    while inside (gemm.py's own callers look `matmul` up in the module, so they are counted too)."""
    real = gemm.matmul

    def counted(a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, batch=1):
        arr = c.array if type(c) is gemm.Mat else c
        key = (arr.dtype.name if hasattr(arr.dtype, "name") else str(arr.dtype), bool(trans_a), bool(trans_b),
               float(alpha), float(beta), int(batch), geometry(a), geometry(b), geometry(c))
        calls[key] = calls.get(key, 0) + 1
        return real(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, batch=batch)
    gemm.matmul = counted
    try:
        yield calls
    finally:
        gemm.matmul = real


def update_calls(cfg, batch, fp16):
    """The distinct gemm.matmul calls of one update (the runner's second: the first compiles) -> {key: count}."""
    runner = MinitfRunner(cfg, "gpu", batch, 1e-4, fp16)
    runner.step()
    runner.sync()
    calls = {}
    with recording(calls):
        runner.step()
        runner.sync()
    return calls


def span(geom, batch):
    """Elements a matrix batch of this geometry touches from its first."""
    rows, cols, ld, stride = geom
    return (batch - 1) * stride + (rows - 1) * ld + cols


def flops(key):
    """2 x rows x inner x cols x batch of a call."""
    _, ta, _, _, _, batch, a, _, c = key
    inner = a[0] if ta else a[1]
    return 2.0 * c[0] * c[1] * inner * batch


def label(key):
    """'rows x inner x cols' of the product op(a) @ op(b), its batch, transposes and beta."""
    _, ta, tb, alpha, beta, batch, a, _, c = key
    inner = a[0] if ta else a[1]
    ops = ("a^T" if ta else "a") + " @ " + ("b^T" if tb else "b")
    return (f"{c[0]} x {inner} x {c[1]}" + (f" x{batch}" if batch > 1 else "") + f"  {ops}"
            + (f"  alpha {alpha:.3g}" if alpha != 1.0 else "") + ("  +=" if beta else ""))


def operands(key, rng):
    """Host float32 values (a, b, c) for the call `key`: each as many as its geometry touches."""
    batch, geoms = key[5], key[6:]
    return [(rng.standard_normal(span(g, batch)) * 0.1).astype(np.float32) for g in geoms]


_GENERATORS = {}   # one device generator a process (CuPy's sets up its cuRAND states when it is made)


def minitf_call(cp, key, host=None):
    """(a function making the call `key` with gemm.matmul, c's array): on device copies of `host` (operands()), or
    where None on values drawn on the device (uniform in [-0.1, 0.1): the output layer's operands are GBs)."""
    dtype, ta, tb, alpha, beta, batch, ga, gb, gc = key
    dt = backend.dtype_named(dtype)
    if host is None:
        gen = _GENERATORS.get(id(cp)) or _GENERATORS.setdefault(id(cp), cp.random.default_rng(0))
        a, b, c = (((gen.random(span(g, batch), dtype=np.float32) - 0.5) * 0.2).astype(dt) for g in (ga, gb, gc))
    else:
        a, b, c = (cp.asarray(x).astype(dt) for x in host)
    ma, mb, mc = (gemm.Mat(x, *g) for x, g in ((a, ga), (b, gb), (c, gc)))
    return (lambda: gemm.matmul(ma, mb, mc, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta, batch=batch)), c


def torch_call(torch, key, host=None, device="cuda"):
    """(a function making the same product with PyTorch, c's tensor): addmm_ (batch 1) or baddbmm_ on views with
    the call's strides of copies of `host` (or of values drawn on the device), written in place into c's view."""
    dtype, ta, tb, alpha, beta, batch, ga, gb, gc = key
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}[dtype]
    if host is None:
        bases = [torch.rand(span(g, batch), device=device).sub_(0.5).mul_(0.2).to(tdt) for g in (ga, gb, gc)]
    else:
        bases = [torch.from_numpy(x).to(device=device, dtype=tdt, copy=True) for x in host]   # never host itself

    def view(base, geom):
        rows, cols, ld, stride = geom
        if batch == 1:
            return torch.as_strided(base, (rows, cols), (ld, 1))
        return torch.as_strided(base, (batch, rows, cols), (stride, ld, 1))
    a, b, c = (view(x, g) for x, g in zip(bases, (ga, gb, gc)))
    a = a.transpose(-1, -2) if ta else a
    b = b.transpose(-1, -2) if tb else b
    if batch == 1:
        return (lambda: c.addmm_(a, b, beta=beta, alpha=alpha)), bases[2]
    return (lambda: c.baddbmm_(a, b, beta=beta, alpha=alpha)), bases[2]


def issue_us(fn, calls, sync):
    """The host's microseconds to issue one call: `calls` calls after a synchronisation, none waited for."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    sync()
    return t / calls * 1e6


ROUND_S = 2e-3   # a round's calls of a product: enough for about this much work between the two synchronisations


def calls_for(fn, least, sync, most=500):
    """Calls of fn a round: at least `least`, and enough for ~ROUND_S of work, so that the synchronisations around a
    round (a fixed cost) are spread thin over a small product's calls (one call's time, synchronised, after one
    call that compiled or chose whatever it needed)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return max(least, min(most, math.ceil(ROUND_S / max(time.perf_counter() - t0, 1e-9))))


def time_calls(calls, args, torch):
    """[(key, count, {engine: (GPU us a call, host us to issue one)})] for the distinct calls."""
    cp = backend.cupy

    def sync():
        backend.synchronize(cp)
        if torch is not None:
            torch.cuda.synchronize()
    out = []
    for key, count in calls.items():
        fns = {"minitf": minitf_call(cp, key)[0]}
        if torch is not None:
            fns["torch"] = torch_call(torch, key)[0]
        k = calls_for(fns["minitf"], args.calls, sync)
        times = alternate({name: (nullcontext, fn) for name, fn in fns.items()}, args.rounds, k, warmup=1, sync=sync)
        out.append((key, count, {name: (statistics.median(times[name]) * 1e6,
                                        statistics.median(issue_us(fn, k, sync) for _ in range(3)))
                                 for name, fn in fns.items()}))
        del fns
    return out


def square(dtype, n):
    """The key of a square n x n x n product in dtype: the yardstick of what cuBLAS makes of a large product."""
    g = (n, n, n, n * n)
    return (dtype, False, False, 1.0, 0.0, 1, g, g, g)


def report(mode, rows, top, yard):
    """Prints one mode's table and totals; yard: (n, {engine: (us, host us)}) of a square n x n x n product.
    Returns {engine: ms an update}."""
    total_calls = sum(count for _, count, _ in rows)
    engines = list(rows[0][2]) if rows else ["minitf"]
    tf = sum(flops(key) * count for key, count, _ in rows) / 1e12
    n, yard_t = yard
    peak = flops(square("", n)) / yard_t["minitf"][0] / 1e6      # TFLOP/s of minitf's square product
    print(f"## {mode}: {total_calls} GEMMs an update, {len(rows)} distinct, {tf:.3f} TFLOP")
    print(f"  a square {n} x {n} x {n} product: " + ", ".join(
        f"{name} {flops(square('', n)) / yard_t[name][0] / 1e6:.1f} TFLOP/s" for name in engines))
    head = "  calls  minitf us  TFLOP/s  of square  host us" + (
        "   torch us  TFLOP/s  host us  torch/minitf" if "torch" in engines else "")
    print(head + "  product (rows x inner x cols)")
    rows = sorted(rows, key=lambda r: -r[1] * r[2]["minitf"][0])
    for key, count, t in rows[:top]:
        line = f"  {count:5d}"
        for name in engines:
            us, host = t[name]
            rate = flops(key) / us / 1e6
            line += f"  {us:9.1f}  {rate:7.1f}" + (f"  {rate / peak:8.1%}" if name == "minitf" else "") + f"  {host:7.1f}"
        if "torch" in engines:
            line += f"  x{t['torch'][0] / t['minitf'][0]:.3f}"
        print(line + "  " + label(key))
    if len(rows) > top:
        print(f"  ... {len(rows) - top} more")
    totals = {}
    for name in engines:
        ms = sum(count * t[name][0] for _, count, t in rows) / 1e3
        host = sum(count * t[name][1] for _, count, t in rows) / 1e3
        totals[name] = ms
        print(f"  all {name}: {ms:.2f} ms an update, each call timed alone ({tf / ms * 1e3 if ms else 0:.1f} TFLOP/s), "
              f"{host:.2f} ms of the host's to issue them")
    return totals


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--preset", default="base", choices=sorted(minitf.PRESETS))
    p.add_argument("--modes", default="float32,fp16,bf16", help="comma-separated: float32 (TF32), fp16, bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="calls of each product a round, at least (a small product "
                   "gets more: about 2 ms of work a round, so the synchronisations around it cost little a call)")
    p.add_argument("--top", type=int, default=30, help="products listed a mode (the totals count every one)")
    p.add_argument("--square", type=int, default=8192, help="the yardstick: a square product of this size in the "
                   "mode's dtype, timed as the others (each product's TFLOP/s is given as a share of its rate)")
    p.add_argument("--no-torch", action="store_true", help="no PyTorch column")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    at_least_one(p, args, "rounds", "calls", "top", "square")
    modes = known_modes(p, args.modes, LAUNCH_MODES)
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"gemm_shapes: no GPU: {why}")
    torch, why = cuda_torch(args.no_torch)
    if torch is not None:   # minitf's numerics: float32 products on TF32 where minitf's are, float32 sums throughout
        torch.backends.cuda.matmul.allow_tf32 = kernels.tf32()
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    elif not args.no_torch:
        print(f"PyTorch column absent: {why}")
    preset, vocab, tokens = ("tiny", 64, 256) if args.smoke else (args.preset, 37000, 25000)
    if args.smoke:
        args.rounds, args.calls = 1, 2
    cfg = minitf.Config.preset(preset, vocab_size=vocab)
    batch = wmt_batch(cfg, tokens)
    print(f"{preset}: {len(batch[0])} sentences, {int((batch[2] != cfg.pad_id).sum())} target tokens; "
          f"median of {args.rounds} rounds of at least {args.calls} calls (about 2 ms of work a round)")
    out = {}
    n = 64 if args.smoke else args.square
    for mode in modes:
        calls = update_calls(cfg, batch, MODES[mode])
        dtype = next(iter(calls))[0]
        yard = time_calls({square(dtype, n): 1}, args, torch)[0][2]
        out[mode] = report(mode, time_calls(calls, args, torch), args.top, (n, yard))
    return out


if __name__ == "__main__":
    main()
