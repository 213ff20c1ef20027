"""bench/gpu_tune.py: the rule that picks the opt-in GPU switches a report runs under, its stages kept to a deadline,
and the whole command on the CuPy stand-in."""
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gpu_tune  # noqa: E402
from bench.gpu_tune import choose  # noqa: E402
from bench.suite import all_passed  # noqa: E402

MODES = ("float32", "fp16", "bf16")


def ab(speeds, grads=None, loss=None, finite=None, modes=MODES, errors=(), env=None):
    """An ab.json as bench/gpu_ab.py writes it: `speeds` {variant: speed against now, one number or one a mode};
    `grads` / `loss` {variant: relative difference from now's}, `finite` {variant: False}, `errors` modes that
    failed, `env` {variant: its switches} (default: each variant one of gpu_tune's)."""
    names = ["now", *speeds]
    env = env or {}
    out = {"variants": {n: env.get(n, gpu_tune.variants().get(n, {"MINITF_X": "1"})) for n in names},
           "presets": ["base"], "modes": list(modes), "results": {}}
    for i, mode in enumerate(modes):
        key = f"base {mode}"
        if mode in errors:
            out["results"][key] = {"error": "RuntimeError: boom"}
            continue
        same, times = {}, {}
        for n in names:
            sp = 1.0 if n == "now" else speeds[n]
            sp = sp[i] if isinstance(sp, (list, tuple)) else sp
            same[n] = {"loss": 9.5 * (1 + (loss or {}).get(n, 0.0)), "loss_rel_diff": (loss or {}).get(n, 0.0),
                       "grad_rel_diff": 0.0 if n == "now" else (grads or {}).get(n, 1e-3),
                       "finite": (finite or {}).get(n, True)}
            times[n] = {"step_ms": 100 / sp, "tgt_tokens_per_s": round(197600 * sp) if math.isfinite(sp) else 0,
                        "speed_vs_now": sp}
        out["results"][key] = {"same": same, "time": times}
    return out


def test_the_fastest_variant_that_agrees_everywhere_is_chosen():
    winner, why = choose(ab({"lnblock": 1.03, "relusums": 1.05, "all": 1.04}), suite_passed=True)
    assert winner == "relusums" and why["relusums"].startswith("chosen: x1.050")
    assert why["lnblock"].startswith("eligible: x1.030") and why["all"].startswith("eligible")


@pytest.mark.parametrize("case, reason", [
    (dict(speeds={"lnblock": 1.0099}), "x1.0099 against now over the modes (< 1.01)"),
    (dict(speeds={"lnblock": (1.10, 1.10, 0.97)}), "base bf16: x0.970 against now (< 0.98)"),
    (dict(speeds={"lnblock": 1.2}, grads={"lnblock": 0.06}), "gradients differ by 0.06 (> 0.05)"),
    (dict(speeds={"lnblock": 1.2}, grads={"lnblock": math.nan}), "gradients differ by nan"),
    (dict(speeds={"lnblock": 1.2}, loss={"lnblock": 0.02}), "loss differs by 0.02 (> 0.01)"),
    (dict(speeds={"lnblock": 1.2}, finite={"lnblock": False}), "base float32: not finite"),
    (dict(speeds={"lnblock": 1.2}, finite={"now": False}), "base float32: not finite"),
    (dict(speeds={"lnblock": 1.2}, errors=("fp16",)), "not every preset and mode ran (base fp16)"),
    (dict(speeds={"lnblock": math.nan}), "base float32: not timed"),
])
def test_a_variant_is_not_chosen_when(case, reason):
    winner, why = choose(ab(**case), suite_passed=True)
    assert winner is None and why["lnblock"].startswith("not chosen") and reason in why["lnblock"], why


def test_a_switch_that_acts_in_float32_alone_is_held_to_its_gain_there():
    """Split-K changes float32's step only (16-bit products stay whole): 1.02x there and 1.00 / 0.995 in 16 bits is
    x1.005 over the three modes, under SPEED_LEAST, and it is chosen on its float32 alone; a mode it does not act in
    still may not fall under MODE_LEAST, and a variant with another switch beside it is held over every mode."""
    winner, why = choose(ab({"splitk": (1.02, 1.0, 0.995)}), suite_passed=True)
    assert winner == "splitk" and why["splitk"] == "chosen: x1.020 against now over float32 (the modes it acts in), " \
        "x1.005 over the modes", why
    winner, why = choose(ab({"splitk": (1.0099, 1.0, 1.0)}), suite_passed=True)
    assert winner is None and "x1.0099 against now over float32 (the modes it acts in) (< 1.01)" in why["splitk"]
    winner, why = choose(ab({"splitk": (1.05, 0.97, 1.0)}), suite_passed=True)
    assert winner is None and "base fp16: x0.970 against now (< 0.98)" in why["splitk"]
    both = {"both": {"MINITF_SPLITK": "1", "MINITF_FUSED_LNWARP": "0"}}
    winner, why = choose(ab({"both": (1.02, 1.0, 0.995)}, env=both), suite_passed=True)
    assert winner is None and "over the modes (< 1.01)" in why["both"]
    assert gpu_tune.acts_in({"MINITF_SPLITK": "1"}, ["fp16", "bf16"]) == ["fp16", "bf16"]   # none acts: all held


def test_attention_on_packed_rows_needs_the_gpu_tests_to_have_passed():
    data = ab({"attn": 1.2, "lnblock": 1.02})
    for passed, said in ((None, "did not run"), (False, "did not all pass")):
        winner, why = choose(data, suite_passed=passed)
        assert winner == "lnblock" and f"the GPU tests {said}" in why["attn"]
    assert choose(data, suite_passed=True)[0] == "attn"


def test_another_copy_of_the_kernels_is_timed_never_chosen():
    data = ab({"before": 1.5}, env={"before": {"KERNELS": "old.py"}})
    winner, why = choose(data, suite_passed=True)
    assert winner is None and why["before"] == "another copy of the kernels: timed, never chosen"
    data["results"]["base bf16"]["failed"] = {"before": "RuntimeError: did not build (kern.cu):\n  a | b"}
    assert choose(data, suite_passed=True)[1]["before"] == ("another copy of the kernels: timed, never chosen; failed "
                                                            "in base bf16 (RuntimeError: did not build (kern.cu): a \\| b)")


def test_a_variant_that_failed_in_one_mode_is_not_chosen_and_the_others_still_are():
    """gpu_ab.py leaves a variant that raised out of that mode (its "failed"), and the other variants of its process go
    on: that variant is not chosen, said why, and the others are judged as ever."""
    data = ab({"lnblock": 1.2, "relusums": 1.05})
    bf16 = data["results"]["base bf16"]
    for part in ("same", "time"):
        del bf16[part]["lnblock"]
    bf16["failed"] = {"lnblock": "RuntimeError: the kernels did not build"}
    winner, why = choose(data, suite_passed=True)
    assert winner == "relusums" and why["lnblock"] == "not chosen: base bf16: failed (RuntimeError: the kernels did not build)"
    rows = gpu_tune.ab_table(data)
    assert ["ab", "base bf16", "lnblock: RuntimeError: the kernels did not build"] in rows
    assert [r[2] for r in rows if r[1] == "base bf16"] == ["now", "relusums", "lnblock: RuntimeError: the kernels did not build"]


def test_the_gpu_tests_count_as_passed_only_on_a_summary_of_passes():
    assert all_passed("...\n28 passed in 50.12s\n")
    assert all_passed("2 skipped, 26 passed in 3s")
    for text in ("", "1 failed, 27 passed in 50s", "27 passed, 1 error in 50s", "26 passed, 2 errors in 50s",
                 "tests/test_gpu.py ....\n"):
        assert not all_passed(text), text


def test_a_stage_past_its_time_is_stopped_with_its_children_and_what_it_printed_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)   # a child's print() then goes to a buffer unless told
    st = gpu_tune.Stages(tmp_path, deadline=60)
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print('measured 1'); sys.stdout.buffer.write(b'\\xff\\n'); time.sleep(60)"
    t = time.monotonic()
    rec, text = st.run("slow", [sys.executable, "-c", child], "slow.txt", timeout=3)
    assert rec["rc"] == "timed out" and time.monotonic() - t < 20
    assert (tmp_path / "slow.txt").read_text() == "measured 1\n\ufffd\n" == text   # any byte read
    rec, _ = st.run("quick", [sys.executable, "-c", "print('ok')"], "quick.txt", timeout=10)
    assert rec["rc"] == 0 and (tmp_path / "quick.txt").read_text() == "ok\n"
    assert json.loads((tmp_path / "summary.json").read_text())["stages"]["quick"]["rc"] == 0   # kept stage by stage


SPEEDS = {"attn": 1.3, "lnblock": 1.02, "relusums": 0.9, "splitk": 0.99, "tight": 0.97, "rest": 1.015, "all": 1.1}


def fake_stages(monkeypatch, calls, speeds=SPEEDS):
    """Stages.run faked: records (name, command, timeout, switches) and writes what the stage would (a passing
    suite; each A/B's ab.json for the variants of its command, at `speeds`)."""
    def fake_run(self, name, cmd, log_name, timeout, env=None):
        calls.append((name, cmd, timeout, env))
        (self.out / log_name).write_text("28 passed in 50s\n" if name == "suite" else "")
        if name.startswith("ab"):
            names = [cmd[i + 1].split("=")[0] for i, c in enumerate(cmd) if c == "--variant"]
            assert names[0] == "now"
            data = ab({n: speeds[n] for n in names[1:]})
            os.makedirs(self.out / name, exist_ok=True)
            (self.out / name / "ab.json").write_text(json.dumps(data))
        if name == "report":   # the choice is on disk before the report starts
            assert "chosen" in json.loads((self.out / "summary.json").read_text())["choice"]
        self.record[name] = {"command": " ".join(cmd), "switches": env or {}, "rc": 0, "seconds": 1.0,
                             "output": log_name}
        return self.record[name], (self.out / log_name).read_text()
    monkeypatch.setattr(gpu_tune.Stages, "run", fake_run)
    monkeypatch.setattr(gpu_tune, "gpu_available", lambda: (True, ""))   # (the stages are faked: no GPU is asked for)


def test_the_report_runs_under_the_chosen_switches_within_the_deadline(tmp_path, monkeypatch):
    """Each stage's command as main() makes it (the processes faked): the A/Bs' ab.json decide the switches the
    report and the products' timing run under, attention is timed in a process of its own, the report's --budget is
    what the deadline leaves, and the stages that no longer fit are left out, said so."""
    calls = []
    fake_stages(monkeypatch, calls)
    s = gpu_tune.main(["--out", str(tmp_path / "t"), "--deadline", "570"])
    assert [c[0] for c in calls] == ["suite", "allocations", "ab", "ab_attn", "report", "gemm"]
    assert calls[0][1][1:] == ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]  # not NVRTC's minute
    first, second = calls[2][1], calls[3][1]
    assert first[1] == "bench/gpu_ab.py" and "--no-torch" in first and "attn=MINITF_FUSED_ATTN=1" not in first
    assert "rest=MINITF_FUSED_LNWARP=0,MINITF_FUSED_RELUSUMS=1,MINITF_SPLITK=1,MINITF_ATTN_PITCH=0" in first
    assert second[second.index("--variant") + 1] == "now=" and "attn=MINITF_FUSED_ATTN=1" in second
    assert "all=MINITF_FUSED_ATTN=1,MINITF_FUSED_LNWARP=0,MINITF_FUSED_RELUSUMS=1,MINITF_SPLITK=1,MINITF_ATTN_PITCH=0" \
        in second
    # the A/Bs leave the report its time, the first leaving the second half of their room
    assert calls[2][2] < (570 - 120) / 2 + 1 and calls[3][2] <= 570 - 120
    assert s["choice"]["chosen"] == "attn" and calls[4][3] == {"MINITF_FUSED_ATTN": "1"} == calls[5][3]
    report = calls[4][1]
    budget = float(report[report.index("--budget") + 1])
    assert report[1:4] == ["bench/gpu_report.py", "--skip", "suite,beam"] and "--fp16" in report and 550 < budget < 570
    md = (tmp_path / "t" / "summary.md").read_text()
    assert "Chosen: attn (MINITF_FUSED_ATTN=1)" in md and "- relusums: not chosen: base float32: x0.900" in md
    assert "| ab_attn | base fp16 | attn | 76.92 | 256,880 | 1.300 | 1.0e-03 |" in md
    assert "| ab | base fp16 | now | 100.00 | 197,600 | 1.000 | 0.0e+00 |" in md
    assert json.loads((tmp_path / "t" / "choice.json").read_text())["chosen"] == "attn"

    calls.clear()   # a deadline too short for the report and the products: the A/B takes it all, the rest left out
    s = gpu_tune.main(["--out", str(tmp_path / "u"), "--deadline", "40", "--skip", "suite"])
    assert [c[0] for c in calls] == ["allocations", "ab"] and s["choice"]["chosen"] == "lnblock"
    assert 35 < calls[1][2] <= 40
    md = (tmp_path / "u" / "summary.md").read_text()
    assert "- suite: left out (--skip)" in md and "- report: left out (" in md and "- gemm: left out (" in md
    assert "- ab_attn: left out (the GPU tests did not run)" in md
    assert "- attn: not chosen: the GPU tests did not run" in md


def test_an_a_b_that_wrote_no_complete_results_chooses_nothing_and_the_summary_is_still_written(tmp_path, monkeypatch):
    calls = []
    fake_stages(monkeypatch, calls)
    real = gpu_tune.Stages.run

    def cut_short(self, name, cmd, log_name, timeout, env=None):
        rec = real(self, name, cmd, log_name, timeout, env)
        if name.startswith("ab"):
            path = self.out / name / "ab.json"
            path.write_text(path.read_text()[:100])   # a process stopped while writing it
        return rec
    monkeypatch.setattr(gpu_tune.Stages, "run", cut_short)
    s = gpu_tune.main(["--out", str(tmp_path / "t"), "--skip", "suite,allocations"])
    assert s["choice"]["chosen"] is None and calls[-2][3] == {}   # the report under the defaults
    assert s["choice"]["why"]["lnblock"] == "not chosen: the A/B wrote no complete ab/ab.json"
    assert "Chosen: none (the defaults stay)" in (tmp_path / "t" / "summary.md").read_text()

    monkeypatch.setattr(gpu_tune, "choose_among", lambda *a: 1 / 0)   # anything unforeseen: recorded, summary kept
    s = gpu_tune.main(["--out", str(tmp_path / "u"), "--skip", "suite,allocations"])
    assert s["error"].startswith("ZeroDivisionError")
    assert "stopped by ZeroDivisionError" in (tmp_path / "u" / "summary.md").read_text()


def test_another_copy_of_the_kernels_is_checked_before_anything_runs(tmp_path):
    src = open(os.path.join(ROOT, "minitf", "kernels.py")).read()
    same, other = tmp_path / "same.py", tmp_path / "other.py"
    same.write_text(src)
    marker = 'extern "C" __global__ void bias_relu(T* x,'
    assert src.count(marker) == 1
    other.write_text(src.replace(marker, marker.replace("T* x", "A* x")))
    assert gpu_tune.check_before(str(same)) is None
    older = tmp_path / "older.py"     # a copy from before a kernel that only a switch off by default launches
    marker_new = 'extern "C" __global__ void add_partials('
    assert src.count(marker_new) == 1
    older.write_text(src.replace(marker_new, 'extern "C" __global__ void add_partials_not_yet('))
    assert gpu_tune.check_before(str(older)) is None
    from bench.column_sums import differing_kernels, other_kernels
    assert differing_kernels(other_kernels(str(older)), {"MINITF_SPLITK": "1"}) == ["add_partials"]
    assert "take other arguments than minitf's launchers pass, or are missing (bias_relu)" in \
        gpu_tune.check_before(str(other))
    assert "cannot be given in gpu_ab's --variant" in gpu_tune.check_before(str(tmp_path / "a,b.py"))
    tight = tmp_path / "tight.py"     # a copy whose softmax takes rows n apart (before kernels.row_pitch)
    tight.write_text(re.sub(r",\s*long long pitch\)", ")", src).replace("* pitch;", "* n;"))
    assert gpu_tune.check_before(str(tight)) is None
    assert gpu_tune.variants(str(tight))["before"] == {"KERNELS": str(tight), "MINITF_ATTN_PITCH": "0"}
    assert gpu_tune.variants(str(same))["before"] == {"KERNELS": str(same)}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_tune.py"), "--out", str(tmp_path / "t"),
                        "--before-kernels", str(other)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--before-kernels: " in r.stderr and "(bias_relu)" in r.stderr, r.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("flags, said", [
    (["--skip", "sute"], "--skip: unknown stage 'sute'"),
    (["--modes", "fp61"], "--modes: unknown mode 'fp61'"),
    (["--deadline", "0"], "--deadline must be above 0"),
    (["--steps-per-round", "0"], "--steps-per-round must be at least 1"),
    (["--before-kernels", "no/such.py"], "--before-kernels: no such file: no/such.py"),
])
def test_bad_flags_are_one_line_before_anything_runs(tmp_path, flags, said):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_tune.py"), "--out", str(tmp_path / "t"),
                        *flags], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and said in r.stderr and not (tmp_path / "t").exists(), r.stderr


def test_the_whole_command_on_the_standin(tmp_path):
    """Every stage but the GPU tests and the report (each tested on its own) for real, at tiny sizes, --fp16 only:
    the A/B of every variant but attention's (which waits for the GPU tests), the choice and the products' timing
    under it."""
    from cuda_emulator import compiler
    from test_gpu_standin import run_bench
    if compiler() is None:
        pytest.skip("needs g++ >= 12 to emulate the CUDA kernels on the CPU")
    old = tmp_path / "old_kernels.py"
    old.write_text(open(os.path.join(ROOT, "minitf", "kernels.py")).read())
    r = run_bench(tmp_path, "gpu_tune.py", "--smoke", "--skip", "suite,report", "--modes", "fp16", "--before-kernels",
                  old, "--out", tmp_path / "t")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert [summary["stages"][s].get("rc") for s in ("allocations", "ab", "gemm")] == [0, 0, 0], summary["stages"]
    rows = {row[2]: row for row in summary["ab"]}
    assert set(rows) == {"now", "lnblock", "relusums", "splitk", "tight", "rest", "before"}
    assert summary["stages"]["ab_attn"]["skipped"]
    assert rows["before"][6] == 0.0   # the same CUDA: the same gradients to the bit
    assert all(row[6] < gpu_tune.GRAD_TOL for row in rows.values())
    why = summary["choice"]["why"]
    assert "the GPU tests did not run" in why["attn"] and why["before"].startswith("another copy")
    chosen = summary["choice"]["chosen"]
    assert summary["stages"]["gemm"]["switches"] == (gpu_tune.variants()[chosen] if chosen else {})
    gemms = (tmp_path / "t" / "gemm_shapes.txt").read_text()
    assert "## float32:" in gemms and "## fp16:" in gemms, gemms[-2000:]   # the products of both modes


def test_without_a_gpu_it_stops_at_once_in_one_line(tmp_path, monkeypatch):
    # every stage had failed after the GPU tests "passed" by skipping themselves, a minute later
    monkeypatch.setattr(gpu_tune, "gpu_available", lambda: (False, "CuPy is not installed"))
    with pytest.raises(SystemExit) as e:
        gpu_tune.main(["--out", str(tmp_path / "t")])
    assert e.value.code == "gpu_tune: no GPU: CuPy is not installed" and not (tmp_path / "t").exists()
