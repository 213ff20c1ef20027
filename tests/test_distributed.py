"""Data-parallel training under `mpiexec -n 2` on the CPU (the mpich wheel): the same mathematics
as one process, resume with another N, one rank failing ends the job. Every run has a timeout,
so a hang fails the test instead of stalling CI. Skipped (with the reason) where mpi4py or
mpiexec is missing: `pip install -e ".[dist]"` brings both."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minitf.checkpoint import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = "a the man woman dog cat sees eats red big small house runs".split()
DE = "ein der mann frau hund katze sieht isst rot gross klein haus rennt".split()


def _mpiexec():
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return None
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return exe


MPIEXEC = _mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpi4py or mpiexec not installed (pip install -e '.[dist]')")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("own")
    rng = np.random.default_rng(0)
    for stem, n in (("train", 300), ("dev", 10)):
        rows = [rng.integers(0, len(EN), size=rng.integers(2, 7)) for _ in range(n)]
        for lang, words in (("en", EN), ("de", DE)):
            (d / f"{stem}.{lang}").write_text("".join(" ".join(words[i] for i in r) + "\n" for r in rows))
    return d


def _args(corpus, out, *extra):
    return [os.path.join(ROOT, "train_wmt.py"), "--train", corpus / "train", "--valid", corpus / "dev",
            "--preset", "tiny", "--vocab-size", 60, "--max-tokens", 64, "--device", "cpu", "--quiet",
            "--dtype", "float64", "--dropout", 0, "--log-every", 1, "--valid-every", 0, "--beam", 1,
            "--average-last", 1, "--out", out, *extra]


def _without(args, flag):
    """_args' list as strings, without `flag` and its value (to leave it to the preset, or give another)."""
    args = [str(a) for a in args]
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def _run(cmd, cache, timeout=240):
    env = dict(os.environ, MINITF_CACHE=str(cache), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


def _params(path):
    return load_checkpoint(path).params


def _same(a, b, rtol=1e-10):
    """Equal to `rtol` relative to the model's largest parameter. (Per element it cannot be: a
    parameter whose gradient is zero in exact arithmetic, such as the attention keys' bias under
    softmax's shift invariance, gets rounding noise whose order depends on the summation order,
    and Adam scales that noise up to ~1e-11.)"""
    assert set(a) == set(b)
    scale = max(float(np.abs(v).max()) for v in b.values())
    worst = max((float(np.abs(a[n] - b[n]).max()), n) for n in a)
    assert worst[0] <= rtol * scale, f"{worst[1]}: differs by {worst[0]:.3g} (largest parameter {scale:.3g})"


def _train_ok(corpus, tmp_path, ranks, out, *extra):
    """train_wmt.py on `ranks` processes (1: no mpiexec) into tmp_path/out; asserts it succeeded."""
    launch = [sys.executable] if ranks == 1 else [MPIEXEC, "-n", ranks, sys.executable]
    r = _run([*launch, *_args(corpus, tmp_path / out, *extra)], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path / out


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_two_ranks_equal_one_process_with_twice_the_update_freq(corpus, tmp_path, arch):
    one = _train_ok(corpus, tmp_path, 1, "one", "--max-steps", 3, "--update-freq", 2, "--save-every", 3, "--arch", arch)
    two = _train_ok(corpus, tmp_path, 2, "two", "--max-steps", 3, "--save-every", 3, "--arch", arch)
    _same(_params(one / "checkpoint_0000003.npz"), _params(two / "checkpoint_0000003.npz"))
    log = (two / "train_log.jsonl").read_text().splitlines()
    assert len([line for line in log if '"loss"' in line]) == 3          # one writer: rank 0 alone logs


def test_two_ranks_validate_as_one_process_does(corpus, tmp_path):
    """Each rank validates its share (every other batch and sentence); rank 0 logs the whole set's
    loss and BLEU, those of one process with the same updates, and keeps the best checkpoint."""
    def records(out):
        lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        return [r for r in lines if "valid_loss" in r]
    one = _train_ok(corpus, tmp_path, 1, "one_v", "--max-steps", 3, "--update-freq", 2, "--valid-every", 1)
    two = _train_ok(corpus, tmp_path, 2, "two_v", "--max-steps", 3, "--valid-every", 1)
    a, b = records(one), records(two)
    assert [r["step"] for r in b] == [1, 2, 3] == [r["step"] for r in a]
    for ra, rb in zip(a, b):
        for key in ("valid_loss", "valid_ppl", "valid_bleu", "valid_bleu_sentences"):
            assert rb[key] == pytest.approx(ra[key], abs=1e-4), (ra["step"], key)
    assert (two / "checkpoint_best.npz").exists()
    # on the minutes' grid every rank reads rank 0's clock: they validate at the same steps (or hang);
    # a spacing of 60 us, far shorter than any update (two all-reduces and a step), fires at steps 2 and 3 at least
    args = _without(_args(corpus, tmp_path / "two_m", "--max-steps", 3, "--valid-every-minutes", 1e-6), "--valid-every")
    done = _run([MPIEXEC, "-n", 2, sys.executable, *args], tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [rec["step"] for rec in records(tmp_path / "two_m")]
    assert len(steps) >= 2 and steps == sorted(set(steps)) and steps[-1] == 3


def test_resume_with_another_number_of_ranks_continues_the_same_stream(corpus, tmp_path):
    straight = _train_ok(corpus, tmp_path, 1, "straight", "--max-steps", 4, "--update-freq", 2, "--save-every", 2)
    _train_ok(corpus, tmp_path, 2, "split", "--max-steps", 2, "--save-every", 2)
    split = _train_ok(corpus, tmp_path, 1, "split", "--max-steps", 4, "--update-freq", 2, "--save-every", 2,
                      "--resume")
    _same(_params(straight / "checkpoint_0000004.npz"), _params(split / "checkpoint_0000004.npz"))


def test_the_presets_tokens_per_update_do_not_grow_with_the_ranks(corpus, tmp_path):
    """Left to the preset, W ranks x --update-freq k split its tokens per update (tiny: 512): 2 ranks
    make batches of 256 and the same 512-token update as one process; --max-tokens stays per batch."""
    def start_line(ranks, *extra):
        out = tmp_path / f"r{ranks}{'_'.join(map(str, extra))}"
        args = _without(_args(corpus, out, "--max-steps", 1, *extra), "--max-tokens")
        launch = [sys.executable] if ranks == 1 else [MPIEXEC, "-n", ranks, sys.executable]
        r = _run([*launch, *args], tmp_path / "cache")
        assert r.returncode == 0, r.stderr[-3000:]
        return next(line for line in r.stderr.splitlines() if line.startswith("train:"))
    assert "512 per batch, 512 per rank (1 batch), 512 per update (1 rank)" in start_line(1)
    assert "256 per batch, 256 per rank (1 batch), 512 per update (2 ranks)" in start_line(2)
    assert "128 per batch, 256 per rank (2 batches), 512 per update (2 ranks)" in start_line(2, "--update-freq", 2)
    assert "100 per batch, 100 per rank (1 batch), 200 per update (2 ranks)" in start_line(2, "--max-tokens", 100)


def test_one_rank_failing_ends_the_job_with_its_message(corpus, tmp_path):
    # MPMD launch: rank 1 is given a training corpus that does not exist
    good = _args(corpus, tmp_path / "run", "--max-steps", 50)
    bad = [str(a) for a in good]
    bad[bad.index(str(corpus / "train"))] = str(tmp_path / "missing")
    r = _run([MPIEXEC, "-n", 1, sys.executable, *good, ":", "-n", 1, sys.executable, *bad], tmp_path / "cache",
             timeout=120)
    assert r.returncode != 0
    assert "rank 1" in r.stderr and "missing" in r.stderr and "Traceback" not in r.stderr


def test_a_flag_one_rank_refuses_ends_the_job(corpus, tmp_path):
    # a usage error comes before MPI starts: the rank that refused its flags had exited without a word (only rank 0
    # says a flag error every rank meets) and the other waited for it in MPI's start for ever, spinning a core
    good = [str(a) for a in _args(corpus, tmp_path / "run", "--max-steps", 50)]
    bad = good + ["--max-steps", "abc"]
    for ranks, said in (((good, bad), "rank 1"), ((bad, good), "rank 0"), ((bad, bad), "rank 0")):
        r = _run([MPIEXEC, "-n", 1, sys.executable, *ranks[0], ":", "-n", 1, sys.executable, *ranks[1]],
                 tmp_path / "cache", timeout=60)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == 2 and errors == [f"{said}: train_wmt.py: error: argument --max-steps: must be an integer "
                                                f">= 0 (0 = no limit), got 'abc'"], r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "run" / "train_log.jsonl").exists()


def test_ranks_that_disagree_on_the_config_are_stopped_at_start(corpus, tmp_path):
    a = _args(corpus, tmp_path / "run", "--max-steps", 50)
    r = _run([MPIEXEC, "-n", 1, sys.executable, *a, ":", "-n", 1, sys.executable, *a, "--seed", 7, "--dropout", 0.3,
              "--valid-every", 20, "--patience", 2], tmp_path / "cache", timeout=120)
    assert r.returncode != 0 and "disagree" in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert errors and all(line.startswith("rank ") and line.count("error:") == 1 for line in errors), r.stderr
    assert "--seed 1 (rank 0) vs 7 (rank 1)" in errors[0] and "--dropout 0.0 (rank 0) vs 0.3 (rank 1)" in errors[0]
    # flags outside the config too (a --valid-every of one rank's own had crashed MPICH, a --patience hung the job)
    assert "--valid-every 0 (rank 0) vs 20 (rank 1)" in errors[0] and "--patience 0 (rank 0) vs 2 (rank 1)" in errors[0]
    assert len(errors) == 1 and len(errors[0]) < 400, r.stderr    # the differing fields, not both configs; once
    assert not (tmp_path / "run" / "train_log.jsonl").exists() or "loss" not in (tmp_path / "run" / "train_log.jsonl").read_text()


def test_more_batches_per_update_than_an_epoch_has_is_one_line(corpus, tmp_path):
    r = _run([MPIEXEC, "-n", 2, sys.executable, *_args(corpus, tmp_path / "run", "--update-freq", 500)],
             tmp_path / "cache", timeout=120)
    assert r.returncode != 0 and "batches per update" in r.stderr and "Traceback" not in r.stderr


def _gpus():
    from minitf.backend import gpu_available
    ok, _ = gpu_available()
    if not ok:
        return 0
    from minitf import backend
    return backend.cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs with CuPy and NCCL (NCCL refuses two ranks on one GPU)")
def test_two_gpu_ranks_over_nccl_equal_one_gpu_with_twice_the_update_freq(corpus, tmp_path):
    one = _train_ok(corpus, tmp_path, 1, "one", "--device", "gpu", "--max-steps", 3, "--update-freq", 2,
                    "--save-every", 3)
    two = _train_ok(corpus, tmp_path, 2, "two", "--device", "gpu", "--max-steps", 3, "--save-every", 3)
    _same(_params(one / "checkpoint_0000003.npz"), _params(two / "checkpoint_0000003.npz"))


def _rank_pid(launcher_pid, rank):
    """The pid of the process of `rank` among the descendants of the launcher (its environment
    names the rank, as every MPI launcher sets it)."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    todo, found = [launcher_pid], []
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"PMI_RANK={rank}".encode() in env and b"python" in open(f"/proc/{child}/cmdline", "rb").read():
                found.append(child)
    return found[0] if found else None


def test_sigterm_to_one_rank_is_named_by_every_rank(corpus, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree to stop at the same update, rank 0 saves and says
    the signal was SIGTERM on another rank, and the job exits 143 (as after SIGTERM to all)."""
    import signal
    import time
    out = tmp_path / "run"
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    p = subprocess.Popen([str(c) for c in [MPIEXEC, "-n", 2, sys.executable, *_args(corpus, out, "--max-steps", 0,
                                                                                      "--save-every", 100000)]],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "train_log.jsonl").exists() or (out / "train_log.jsonl").read_text().count("\n") < 2:
            assert p.poll() is None, p.stderr.read()[-2000:]
            assert time.time() < deadline, "training did not start"
            time.sleep(0.05)
        pid = _rank_pid(p.pid, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err[-2000:]
    assert "interrupted (SIGTERM on another rank)" in err and "SIGINT" not in err
    assert len(list(out.glob("checkpoint_*.npz"))) == 1
