#!/usr/bin/env python
"""Everything measured on a GPU in one command, printed as a Markdown section for docs/benchmarks.md.

    python bench/gpu_report.py                 # one H100/H200: the last section shortened to end within --budget
    python bench/gpu_report.py --out runs/gpu  # also writes report.md and report.json there
    python bench/gpu_report.py --smoke         # tiny sizes: checks the script itself (CI, strict CuPy stand-in)

Needs numpy, cupy, sentencepiece, sacrebleu; torch with CUDA for the PyTorch columns (absent,
and the report says why, without it or with a CPU-only build); no network and no data beside the repository. Sections, each timed and each
reported even when another fails:

  suite   `pytest tests/test_gpu.py tests/test_nvrtc.py` on this GPU: passed / failed / skipped
  launches  on the strict CuPy stand-in only (--smoke with MINITF_CUPY_MODULE=strict_cupy): the kernel
          launches of one `base` update, float32, --fp16 and --bf16, one line each (bench/launches.py)
  step    one training step of `base` and `big` on one batch of at most 25,000 padded tokens a side (~19,800
          target tokens; bench/data.py's `wmt_batch`) with WMT14-shaped lengths (source pieces normal with mean 33 and deviation 10, target 1.05x), the same weights and
          batch in one process: minitf float32 (TF32 matmuls, CUPY_TF32=1) against PyTorch eager
          with TF32, minitf `--fp16` against PyTorch AMP (autocast float16 + GradScaler), and minitf
          `--bf16` against AMP bfloat16 (autocast bfloat16, no scaler); in each mode also a strong
          PyTorch (scaled_dot_product_attention, logits on the rows with a loss, fused Adam; --no-strong
          leaves it out): target tokens/s (median of alternating rounds, each of --steps-per-round consecutive
          steps between two synchronisations: 1, a step alone, by default; several let one step's GPU work overlap
          the host's work on the next, as in training), MFU against the GPU's dense tensor-core
          peak (bf16/fp16 for --fp16 and --bf16, TF32 for float32), peak memory, and, under the PyTorch
          profiler (CUPTI sees CuPy's kernels too), kernel launches, device-to-host copies and
          synchronisations per step (the step as training makes it: its outcome decided on the device and
          copied back asynchronously, read an update later; tests/test_gpu_standin.py counts no sync copy)
  kernels where one `base` step's GPU time goes, float32 and --fp16, minitf and PyTorch (bench/gpu_kernels.py):
          wall and GPU-busy ms per step, kernels per step, the largest kernels by name (needs
          PyTorch with CUDA, whose profiler records the kernels; skipped, and said so, without it)
  beam    beam 4 on 3,000 sentences of WMT14-shaped length (random `base` weights, so every
          output runs to its cap: source length + 5), sentences/s
  wmt     `train_wmt.py --device gpu --preset base` on a 4.5M-pair corpus it builds (a small
          corpus of random words prepared once, a real cache, its token arrays then replaced by 4.5M random pairs with
          the lengths above, by bench/data.py's make_synthetic): updates/s over a few minutes of
          training and the projected hours for the paper's 100k updates
"""
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")   # read at the first float32 product: TF32 float32 matmuls, as torch's below
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import minitf  # noqa: E402
from minitf import backend  # noqa: E402
from minitf.fileio import atomic_write_bytes  # noqa: E402
from bench.data import make_synthetic, wmt_batch, wmt_lengths  # noqa: E402
from bench import suite  # noqa: E402
from bench.flags import at_least_one, parser  # noqa: E402
from bench.launches import MODES  # noqa: E402
from bench.train_step import make_runners, step_flops, timed_round  # noqa: E402

# dense (no sparsity) tensor-core peaks, TFLOP/s, from NVIDIA's data sheets: (tf32, fp16/bf16)
PEAKS = [("H200", (494.7, 989.4)), ("H100 NVL", (417.5, 835.0)), ("H100 PCIe", (378.0, 756.0)),
         ("H100", (494.7, 989.4)), ("A100", (156.0, 312.0)), ("L40S", (183.0, 362.0))]


def log(msg):
    print(f"[gpu_report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- sections
def section_env():
    cupy = backend.cupy
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "numpy": np.__version__, "cupy": getattr(cupy, "__version__", "?"), "cpu_count": os.cpu_count()}
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["gpu_memory_gib"] = round(props.get("totalGlobalMem", 0) / 2 ** 30, 1)
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        env["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:  # the stand-in, or an old CuPy
        env.setdefault("gpu", f"unknown ({type(e).__name__})")
    try:
        import torch
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
    except ImportError:
        env["torch"] = None
    env["peak_tflops"] = next((p for key, p in PEAKS if key in env.get("gpu", "")), None)
    return env


def section_suite(args):
    cmd = suite.command()
    t0 = time.time()
    # (tests/conftest.py drops this script's CUPY_TF32)
    r = subprocess.run(cmd, cwd=ROOT, env=os.environ | suite.ENV, capture_output=True, text=True,
                       timeout=args.suite_timeout)
    text = r.stdout + r.stderr
    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"command": " ".join(["python", *cmd[1:]]), "rc": r.returncode, "counts": suite.counts(text),
            "failures": failures[:20], "seconds": round(time.time() - t0, 1)}


def profile_step(runner, torch):
    """Kernel launches, device-to-host copies and synchronisations of one step, from the PyTorch
    profiler's CUPTI trace (which records every kernel of the process, CuPy's included)."""
    from torch.profiler import ProfilerActivity, profile
    runner.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step()
        runner.sync()
    kernels = d2h = syncs = 0
    for e in prof.events():
        name = e.name
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_device and "Memcpy DtoH" in name:
            d2h += 1
        elif on_device and not name.startswith(("Memcpy", "Memset")):
            kernels += 1
        elif not on_device and re.search(r"(cuda|cu)(Stream|Device|Ctx|Event)Synchronize", name):
            syncs += 1
    return {"kernels": kernels, "d2h_copies": d2h, "syncs": syncs - 1}   # less runner.sync() above, ours


def measure_pair(cfg, batch, fp16, args, torch):
    """minitf against torch (same weights, same batch), rounds alternating; per contender:
    tokens/s, step ms, peak memory MiB and the profile of one step."""
    cupy = backend.cupy
    cupy.get_default_memory_pool().free_all_blocks()
    out = {}
    if torch is not None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    runners = make_runners(cfg, batch, args.lr, fp16, with_torch=torch is not None, strong=not args.no_strong)
    for r in runners:
        for _ in range(args.warmup_rounds):
            timed_round(r, args.steps_per_round)
    times = {r.name: [] for r in runners}
    for _ in range(args.rounds):
        for r in runners:
            times[r.name].append(timed_round(r, args.steps_per_round)[0] / args.steps_per_round)
    tgt_tokens = int((batch[2] != cfg.pad_id).sum())
    for r in runners:
        med = statistics.median(times[r.name])
        out[r.name] = {"step_ms": round(med * 1e3, 2), "tgt_tokens_per_s": round(tgt_tokens / med),
                       "dtype": getattr(r, "dtype", "amp" if fp16 else "tf32")}
    out["minitf"]["peak_mib"] = round(cupy.get_default_memory_pool().total_bytes() / 2 ** 20)
    if torch is not None:
        out["torch"]["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
        for r in runners:
            try:
                out[r.name].update(profile_step(r, torch))
            except Exception as e:
                out[r.name]["profile_error"] = f"{type(e).__name__}: {e}"[:200]
        for name in (r.name for r in runners[1:]):   # torch, torch-strong
            key = "ratio_minitf_over_" + name.replace("-", "_")
            out[key] = round(out["minitf"]["tgt_tokens_per_s"] / out[name]["tgt_tokens_per_s"], 3)
    return out


def cuda_torch():
    """(torch, None) when PyTorch with CUDA is importable, else (None, why the PyTorch columns are absent)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} has no usable CUDA (a CPU-only build, or no GPU it can see)"
    return torch, None


def section_step(args, env):
    torch, why = cuda_torch()
    results = {} if torch is not None else {"torch_absent": why}
    for preset in args.presets:
        cfg = minitf.Config.preset(preset, vocab_size=args.vocab)
        batch = wmt_batch(cfg, args.step_tokens)
        src, tgt_in, tgt_out = batch
        flops = step_flops(cfg, (src != cfg.pad_id).sum(1), (tgt_out != cfg.pad_id).sum(1))[0]
        res = {"sentences": len(src), "src_tokens": int((src != cfg.pad_id).sum()),
               "tgt_tokens": int((tgt_out != cfg.pad_id).sum()), "padded": [list(src.shape), list(tgt_in.shape)],
               "gflop_per_step": round(flops / 1e9, 1)}
        for mode, fp16 in MODES:
            log(f"step: {preset} {mode}")
            pair = measure_pair(cfg, batch, fp16, args, torch)
            peak = env["peak_tflops"][1 if fp16 else 0] * 1e12 if env.get("peak_tflops") else None
            for name in ("minitf", "torch", "torch-strong"):
                if name in pair and peak:
                    pair[name]["mfu"] = round(flops / (pair[name]["step_ms"] / 1e3) / peak, 4)
            res[mode] = pair
        results[preset] = res
    return results


def section_kernels(args):
    torch, why = cuda_torch()
    if torch is None:
        return {"skipped": f"needs PyTorch with CUDA (its profiler records the kernels): {why}"}
    from bench.gpu_kernels import profile, top_kernels
    cfg = minitf.Config.preset(args.presets[0], vocab_size=args.vocab)
    batch = wmt_batch(cfg, args.step_tokens)
    backend.cupy.get_default_memory_pool().free_all_blocks()
    out = {"preset": args.presets[0], "steps": args.kernel_steps, "modes": {}}
    for mode, fp16 in KERNEL_MODES:
        log(f"kernels: {args.presets[0]} {mode}")
        tables = out["modes"][mode] = {}
        for runner in make_runners(cfg, batch, args.lr, fp16):
            res = profile(runner, args.kernel_steps, torch)
            tables[runner.name] = {"wall_ms": round(res["wall_ms"], 2), "busy_ms": round(res["busy_ms"], 2),
                                   "kernels": round(res["kernels"]),
                                   "top": [[k, round(ms, 3), round(share, 4), round(calls, 1)]
                                           for k, ms, share, calls in top_kernels(res, args.kernel_steps,
                                                                                  args.kernel_top)]}
            del runner
        backend.cupy.get_default_memory_pool().free_all_blocks()
    return out


KERNEL_MODES = (("float32", False), ("fp16", True))   # the kernel tables: TF32 and AMP float16 against PyTorch's
TABLE_ROWS = 12      # the kernel tables' rows in report.md (report.json keeps each engine's 40 largest)


def kernel_tables(k):
    """The markdown of the kernels section: a table per mode, minitf's largest kernels beside PyTorch's."""
    lines = []
    for mode, tables in k["modes"].items():
        m, t = tables["minitf"], tables["torch"]
        lines += [f"**Where a step's GPU time goes** (`{k['preset']}`, {mode}, {k['steps']} steps under the PyTorch "
                  f"profiler, `python bench/gpu_kernels.py` for more): minitf {m['wall_ms']} ms per step, the GPU "
                  f"busy {m['busy_ms']} ms of it, {m['kernels']} kernels; PyTorch {t['wall_ms']} ms, busy "
                  f"{t['busy_ms']} ms, {t['kernels']} kernels.", "",
                  "| minitf kernel | ms per step | share | calls | PyTorch kernel | ms per step | share | calls |",
                  "|---|---|---|---|---|---|---|---|"]
        for a, b_ in zip(m["top"][:TABLE_ROWS], t["top"][:TABLE_ROWS]):
            lines.append(f"| `{a[0][:60]}` | {a[1]:.2f} | {_pct(a[2])} | {a[3]:g} | `{b_[0][:60]}` | {b_[1]:.2f} | "
                         f"{_pct(b_[2])} | {b_[3]:g} |")
        lines.append("")
    return lines


def section_launches(args):
    """Kernel launches of one `base` update counted on the strict CuPy stand-in (bench/launches.py);
    on a GPU the step section's profiler counts the kernels instead."""
    if not hasattr(backend.cupy, "launches"):
        return {"skipped": "counted on the strict CuPy stand-in only; the step section counts a GPU's kernels"}
    from bench.launches import count_update
    out = {}
    for mode, fp16 in MODES:
        by_name, total = count_update("base", fp16)
        out[f"base {mode}"] = {"launches": total, "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]))}
    return out


def section_beam(args):
    from minitf.translate import translate_ids
    cfg = minitf.Config.preset(args.beam_preset, vocab_size=args.vocab)
    model = minitf.Transformer(cfg, device="gpu", seed=0).eval()
    rng = np.random.default_rng(1)
    lens = wmt_lengths(rng, args.beam_sentences)[0]
    src = [list(rng.integers(4, cfg.vocab_size, n)) + [cfg.eos_id] for n in lens]
    translate_ids(model, src[:64], beam_size=4, max_len_b=args.beam_extra)     # warm-up: kernels, memory pool
    backend.synchronize(model.xp)
    t0 = time.perf_counter()
    out = translate_ids(model, src, beam_size=4, max_len_b=args.beam_extra)
    backend.synchronize(model.xp)
    dt = time.perf_counter() - t0
    return {"preset": args.beam_preset, "sentences": len(src), "mean_src_len": round(float(np.mean(lens)) + 1, 1),
            "out_tokens": int(sum(len(h) for h in out)), "seconds": round(dt, 2),
            "sentences_per_s": round(len(src) / dt, 1), "max_len": f"source + {args.beam_extra}"}


def write_small_corpus(folder, n, n_valid, seed=0):
    """n pairs of random 'words' (a 2,000-word lexicon, lengths ~25 words): enough for SentencePiece."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(2000)]
    for split, m in (("train", n), ("val", n_valid)):
        for lang in ("en", "de"):
            lines = (" ".join(lexicon[i] for i in rng.integers(0, 2000, rng.integers(5, 45))) for _ in range(m))
            (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n")


def section_wmt(args):
    work = Path(tempfile.mkdtemp(prefix="minitf-gpu-wmt-"))
    try:
        write_small_corpus(work, args.wmt_seed_pairs, args.wmt_valid)
        cache = work / "cache"
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "minitf", "prepare", "--train", str(work / "train"), "--valid",
                            str(work / "val"), "--src", "en", "--tgt", "de", "--vocab-size", str(args.vocab),
                            "--cache-dir", str(cache), "--quiet"], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"prepare failed: {r.stderr[-500:]}")
        folder = next(p for p in cache.iterdir() if (p / "manifest.json").exists())
        manifest = json.loads((folder / "manifest.json").read_text())
        make_synthetic(str(folder), manifest, args.wmt_pairs)
        built = time.time() - t0
        log(f"wmt: corpus of {args.wmt_pairs:,} pairs built in {built:.0f}s; training {args.wmt_seconds:.0f}s")
        out = work / "run"
        cmd = [sys.executable, "train_wmt.py", "--train", str(work / "train"), "--valid", str(work / "val"),
               "--src", "en", "--tgt", "de", "--vocab-size", str(args.vocab), "--cache-dir", str(cache),
               "--preset", args.wmt_preset, "--device", "gpu", "--out", str(out), "--quiet", "--log-every",
               str(args.wmt_log_every),
               "--valid-every", "0", "--max-steps", "0", "--time-budget", str(args.wmt_seconds),
               "--save-every", "1000000", "--beam", "1", "--average-last", "1", "--keep-last", "1"]
        if args.fp16:
            cmd.append("--fp16")
        t1 = time.time()
        try:   # stopped after the time budget's checkpoint: the final evaluation is not part of this
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.wmt_seconds + 120)
        except subprocess.TimeoutExpired:
            pass
        logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
                  if '"tokens_per_s"' in line] if (out / "train_log.jsonl").exists() else []
        if len(logged) < 2:
            raise RuntimeError(f"fewer than 2 log lines after {time.time() - t1:.0f}s: {r.stderr[-800:]}")
        first, last = logged[0], logged[-1]
        rate = (last["step"] - first["step"]) / (last["wall_s"] - first["wall_s"])
        return {"pairs": args.wmt_pairs, "preset": args.wmt_preset, "fp16": args.fp16, "build_s": round(built),
                "updates": last["step"], "train_wall_s": last["wall_s"], "updates_per_s": round(rate, 3),
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in logged[1:] or logged),
                "hours_for_100k": round(100_000 / rate / 3600, 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- report
def markdown(rep):
    env = rep["env"]
    switches = ", ".join(f"{k}={v}" for k, v in rep.get("switches", {}).items())
    switches = f" with {switches}" if switches else ""
    lines = [f"### One GPU: {env.get('gpu')} ({env['date'][:10]})", "",
             f"`{rep.get('command', 'python bench/gpu_report.py')}`{switches}: GPU {env.get('gpu')} "
             f"({env.get('gpu_memory_gib', '?')} GiB), CUDA runtime "
             f"{env.get('cuda_runtime', '?')} / driver {env.get('cuda_driver', '?')}, CuPy {env.get('cupy')}, PyTorch "
             f"{env.get('torch') or 'absent'}, NumPy {env.get('numpy')}, Python {env.get('python')}, "
             f"{env.get('cpu_count')} CPU cores; {rep['total_s']:.0f} s in all.", ""]
    for name, sec in rep["sections"].items():
        if "error" in sec:
            lines += [f"- **{name}**: failed after {sec.get('seconds', '?')} s: `{sec['error']}`", ""]
    s = rep["sections"].get("suite", {})
    if "counts" in s:
        lines += [f"**GPU test suite** (`{s['command']}`, {s['seconds']} s): " + ", ".join(
            f"{v} {k}" for k, v in s["counts"].items()) + ("" if not s["failures"] else "; " + "; ".join(
                f"`{f}`" for f in s["failures"])), ""]
    st = rep["sections"].get("step", {})
    if st and "error" not in st:
        k = rep.get("steps_per_round", 1)
        rounds = "a step alone" if k == 1 else f"{k} consecutive steps"
        lines += ["**Training step** (one batch of WMT14-shaped lengths, the same weights in all; median of "
                  f"alternating rounds of {rounds}, a step's share; MFU against the dense tensor-core peak of the mode; PyTorch is eager, "
                  "strong PyTorch runs SDPA, logits on the rows with a loss and fused Adam; PyTorch's peak memory "
                  "is with both its models resident):", "",
                  "| preset | batch (target tokens) | mode | minitf tok/s | PyTorch tok/s | minitf / PyTorch | strong "
                  "PyTorch tok/s | minitf / strong | MFU minitf / PyTorch | peak MiB minitf / PyTorch | kernels per step "
                  "minitf / PyTorch | D2H copies, syncs minitf / PyTorch |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for preset, res in st.items():
            if not isinstance(res, dict) or "float32" not in res:
                continue
            for mode, _ in MODES:
                m, t, ts = res[mode]["minitf"], res[mode].get("torch", {}), res[mode].get("torch-strong", {})
                label = {"float32": "float32 (TF32) vs eager TF32", "fp16": "--fp16 vs AMP + GradScaler",
                         "bf16": "--bf16 vs AMP bfloat16"}[mode]
                lines.append(
                    f"| {preset} | {res['sentences']} sentences, {res['tgt_tokens']:,} | {label} | "
                    f"{_num(m['tgt_tokens_per_s'])} | {_num(t.get('tgt_tokens_per_s'))} | "
                    f"{res[mode].get('ratio_minitf_over_torch', '-')} | {_num(ts.get('tgt_tokens_per_s'))} | "
                    f"{res[mode].get('ratio_minitf_over_torch_strong', '-')} | "
                    f"{_pct(m.get('mfu'))} / {_pct(t.get('mfu'))} | {m.get('peak_mib', '-')} / {t.get('peak_mib', '-')} | "
                    f"{m.get('kernels', '-')} / {t.get('kernels', '-')} | {m.get('d2h_copies', '-')}, "
                    f"{m.get('syncs', '-')} / {t.get('d2h_copies', '-')}, {t.get('syncs', '-')} |")
        lines.append("")
        if st.get("torch_absent"):
            lines += [f"The PyTorch columns are absent: {st['torch_absent']}.", ""]
    la = rep["sections"].get("launches", {})
    if la and "skipped" not in la and "error" not in la:
        lines += ["**Kernel launches per update** (counted on the strict CuPy stand-in, `bench/launches.py`):", ""]
        lines += [f"launches per update: {key} {v['launches']}" for key, v in la.items() if isinstance(v, dict)] + [""]
    k = rep["sections"].get("kernels", {})
    if "modes" in k:
        lines += kernel_tables(k)
    elif "skipped" in k:
        lines += [f"**Where a step's GPU time goes**: skipped ({k['skipped']}).", ""]
    b = rep["sections"].get("beam", {})
    if "sentences_per_s" in b:
        lines += [f"**Beam search** (beam 4, `{b['preset']}` with random weights, {b['sentences']:,} sentences of "
                  f"{b['mean_src_len']} source pieces on average, each output run to its cap ({b['max_len']}), "
                  f"{b['out_tokens']:,} output tokens): {b['sentences_per_s']} sentences/s ({b['seconds']} s).", ""]
    w = rep["sections"].get("wmt", {})
    if "skipped" in w:
        lines += [f"**A WMT14-shaped run**: skipped ({w['skipped']}).", ""]
    if "updates_per_s" in w:
        lines += [f"**A WMT14-shaped run** (`train_wmt.py --device gpu --preset {w['preset']}`"
                  f"{' --fp16' if w['fp16'] else ''} on {w['pairs']:,} synthetic pairs of WMT14's lengths, built in "
                  f"{w['build_s']} s): {w['updates']} updates in {w['train_wall_s']:.0f} s, {w['updates_per_s']} "
                  f"updates/s ({w['tokens_per_s']:,.0f} target tokens/s): the paper's 100k updates would take "
                  f"{w['hours_for_100k']} h on this GPU (the paper: 12 h on 8 P100s).", ""]
    return "\n".join(lines)


def _num(x):
    return "-" if x is None else f"{x:,}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


SECTIONS = ("suite", "launches", "step", "kernels", "beam", "wmt")   # in the order they run


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--out", help="folder for report.md and report.json (written again after every section: a "
                   "command stopped part-way keeps what it measured)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (checks this script, e.g. under the CuPy stand-in)")
    p.add_argument("--fp16", action="store_true", help="the WMT14-shaped run with --fp16")
    p.add_argument("--no-strong", action="store_true",
                   help="leave out the strong PyTorch column of the training step (SDPA, logits on the rows with a "
                        "loss, fused Adam)")
    p.add_argument("--steps-per-round", type=int, default=1, metavar="STEPS",
                   help="the training step's rounds: STEPS consecutive steps between two synchronisations, the time "
                        "divided by STEPS (default 1, each step alone; several: as training runs them, one step's GPU "
                        "work overlapping the host's work on the next)")
    p.add_argument("--budget", type=float, default=330.0,
                   help="seconds for the whole report (default 330: the WMT14-shaped run is shortened to fit, and "
                        "left out, said so, where less than 120 s are left for it)")
    args = p.parse_args(argv)
    at_least_one(p, args, "steps_per_round")
    big = not args.smoke
    args.presets = ["base", "big"] if big else ["tiny"]
    args.vocab, args.step_tokens = (37000, 25000) if big else (64, 256)
    args.rounds, args.warmup_rounds, args.lr = (5, 2, 1e-4) if big else (2, 1, 1e-4)
    args.kernel_steps, args.kernel_top = (3, 40) if big else (1, 5)   # report.json keeps 40, the tables show 12
    args.beam_preset, args.beam_sentences, args.beam_extra = ("base", 3000, 5) if big else ("tiny", 20, 3)
    args.wmt_preset, args.wmt_pairs, args.wmt_seed_pairs, args.wmt_valid = (
        ("base", 4_500_000, 20_000, 200) if big else ("tiny", 5000, 500, 4))
    # (--smoke's suite: the GPU tests at a GPU's sizes when the stand-in is the GPU, ~150 s on a 2-core CPU)
    args.wmt_seconds, args.wmt_log_every, args.suite_timeout = (150.0, 10, 200) if big else (8.0, 2, 300)
    skip = {s for s in args.skip.split(",") if s}
    for s in sorted(skip - set(SECTIONS)):   # a misspelt name had been ignored: the section ran
        p.error(f"--skip: unknown section {s!r} ({', '.join(SECTIONS)})")
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"gpu_report: no GPU: {why}")
    t0 = time.time()
    rep = {"env": section_env(), "command": shlex.join(["python", "bench/gpu_report.py",
                                                         *(sys.argv[1:] if argv is None else map(str, argv))]),
           "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MINITF_") and k != "MINITF_CACHE"},
           "steps_per_round": args.steps_per_round, "sections": {}}
    log(f"{rep['env'].get('gpu')}, CuPy {rep['env']['cupy']}, torch {rep['env']['torch']}")
    sections = (("suite", lambda: section_suite(args)), ("launches", lambda: section_launches(args)),
                ("step", lambda: section_step(args, rep["env"])),
                ("kernels", lambda: section_kernels(args)), ("beam", lambda: section_beam(args)),
                ("wmt", lambda: section_wmt(args)))
    assert tuple(name for name, _ in sections) == SECTIONS
    for name, fn in sections:
        if name in skip:
            continue
        if name == "wmt":   # the run takes what the budget leaves (corpus, start and the final evaluation: ~90 s)
            left = args.budget - (time.time() - t0)
            least = 1 if args.smoke else WMT_LEAST_S
            if left < least:
                rep["sections"][name] = {"skipped": f"{max(left, 0):.0f} s left of --budget {args.budget:.0f}; the "
                                                    f"run needs at least {least} s", "seconds": 0}
                log(f"{name} skipped: {rep['sections'][name]['skipped']}")
                continue
            args.wmt_seconds = max(min(30.0, args.wmt_seconds), min(args.wmt_seconds, left - 90))   # --smoke: 8 s
        log(f"{name} ...")
        t = time.time()
        try:
            rep["sections"][name] = fn()
        except Exception as e:   # report it and go on: one command, every section's result
            rep["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        rep["sections"][name]["seconds"] = rep["sections"][name].get("seconds", round(time.time() - t, 1))
        log(f"{name} done in {time.time() - t:.0f}s")
        rep["total_s"] = time.time() - t0
        write(args.out, rep)   # the sections so far, should the command be stopped during the next
    rep["total_s"], rep["complete"] = time.time() - t0, True
    print(write(args.out, rep))
    return rep


WMT_LEAST_S = 120   # the WMT14-shaped run's corpus, start, 30 s of training and its end


def write(out, rep):
    """report.md and report.json in `out` (if given), each replaced whole; returns the Markdown."""
    try:
        text = markdown(rep)
    except Exception as e:   # never lose the measurements to a formatting error: the JSON follows
        text = f"(markdown failed: {type(e).__name__}: {e})\n\n```\n{json.dumps(rep, indent=2, default=str)}\n```"
    if not rep.get("complete"):
        text = f"(the report so far: sections {', '.join(rep['sections'])})\n\n" + text
    if out:
        os.makedirs(out, exist_ok=True)
        atomic_write_bytes(Path(out, "report.md"), (text + "\n").encode())
        atomic_write_bytes(Path(out, "report.json"), json.dumps(rep, indent=2, default=str).encode())
    return text


if __name__ == "__main__":
    main()
