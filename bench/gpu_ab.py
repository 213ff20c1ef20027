#!/usr/bin/env python
"""One GPU code path against another in the same process: same weights, same batch, same card.

    python bench/gpu_ab.py                         # base, float32 (TF32) and --fp16: every fusion on vs off
    python bench/gpu_ab.py --presets base,big --out runs/ab
    python bench/gpu_ab.py --modes bf16 --strong         # --bf16 against AMP bfloat16, eager and strong
    python bench/gpu_ab.py --smoke                 # tiny sizes (checks this script, e.g. under the CuPy stand-in)

The variants differ only in environment variables that minitf reads on every call (MINITF_HOST_CHECK: when
each variant's runner is set up, under that variant's environment), or in the CUDA they run: KERNELS=FILE in a
variant runs the kernels of FILE, another copy of minitf/kernels.py (e.g. `git show REV:minitf/kernels.py >
old_kernels.py`), compiled beside minitf's and launched by minitf's own Python, so a change of the CUDA alone
(every kernel taking the arguments it took; the warp softmax launched over the rows a warp of FILE's own,
bench/column_sums.py's ROWS_ARG) is timed against the code before it in one process
(`--variant name=VAR=value[,VAR=value]`; default: `now`, the step as it is, against `before`,
every fusion switched off: MINITF_CUBLAS=0 and MINITF_FUSED_{RELU,ADAM,GRADS,EMBED,NORM,VEC,LOSS,LNWARP}=0; the
warp softmax has no switch; attention on packed rows, off by default, is `--variant attn=MINITF_FUSED_ATTN=1`), so
one process runs them all, alternating, with PyTorch eager beside
them (bench/train_step.py's TorchRunner, same weights) when torch with CUDA is there, and with
--strong PyTorch as a user choosing it for speed would run it (scaled_dot_product_attention,
logits on the rows with a loss only, fused Adam; --torch-compile adds torch.compile). For each
preset and mode it prints and writes (--out):

  same     the loss and every gradient of one step of each variant against the first, on the
           same weights and batch: ||g - g0|| / ||g0|| over the flat gradient buffer; with
           --float64 also against the float64 model's (the same code in float64 on the GPU)
  time     the step (forward, backward, Adam, the update's end as training makes it) in ms: median of
           --rounds alternating rounds of --steps-per-round steps each, target tokens/s, and the ratio to
           the first variant and to PyTorch
  kernels  under the PyTorch profiler (CUPTI records CuPy's kernels too): kernels per step,
           GPU-busy ms per step, and the --top kernels by time (bench/gpu_kernels.py)

A variant other than the first that raises in a preset and mode's comparison or timed rounds (a first run of new
kernels, say; another copy of the kernels that does not build) is printed as FAILED with its error and left out of
that mode (ab.json: the mode's "failed", its error on one line), and the other variants go on; where the first
variant or PyTorch fails, the whole preset and mode is printed and written as FAILED, and the other modes still run.
Neither holds where the error left the CUDA context unusable (an illegal address does: every later call fails too;
run such variants in a process of their own).

The batch is bench/gpu_report.py's (bench/data.py's `wmt_batch`): at most 25,000 padded tokens a side of
WMT14-shaped lengths.
"""
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minitf  # noqa: E402
from minitf import backend  # noqa: E402
from minitf import kernels as minitf_kernels  # noqa: E402
from bench.column_sums import TRAILING, differing_kernels, launcher, other_kernels, tight_rows  # noqa: E402
from bench.data import wmt_batch  # noqa: E402
from bench.env import Env  # noqa: E402
from bench.flags import known_modes, parser  # noqa: E402
from bench.launches import MODES  # noqa: E402
from bench.train_step import MinitfRunner, timed_round, torch_runner_like  # noqa: E402


# the step as it is, against the step with every fusion switched off (CuPy's matmul and separate passes)
DEFAULT_VARIANTS = ["now=", "before=MINITF_CUBLAS=0,MINITF_FUSED_RELU=0,MINITF_FUSED_ADAM=0,MINITF_FUSED_GRADS=0,"
                             "MINITF_FUSED_EMBED=0,MINITF_FUSED_NORM=0,MINITF_FUSED_VEC=0,MINITF_FUSED_LOSS=0,"
                             "MINITF_FUSED_LNWARP=0"]


def log(msg):
    print(f"[gpu_ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_variant(text):
    """'name=VAR=value,VAR2=value' -> (name, {VAR: value, ...})."""
    name, _, rest = text.partition("=")
    env = {}
    for part in filter(None, rest.split(",")):
        var, eq, value = part.partition("=")
        if not eq or not var:
            raise SystemExit(f"gpu_ab: --variant {text!r}: expected name=VAR=value[,VAR=value]")
        env[var] = value
    if not name:
        raise SystemExit(f"gpu_ab: --variant {text!r}: the variant needs a name")
    return name, env


KERNELS = "KERNELS"   # a variant's KERNELS=FILE: the CUDA of another copy of minitf/kernels.py
_LAUNCHERS = {}       # FILE -> (its module, kernels.LAUNCH's launch function: compiled on first use, then kept)


def kernels_from(path, env=None):
    """The launch function that runs the kernels of `path` (another minitf/kernels.py) where minitf launches its own,
    once every kernel there that a variant's `env` launches is found to take the arguments minitf's launchers pass."""
    if path not in _LAUNCHERS:
        if not os.path.isfile(path):
            raise SystemExit(f"gpu_ab: {KERNELS}={path}: no such file")
        other = other_kernels(path)
        _LAUNCHERS[path] = (other, launcher(other))
    other, launch = _LAUNCHERS[path]
    differ = differing_kernels(other, env)
    if differ and set(differ) <= set(TRAILING) and tight_rows(other):
        raise SystemExit(f"gpu_ab: {KERNELS}={path}: that file's softmax takes rows n apart, where minitf's launchers "
                         f"give them kernels.row_pitch apart: time it with MINITF_ATTN_PITCH=0 in the same variant")
    if differ:
        raise SystemExit(f"gpu_ab: {KERNELS}={path}: kernels there take other arguments than minitf's launchers "
                         f"pass, or are missing ({', '.join(differ)}); only a change of the CUDA alone is timed so")
    return launch


def check_kernel_files(variants):
    """Reads and checks each variant's KERNELS=FILE (kernels_from) before anything runs; one with
    MINITF_FUSED_ATTN=1 also needs FILE's tensor-core attention to take blocks of several warps, as minitf's
    launchers give them (MMA_WARPS there; a copy from before it existed takes a warp a block)."""
    for name, env in variants:
        if KERNELS in env:
            kernels_from(env[KERNELS], env)
            if env.get("MINITF_FUSED_ATTN") == "1" and not hasattr(_LAUNCHERS[env[KERNELS]][0], "MMA_WARPS"):
                raise SystemExit(f"gpu_ab: {name}: {KERNELS}={env[KERNELS]} with MINITF_FUSED_ATTN=1: that file's "
                                 f"tensor-core attention takes a warp a block, minitf's launchers give it up to "
                                 f"{minitf_kernels.MMA_WARPS}: time that file without MINITF_FUSED_ATTN=1")


class VariantEnv(Env):
    """A variant's environment for the block (bench.env.Env) and, with KERNELS=FILE in it, FILE's kernels in place of
    minitf's."""

    def __init__(self, env):
        env = dict(env)
        self.path = env.pop(KERNELS, None)
        super().__init__(env)

    def __enter__(self):
        super().__enter__()
        if self.path is not None:
            launch = kernels_from(self.path, dict(os.environ))   # the variant's variables are set by now
            self.launch, minitf_kernels.LAUNCH["launch"] = minitf_kernels.LAUNCH["launch"], launch

    def __exit__(self, *exc):
        if self.path is not None:
            minitf_kernels.LAUNCH["launch"] = self.launch
        super().__exit__(*exc)


def cuda_torch(no_torch):
    """(torch, None) where PyTorch is installed and sees a GPU, else (None, why it is left out); (None, ...) too with
    no_torch (--no-torch)."""
    if no_torch:
        return None, "--no-torch"
    try:
        import torch
    except ImportError as e:
        return None, str(e)
    return (torch, None) if torch.cuda.is_available() else (None, "torch.cuda.is_available() is False")


def one_step_grads(runner):
    """Loss and flat gradients of one forward and backward (no update) on the runner's batch, as training
    takes them (Seq2Seq.forward_backward)."""
    m = runner.model
    m.zero_grad()
    loss = float(m.forward_backward(*runner.batch, loss_weight=runner.scale))
    return loss, backend.to_numpy(m.flat_grads).astype(np.float64) / runner.scale


class Float64Runner(MinitfRunner):
    """The same model in float64 on the GPU: the reference the variants' gradients are held to."""

    def __init__(self, cfg, batch):
        self.name, self.cfg, self.batch, self.scale = "float64", cfg, batch, 1.0
        self.model = minitf.Transformer(cfg, device="gpu", dtype="float64", seed=0)
        self.model.train()


def _failure(e):
    """An exception as one line of text (a compiler's log runs over many), at most 300 characters."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _drop(failed, name, e):
    """A variant that raised leaves the mode: its error in `failed`, printed with the traceback; the column sums'
    ticket counters made afresh (a launch the emulator stopped part-way leaves some above 0; a GPU's stopped launch
    leaves the context unusable anyway) and the pool's free blocks returned."""
    failed[name] = _failure(e)
    print(f"## {name}: FAILED: {failed[name]}", flush=True)
    traceback.print_exc()
    minitf_kernels._COUNTERS.clear()
    backend.cupy.get_default_memory_pool().free_all_blocks()


def compare(cfg, batch, fp16, variants, float64, failed):
    """Loss and gradients of each variant against the first, and against float64 (float64=True). A variant but the
    first that raises is left out, its error in `failed` (name -> error), and the others go on; the first's error
    ends the mode."""
    out, ref, ref64 = {}, None, None
    if float64:
        runner = Float64Runner(cfg, batch)
        ref64 = one_step_grads(runner)
        del runner
        backend.cupy.get_default_memory_pool().free_all_blocks()
    for name, env in variants:
        runner = None
        try:
            with VariantEnv(env):
                runner = MinitfRunner(cfg, "gpu", batch, 1e-4, fp16, name=name)
                loss, g = one_step_grads(runner)
        except Exception as e:
            if ref is None:
                raise
            runner = None   # its arrays freed before the next variant is made
            _drop(failed, name, e)
            continue
        if ref is None:
            ref = (loss, g)
        out[name] = {"loss": loss, "loss_rel_diff": abs(loss - ref[0]) / abs(ref[0]),
                     "grad_rel_diff": float(np.linalg.norm(g - ref[1]) / np.linalg.norm(ref[1])),
                     "finite": bool(np.isfinite(g).all())}
        if ref64 is not None:
            out[name]["grad_rel_err_vs_float64"] = float(np.linalg.norm(g - ref64[1]) / np.linalg.norm(ref64[1]))
            out[name]["loss_rel_err_vs_float64"] = abs(loss - ref64[0]) / abs(ref64[0])
        del runner
    return out


def timing(cfg, batch, fp16, variants, args, torch, failed):
    """Each variant's step (those not in `failed`), then PyTorch's, in alternating rounds. A variant but the first that
    raises (made, or in a round) is dropped with its error in `failed`; the first's error (or PyTorch's) ends the
    mode. The kernel tables' and host profiles' runs are not guarded so."""
    runners = []
    for name, env in variants:
        if name in failed:
            continue
        try:
            with VariantEnv(env):
                runners.append((env, MinitfRunner(cfg, "gpu", batch, 1e-4, fp16, name=name)))
        except Exception as e:
            if not runners:
                raise
            _drop(failed, name, e)
    if torch is not None and not args.no_torch_runs:
        runners.append(({}, torch_runner_like(runners[0][1], "gpu", batch, 1e-4, fp16)))
        if args.strong:
            runners.append(({}, torch_runner_like(runners[0][1], "gpu", batch, 1e-4, fp16, strong=True,
                                                  compile=args.torch_compile)))
    k = args.steps_per_round
    first_runner = runners[0][1]

    def round_of(env, r, times=None):
        """A round of r's steps; False where r is a variant but the first and raised (then dropped)."""
        try:
            with VariantEnv(env):
                t = timed_round(r, k)[0] / k
        except Exception as e:
            if r is first_runner or not isinstance(r, MinitfRunner):   # the first variant, or PyTorch
                raise
            _drop(failed, r.name, e)
            return False
        if times is not None:
            times[r.name].append(t)
        return True
    for _ in range(args.warmup):
        runners = [(env, r) for env, r in runners if round_of(env, r)]
    times = {r.name: [] for _, r in runners}
    for _ in range(args.rounds):
        runners = [(env, r) for env, r in runners if round_of(env, r, times)]
    times = {name: ts for name, ts in times.items() if name not in failed}
    tokens = int((batch[2] != cfg.pad_id).sum())
    res = {}
    first = runners[0][1].name
    for name, ts in times.items():
        med = statistics.median(ts)
        res[name] = {"step_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
                     "max_ms": round(max(ts) * 1e3, 2), "tgt_tokens_per_s": round(tokens / med)}
    for name in res:
        res[name]["speed_vs_" + first] = round(res[first]["step_ms"] / res[name]["step_ms"], 3)
        for base in ("torch", "torch-strong", "torch-strong-compiled"):
            if base in res:
                res[name]["speed_vs_" + base] = round(res[base]["step_ms"] / res[name]["step_ms"], 3)
    kernels = {}
    if torch is not None and args.kernel_steps:
        from bench.gpu_kernels import profile, top_kernels
        for env, r in runners:
            if args.profile and r.name not in args.profile.split(","):
                continue
            with VariantEnv(env):
                p = profile(r, args.kernel_steps, torch)
            kernels[r.name] = {"wall_ms": round(p["wall_ms"], 2), "busy_ms": round(p["busy_ms"], 2),
                               "kernels": round(p["kernels"]),
                               "top": [[k[:80], round(ms, 3), round(share, 4), round(calls, 1)]
                                       for k, ms, share, calls in top_kernels(p, args.kernel_steps, args.top)]}
    if args.host_profile:
        env, r = runners[0]
        with VariantEnv(env):
            kernels.setdefault(r.name, {})["host"] = host_profile(r, args.host_profile, args.top)
    for _, r in runners:
        del r
    backend.cupy.get_default_memory_pool().free_all_blocks()
    return res, kernels


def host_profile(runner, steps, top):
    """Where the host's time goes in `steps` steps: cProfile's functions by their own time (ms per step),
    with the calls per step and the time including callees. The profiler slows each Python call, so the
    shares, not the sums, are what to read."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    runner.sync()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        runner.step()
    runner.sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"wall_ms_per_step": round(1e3 * wall / steps, 2),
            "functions": [[f"{Path(f).name}:{line} {fn}", round(nc / steps, 1), round(1e3 * tt / steps, 3),
                           round(1e3 * ct / steps, 3)] for (f, line, fn), (cc, nc, tt, ct, _) in rows]}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--variant", action="append", help="name=VAR=value[,VAR=value] (repeat; the first is the baseline "
                   "of the ratios)")
    p.add_argument("--presets", default="base")
    p.add_argument("--modes", default="float32,fp16",
                   help="comma-separated: float32 (TF32), fp16 (--fp16), bf16 (--bf16, against AMP bfloat16)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-round", type=int, default=1, metavar="STEPS",
                   help="consecutive steps timed per round, the time divided by STEPS (1: each step alone, synchronised "
                        "before and after; several: the GPU's work of one step can overlap the host's of the next, "
                        "as in training: what ending an update without a sync buys, MINITF_HOST_CHECK=1 against 0)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kernel-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--no-torch", action="store_true", help="do not import torch (no PyTorch runners, no kernel tables)")
    p.add_argument("--no-torch-runs", action="store_true",
                   help="time no PyTorch beside the variants; torch's profiler still makes the kernel tables")
    p.add_argument("--strong", action="store_true", help="also PyTorch as a user choosing it for speed would run it: "
                   "scaled_dot_product_attention, logits on the rows with a loss, fused Adam")
    p.add_argument("--torch-compile", action="store_true", help="the strong PyTorch's loss through torch.compile")
    p.add_argument("--float64", action="store_true", help="also hold each variant's gradients to the float64 model's")
    p.add_argument("--profile", default="", help="comma-separated runners to profile (default: every one)")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also STEPS steps of the first variant under cProfile: the host's time by function")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    modes = known_modes(p, args.modes, MODES)
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    check_kernel_files(variants)
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"gpu_ab: no GPU: {why}")
    torch = cuda_torch(args.no_torch)[0]
    presets = ["tiny"] if args.smoke else args.presets.split(",")
    vocab, tokens = (64, 256) if args.smoke else (37000, 25000)
    if args.smoke:
        args.rounds, args.warmup, args.kernel_steps = 2, 1, 0
    report = {"variants": dict(variants), "cupy": getattr(backend.cupy, "__version__", "?"),
              "torch": getattr(torch, "__version__", None), "presets": presets, "modes": modes,
              "rounds": args.rounds, "steps_per_round": args.steps_per_round, "warmup": args.warmup, "results": {}}
    try:
        props = backend.cupy.cuda.runtime.getDeviceProperties(0)
        report["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as e:
        report["gpu"] = f"unknown ({type(e).__name__})"
    log(f"{report['gpu']}: {', '.join(n for n, _ in variants)}")
    for preset in presets:
        cfg = minitf.Config.preset(preset, vocab_size=vocab)
        batch = wmt_batch(cfg, tokens)
        for mode in modes:
            fp16 = dict(MODES)[mode]   # False, True (--fp16) or "bfloat16" (--bf16)
            key = f"{preset} {mode}"
            try:
                log(f"{key}: same ...")
                failed = {}   # variant -> its error (a variant but the first; the others go on)
                entry = {"same": compare(cfg, batch, fp16, variants, args.float64, failed)}
                log(f"{key}: time ...")
                entry["time"], entry["kernels"] = timing(cfg, batch, fp16, variants, args, torch, failed)
                if failed:   # a variant that failed in the timing after its comparison: out of both
                    entry["failed"] = failed
                    entry["same"] = {n: v for n, v in entry["same"].items() if n not in failed}
            except Exception as e:   # one mode's failure (a first run of new kernels) does not end the others
                report["results"][key] = {"error": _failure(e), **({"failed": failed} if failed else {})}
                print(f"## {key}: FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                _write(args, report)
                continue
            report["results"][key] = entry
            print(f"## {key} ({len(batch[0])} sentences, {int((batch[2] != cfg.pad_id).sum())} target tokens)")
            for name, t in entry["time"].items():
                s = entry["same"].get(name, {})
                k = entry["kernels"].get(name, {})
                print(f"  {name:8s} {t['step_ms']:9.2f} ms ({t['min_ms']:.2f}-{t['max_ms']:.2f})  "
                      f"{t['tgt_tokens_per_s']:>9,} tok/s  x{t.get('speed_vs_' + variants[0][0], 1):.3f}"
                      + "".join(f"  vs {b} x{t['speed_vs_' + b]:.3f}" for b in ("torch", "torch-strong",
                                                                                   "torch-strong-compiled")
                                if "speed_vs_" + b in t)
                      + (f"  grad diff {s['grad_rel_diff']:.2e}" if s else "")
                      + (f"  vs float64 {s['grad_rel_err_vs_float64']:.2e}" if "grad_rel_err_vs_float64" in s else "")
                      + (f"  kernels {k['kernels']} busy {k['busy_ms']} ms" if "kernels" in k else ""), flush=True)
            for name, error in entry.get("failed", {}).items():
                print(f"  {name:8s} FAILED: {error}", flush=True)
            _write(args, report)
    for key, entry in report["results"].items():
        for name, k in entry.get("kernels", {}).items():
            if "top" in k:
                print(f"### {key} {name}: top kernels (ms/step, share of kernel time, calls/step)")
                for row in k["top"]:
                    print(f"    {row[1]:8.3f} {row[2]:6.1%} {row[3]:6.1f}  {row[0]}")
            if "host" in k:
                print(f"### {key} {name}: host time under cProfile, {k['host']['wall_ms_per_step']} ms a step "
                      f"(own ms/step, calls/step, with callees ms/step)")
                for fn, calls, own, cum in k["host"]["functions"]:
                    print(f"    {own:8.3f} {calls:7.1f} {cum:9.3f}  {fn}")
    return report


def _write(args, report):
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "ab.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
