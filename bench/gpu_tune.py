#!/usr/bin/env python
"""Which of minitf's GPU switches pay on this GPU, and the GPU report run under the combination that does: one
command that keeps to a deadline. Needs a CUDA GPU (or the CuPy stand-in, with --smoke).

    python bench/gpu_tune.py --out runs/tune                    # one H100/H200: about --deadline (420 s) at most
    python bench/gpu_tune.py --out runs/tune --before-kernels old_kernels.py   # also time another copy of the CUDA
    python bench/gpu_tune.py --smoke --skip suite --out DIR      # tiny sizes (checks this script on the CuPy stand-in)

Some of minitf's GPU code is off by default: attention on packed rows in one kernel (MINITF_FUSED_ATTN=1) and ReLU's
backward inside the feed-forward's bias sums (MINITF_FUSED_RELUSUMS=1), not faster on the H200 that timed them, and
split-K for the weight gradients (MINITF_SPLITK=1, float32), not yet timed on a GPU; the LayerNorms' warp-per-row
kernels are on by default since that timing and timed here switched off (MINITF_FUSED_LNWARP=0, `lnblock`), so that a
GPU where the block kernels are faster says so; the head layout's attention-weight rows padded to whole 16-byte vectors
(kernels.row_pitch) are on by default too, not yet timed on a GPU, and timed here switched off as `tight`
(MINITF_ATTN_PITCH=0: rows S apart, S the batch's longest key side; docs/performance.md says what each does). This
runs, each stage as a process of its own with what is left of --deadline, every stage's output kept in --out:

  suite        `pytest tests/test_gpu.py` (suite.txt): a variant with MINITF_FUSED_ATTN=1 is timed and chosen only
               where every test passed (they hold the attention kernels to NumPy on this GPU; tests/test_nvrtc.py,
               which compiles for other GPUs too and takes a minute of NVRTC, is left to gpu_report.py's suite)
  allocations  bench/allocations.py (allocations.txt): what an array from CuPy's pool costs the host here
  ab           bench/gpu_ab.py (ab/ab.json, ab.txt): the training step of `base` in --modes (float32 (TF32), --fp16
               and --bf16), each variant against `now` (the defaults) on the same weights and batch, in rounds of
               --steps-per-round steps: `lnblock`, `relusums`, `splitk` and `tight` (each switch alone), `rest`
               (the four) and `before` (--before-kernels; with MINITF_ATTN_PITCH=0 where that copy's softmax kernels
               lack the trailing pitch argument, rows S apart: bench/column_sums.py's TRAILING) in one process,
               then, where the GPU tests all passed, `attn` (attention alone) and `all` (every switch) with `now`
               again in another (ab_attn/ab.json, ab_attn.txt), so that a first run of the new attention kernels
               that stops the CUDA context costs only its own process (a variant that raises is left out of that mode, and the others of its process go on)
  report       where at least 120 s are left: bench/gpu_report.py --skip suite,beam --fp16 under the chosen switches
               (the training step of `base` and `big` against PyTorch, the kernel tables, and the WMT14-shaped run,
               in float16, where its --budget, what is left of the deadline, leaves it time; report/report.md and
               report.json, written after each of its sections)
  gemm         bench/gemm_shapes.py --modes float32,fp16 (gemm_shapes.txt), where at least 45 s are left

Between the A/B and the report the rule below chooses the switches the report runs under (choice.json; none: the
defaults). summary.json (written again after every stage) and, at the end, summary.md say what each stage did (its
command, seconds, exit status, or why it was left out) and why each variant was or was not chosen; set the chosen
variables in the environment to train with them.

A variant is chosen only if, in every preset and mode asked for: both it and `now` ran and gave finite gradients and
losses; its loss is within 1% of now's (LOSS_TOL, relative) and its gradients within 5% (GRAD_TOL, ||g - g_now|| /
||g_now||; NaN counts as disagreeing); and its speed against now's is at least 0.98x in every mode (MODE_LEAST) and
at least 1.01x as a geometric mean over the modes (SPEED_LEAST). A variant whose every switch changes only some modes
(ACTS_IN) is held to that over those modes alone: `splitk` needs 1.01x in float32, where the 16-bit modes' ~1.00 would
dilute its gain. Of the eligible, the fastest by geometric mean over every preset and mode is chosen,
each against the `now` of its own process. A KERNELS=FILE variant (--before-kernels) is timed, never chosen; a file
whose kernels take other arguments than minitf's launchers pass is refused up front (a kernel only a switch off
by default launches may be missing: kernels.OPT_IN_KERNELS).
"""
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import suite  # noqa: E402
from bench.flags import known_modes, parser  # noqa: E402
from bench.launches import MODES  # noqa: E402
from minitf.backend import gpu_available  # noqa: E402
from minitf.fileio import atomic_write_bytes  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-2, 5e-2     # a variant's loss and gradients against now's (relative)
SPEED_LEAST, MODE_LEAST = 1.01, 0.98   # its geometric-mean speed against now's, and its speed in each mode
GEMM_LEAST_S = 45                    # what the gemm stage needs, with room (float32 alone: 8.6 s on an H200)
SWITCHES = {"attn": {"MINITF_FUSED_ATTN": "1"}, "lnblock": {"MINITF_FUSED_LNWARP": "0"},
            "relusums": {"MINITF_FUSED_RELUSUMS": "1"}, "splitk": {"MINITF_SPLITK": "1"},
            "tight": {"MINITF_ATTN_PITCH": "0"}}
STAGES = ("suite", "allocations", "ab", "report", "gemm")
# switches that change the step of some modes only (split-K splits float32 and float64 products: gemm.SPLIT_DTYPES):
# a variant of such switches alone is held to SPEED_LEAST over the modes it acts in, where the others' ~1.0 would
# dilute its gain (its speed in every mode still at least MODE_LEAST)
ACTS_IN = {"MINITF_SPLITK": ("float32",)}


def variants(before_kernels=None):
    """gpu_ab's --variant values: now (the defaults), each switch alone, all of them, those but attention together
    (`rest`), and `before` (another copy of the CUDA, with the defaults, and MINITF_ATTN_PITCH=0 where its softmax
    takes rows S apart) where given."""
    out = {"now": {}, **SWITCHES, "all": {k: v for env in SWITCHES.values() for k, v in env.items()},
           "rest": {k: v for name, env in SWITCHES.items() if name != "attn" for k, v in env.items()}}
    if before_kernels:
        out["before"] = {"KERNELS": before_kernels}
        from bench.column_sums import other_kernels, tight_rows
        if tight_rows(other_kernels(before_kernels)):   # its softmax takes rows n apart
            out["before"]["MINITF_ATTN_PITCH"] = "0"
    return out


def ab_groups(before_kernels=None):
    """The A/B's processes: {output folder: variants}. Attention on packed rows runs in a process of its own (a
    first run of new kernels that stops the CUDA context, with an illegal address say, fails every later call of
    the process), each process with `now` to compare against."""
    vs = variants(before_kernels)
    attention = {n for n, env in vs.items() if env.get("MINITF_FUSED_ATTN") == "1"}
    return {"ab": {n: env for n, env in vs.items() if n not in attention},
            "ab_attn": {"now": {}, **{n: vs[n] for n in vs if n in attention}}}


def check_before(path):
    """Why `path` (another minitf/kernels.py) cannot be timed under minitf's launchers, or None: gpu_ab refuses such a
    file before it runs anything, which would lose every variant of its process."""
    if "," in path or "=" in path:
        return f"{path}: a path with ',' or '=' cannot be given in gpu_ab's --variant"
    from bench.column_sums import differing_kernels, other_kernels
    try:
        other = other_kernels(path)
    except Exception as e:
        return f"{path}: not read as a copy of minitf/kernels.py ({type(e).__name__}: {e})"
    differ = differing_kernels(other, {"MINITF_ATTN_PITCH": "0"})   # variants() gives such a copy tight rows
    if differ:
        return (f"{path}: its kernels take other arguments than minitf's launchers pass, or are missing "
                f"({', '.join(differ[:8])}{', ...' if len(differ) > 8 else ''}): a copy from before these kernels")
    return None


def variant_flag(name, env):
    return f"{name}=" + ",".join(f"{k}={v}" for k, v in env.items())


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def _failed_in(results, key, name):
    """The error of variant `name` in preset and mode `key` where gpu_ab left it out there (one line, at most 120
    characters), else None."""
    error = results.get(key, {}).get("failed", {}).get(name)
    return None if error is None else _line(error)[:120]


def judge(ab, suite_passed):
    """({variant: why it is or is not eligible}, {eligible variant: its geometric-mean speed against the first}) from
    gpu_ab's ab.json (`ab`) and whether the GPU tests all passed (None: they did not run)."""
    names = list(ab["variants"])
    base = names[0]
    wanted = [f"{p} {m}" for p in ab["presets"] for m in ab["modes"]]
    results = ab.get("results", {})
    missing = [k for k in wanted if k not in results or "error" in results[k]]
    why, speeds = {}, {}
    for name in names[1:]:
        env = ab["variants"][name]
        if "KERNELS" in env:
            failed = [f"{k} ({error})" for k in wanted if (error := _failed_in(results, k, name))]
            why[name] = "another copy of the kernels: timed, never chosen" + (
                f"; failed in {', '.join(failed)}" if failed else "")
            continue
        if missing:
            why[name] = f"not chosen: not every preset and mode ran ({', '.join(missing)})"
            continue
        if env.get("MINITF_FUSED_ATTN") == "1" and not suite_passed:
            why[name] = ("not chosen: the GPU tests " + ("did not run" if suite_passed is None else "did not all pass")
                         + " (they hold the attention kernels to NumPy on this GPU)")
            continue
        bad, mode_speeds = [], {}
        for key in wanted:
            same, times = results[key].get("same", {}), results[key].get("time", {})
            error = _failed_in(results, key, name)
            if error:
                bad.append(f"{key}: failed ({error})")
                continue
            s0, s = same.get(base, {}), same.get(name, {})
            if not s0 or not s:
                bad.append(f"{key}: no comparison of its loss and gradients")
                continue
            if not (s0.get("finite") and s.get("finite") and _finite(s0.get("loss")) and _finite(s.get("loss"))):
                bad.append(f"{key}: not finite")
                continue
            if not (s.get("loss_rel_diff", math.nan) <= LOSS_TOL):
                bad.append(f"{key}: loss differs by {s.get('loss_rel_diff')} (> {LOSS_TOL})")
            if not (s.get("grad_rel_diff", math.nan) <= GRAD_TOL):
                bad.append(f"{key}: gradients differ by {s.get('grad_rel_diff')} (> {GRAD_TOL})")
            speed = times.get(name, {}).get("speed_vs_" + base)
            if not _finite(speed) or speed <= 0:
                bad.append(f"{key}: not timed")
                continue
            mode_speeds[key] = speed
            if speed < MODE_LEAST:
                bad.append(f"{key}: x{speed:.3f} against {base} (< {MODE_LEAST})")
        if bad:
            why[name] = "not chosen: " + "; ".join(bad)
            continue
        geo = _geomean(mode_speeds.values())
        acting = acts_in(env, ab["modes"])
        held = _geomean(v for k, v in mode_speeds.items() if k.split()[-1] in acting)
        over = "the modes" if len(acting) == len(ab["modes"]) else f"{', '.join(acting)} (the modes it acts in)"
        if held < SPEED_LEAST:
            why[name] = f"not chosen: x{held:.4f} against {base} over {over} (< {SPEED_LEAST})"
            continue
        speeds[name] = geo
        why[name] = f"eligible: x{held:.3f} against {base} over {over}" + (
            f", x{geo:.3f} over the modes" if over != "the modes" else "")
    return why, speeds


def _geomean(values):
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def acts_in(env, modes):
    """The modes of `modes` whose step a variant's switches `env` change: those of ACTS_IN where every switch is
    there (and one of them acts in one of `modes`), else all."""
    if not env or any(k not in ACTS_IN for k in env):
        return list(modes)
    acting = [m for m in modes if any(m in ACTS_IN[k] for k in env)]
    return acting or list(modes)


def choose(ab, suite_passed):
    """(the chosen variant's name or None, {variant: why it was or was not chosen}) from gpu_ab's ab.json (`ab`) and
    whether the GPU tests all passed (None: they did not run)."""
    return pick(*judge(ab, suite_passed))


def pick(why, speeds):
    """(the fastest of `speeds` {variant: geometric-mean speed}, or None; `why` with it marked as chosen)."""
    winner = max(speeds, key=speeds.get) if speeds else None
    if winner:
        why[winner] = "chosen: " + why[winner].split(": ", 1)[1]
    return winner, why


def choose_among(abs_, suite_passed):
    """choose() over several A/B processes' ab.json (each variant against its own process's first): the fastest
    eligible variant of them all, and why each was or was not chosen."""
    why, speeds = {}, {}
    for ab in abs_:
        w, sp = judge(ab, suite_passed)
        why.update(w)
        speeds.update(sp)
    return pick(why, speeds)


class Stages:
    """Runs each stage's command as a process of its own within the deadline, keeps the record of each, and writes
    summary.json again after every stage (a command stopped part-way keeps what it did)."""

    def __init__(self, out, deadline, summary=None):
        self.out, self.t0, self.deadline, self.record = Path(out), time.monotonic(), deadline, {}
        self.summary = summary if summary is not None else {}
        self.summary["stages"] = self.record

    def left(self):
        return self.deadline - (time.monotonic() - self.t0)

    def skip(self, name, why):
        self.record[name] = {"skipped": why}
        log(f"{name}: skipped ({why})")
        self.save()

    def save(self):
        self.summary["seconds"] = round(time.monotonic() - self.t0, 1)
        try:
            atomic_write_bytes(self.out / "summary.json", json.dumps(self.summary, indent=1, default=str).encode())
        except OSError as e:
            log(f"summary.json not written: {e}")

    def run(self, name, cmd, log_name, timeout, env=None):
        """`cmd` (a list; run from the project's root) with its output in out/log_name, stopped (with its children)
        after `timeout` seconds; returns the record and the output ('' where it could not start)."""
        timeout = max(1.0, min(timeout, self.left() - 2))
        log(f"{name}: {shlex.join(cmd)} (at most {timeout:.0f} s)")
        t = time.monotonic()
        rec = {"command": shlex.join(["python", *cmd[1:]]), "switches": env or {}, "output": log_name}
        text = ""
        try:
            # unbuffered: what a stopped process printed is kept; errors="replace": any byte is read
            proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8",
                                    errors="replace", start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=timeout)
                rec["rc"] = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                try:
                    text, _ = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:   # a grandchild that left the process group holds the pipe open
                    proc.kill()
                rec["rc"] = "timed out"
        except OSError as e:
            rec["rc"] = f"did not start: {e}"
        try:
            (self.out / log_name).write_text(text or "")
        except OSError as e:
            rec["output"] = f"not written: {e}"
        rec["seconds"] = round(time.monotonic() - t, 1)
        self.record[name] = rec
        log(f"{name}: exit {rec['rc']} in {rec['seconds']} s")
        self.save()
        return rec, text or ""


def read_ab(path):
    """gpu_ab's ab.json at `path`, or None (absent, or cut short by a stopped process)."""
    try:
        ab = json.loads(Path(path).read_text())
        return ab if isinstance(ab, dict) and "variants" in ab else None
    except (OSError, ValueError):
        return None


def log(msg):
    print(f"[gpu_tune {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--out", required=True, help="folder for every stage's output and summary.md")
    p.add_argument("--deadline", type=float, default=420.0,
                   help="seconds for the whole command (default 420); each stage gets what is left of it")
    p.add_argument("--before-kernels", metavar="FILE",
                   help="also time FILE, another copy of minitf/kernels.py (`git show REV:minitf/kernels.py > FILE`; "
                        "its kernels must take the arguments these launchers pass), with the defaults: what the CUDA "
                        "changed since then bought")
    p.add_argument("--steps-per-round", type=int, default=3, metavar="STEPS",
                   help="the A/B's and the report's rounds: STEPS consecutive steps (default 3: as training runs them)")
    p.add_argument("--modes", default="float32,fp16,bf16", help="the A/B's modes (default float32,fp16,bf16)")
    p.add_argument("--skip", default="", help=f"comma-separated stages to leave out: {','.join(STAGES)}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (checks this script, e.g. under the CuPy stand-in)")
    args = p.parse_args(argv)
    skip = [s for s in args.skip.split(",") if s]
    for s in skip:
        if s not in STAGES:
            p.error(f"--skip: unknown stage {s!r} ({', '.join(STAGES)})")
    known_modes(p, args.modes, MODES)
    if args.steps_per_round < 1:
        p.error(f"--steps-per-round must be at least 1, got {args.steps_per_round}")
    if not args.deadline > 0:
        p.error(f"--deadline must be above 0, got {args.deadline}")
    before = None
    if args.before_kernels:
        if not os.path.isfile(args.before_kernels):
            p.error(f"--before-kernels: no such file: {args.before_kernels}")
        before = str(Path(args.before_kernels).resolve())   # the stages run from the project's root
        why = check_before(before)
        if why:
            p.error(f"--before-kernels: {why}")
    ok, why = gpu_available()   # (the stand-in counts: MINITF_CUPY_MODULE=strict_cupy)
    if not ok:   # every stage would fail after the GPU tests had "passed" by skipping themselves
        sys.exit(f"gpu_tune: no GPU: {why}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = {"command": shlex.join(["python", "bench/gpu_tune.py", *(sys.argv[1:] if argv is None else argv)])}
    st = Stages(out, args.deadline, summary)
    try:
        run_stages(args, st, skip, before)
    except Exception as e:   # record it: the summary keeps what ran before
        summary["error"] = f"{type(e).__name__}: {e}"
        log(f"stopped: {summary['error']}")
    st.save()
    text = markdown(summary)
    atomic_write_bytes(out / "summary.md", text.encode())
    print(text)
    return summary


def run_stages(args, st, skip, before):
    out, summary = st.out, st.summary
    smoke = ["--smoke"] if args.smoke else []
    py = sys.executable
    # the sizes of each stage: an H100's, or the stand-in's under --smoke
    suite_s, alloc_s, ab_least, report_least = (120, 60, 20, 60) if args.smoke else (150, 30, 60, 120)
    passed = None
    if "suite" in skip:
        st.skip("suite", "--skip")
    else:
        rec, text = st.run("suite", suite.command(suite.ON_THE_GPU), "suite.txt", suite_s, env=suite.ENV)
        passed = rec["rc"] == 0 and suite.all_passed(text)
        rec["passed"] = passed
    if "allocations" in skip:
        st.skip("allocations", "--skip")
    else:
        st.run("allocations", [py, "bench/allocations.py", *smoke], "allocations.txt", alloc_s)

    why, abs_ = {}, []
    groups = ab_groups(before)
    if "ab" in skip:
        for group in groups:
            st.skip(group, "--skip")
    else:
        after = 0 if "report" in skip else report_least   # what the report needs after the A/Bs
        running = [g for g in groups if g != "ab_attn" or passed]
        for group, vs in groups.items():
            names = [n for n in vs if n != "now"]
            if group not in running:
                st.skip(group, "the GPU tests " + ("did not run" if passed is None else "did not all pass"))
                why.update({n: f"not chosen: the GPU tests {'did not run' if passed is None else 'did not all pass'} "
                               f"(they hold the attention kernels to NumPy on this GPU)" for n in names})
                continue
            cmd = [py, "bench/gpu_ab.py", "--presets", "base", "--modes", args.modes, "--rounds", "7",
                   "--steps-per-round", str(args.steps_per_round), "--no-torch", "--out", str(out / group), *smoke]
            for name, env in vs.items():
                cmd += ["--variant", variant_flag(name, env)]
            ahead = len(running) - running.index(group)   # this A/B and those after it
            share = (st.left() - after) / ahead           # the first A/B leaves the second its share
            # where the report and the products no longer fit after the A/Bs, the A/Bs take what is left
            st.run(group, cmd, f"{group}.txt", share if share >= ab_least else st.left() / ahead)
            ab = read_ab(out / group / "ab.json")
            if ab is None:
                why.update({n: f"not chosen: the A/B wrote no complete {group}/ab.json" for n in names})
            else:
                abs_.append(ab)
                summary.setdefault("ab", []).extend(ab_table(ab, group))
    chosen, w = choose_among(abs_, passed)
    why = {**why, **w}
    switches = variants(before).get(chosen, {}) if chosen else {}
    summary["choice"] = {"chosen": chosen, "switches": switches, "why": why}
    atomic_write_bytes(out / "choice.json", json.dumps(summary["choice"], indent=1).encode())
    for name, reason in why.items():
        log(f"{name}: {reason}")
    st.save()

    if "report" in skip:
        st.skip("report", "--skip")
    elif st.left() < (5 if args.smoke else report_least):
        st.skip("report", f"{st.left():.0f} s left of --deadline {args.deadline:.0f}")
    else:
        budget = st.left() - 10   # the products' timing takes what the report leaves
        st.run("report", [py, "bench/gpu_report.py", "--skip", "suite,beam", "--fp16", "--steps-per-round",
                          str(args.steps_per_round), "--budget", f"{max(budget, 1):.0f}", "--out", str(out / "report"),
                          *smoke], "report.log", budget + 5, env=switches)
    if "gemm" in skip:
        st.skip("gemm", "--skip")
    elif st.left() < (3 if args.smoke else GEMM_LEAST_S):
        st.skip("gemm", f"{st.left():.0f} s left of --deadline {args.deadline:.0f} (it needs {GEMM_LEAST_S})")
    else:
        st.run("gemm", [py, "bench/gemm_shapes.py", "--modes", "float32,fp16", "--top", "12", *smoke], "gemm_shapes.txt",
               st.left() - 2, env=switches)


def _line(text):
    """An error as one line of a Markdown table: whitespace runs (a compiler's log) as one space, `|` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def ab_table(ab, group="ab"):
    """The A/B's rows: [its process (`group`), preset and mode, variant, step ms, target tokens/s, speed against the
    process's first variant, gradients' difference from its], or [group, preset and mode, the error] (of the mode, or
    of a variant that failed in it, named)."""
    base, rows = list(ab["variants"])[0], []
    for key, entry in ab.get("results", {}).items():
        if "error" in entry:
            rows.append([group, key, _line(entry["error"])[:200]])
            rows += [[group, key, f"{name}: {_line(error)[:200]}"] for name, error in entry.get("failed", {}).items()]
            continue
        for name, t in entry.get("time", {}).items():
            s = entry.get("same", {}).get(name, {})
            rows.append([group, key, name, t.get("step_ms"), t.get("tgt_tokens_per_s"), t.get("speed_vs_" + base),
                         s.get("grad_rel_diff")])
        rows += [[group, key, f"{name}: {_line(error)[:200]}"] for name, error in entry.get("failed", {}).items()]
    return rows


def _num(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else ""


def markdown(summary):
    lines = [f"`{summary['command']}`: {summary['seconds']} s"
             + (f", stopped by {summary['error']}" if summary.get("error") else ""), ""]
    for name, rec in summary["stages"].items():
        if "skipped" in rec:
            lines.append(f"- {name}: left out ({rec['skipped']})")
        else:
            extra = ("" if "passed" not in rec else
                     ", every test passed" if rec["passed"] else ", NOT every test passed")
            env = " ".join(f"{k}={v}" for k, v in rec["switches"].items() if k not in suite.ENV)
            lines.append(f"- {name}: `{(env + ' ') if env else ''}{rec['command']}`: exit {rec['rc']}, "
                         f"{rec['seconds']} s{extra} ({rec['output']})")
    if summary.get("ab"):
        lines += ["", "| A/B | preset and mode | variant | step ms | target tok/s | x now | gradients vs now |",
                  "|---|---|---|---|---|---|---|"]
        for row in summary["ab"]:
            if len(row) == 3:
                lines.append(f"| {row[0]} | {row[1]} | FAILED: {row[2]} | | | | |")
            else:
                group, key, name, ms, tok, x, g = row
                lines.append(f"| {group} | {key} | {name} | {_num(ms, '.2f')} | {_num(tok, ',')} | {_num(x, '.3f')} | "
                             f"{_num(g, '.1e')} |")
    choice = summary.get("choice", {})
    lines += ["", f"Chosen: {choice.get('chosen') or 'none (the defaults stay)'}"
              + (f" ({' '.join(f'{k}={v}' for k, v in choice['switches'].items())})" if choice.get("switches") else "")]
    lines += [f"- {name}: {why}" for name, why in choice.get("why", {}).items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
