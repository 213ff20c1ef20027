"""Shared fixtures: a tiny tokenizer + model checkpoint made on the spot (no shared data)."""
import gzip
import os

import numpy as np
import pytest

# CuPy reads CUPY_TF32 at its first float32 product, minitf's GEMMs at their first product of a dtype: with it set,
# float32 matmuls run on TF32 tensor cores (10-bit mantissas) and the GPU tests' float32 tolerances, set for float32
# arithmetic, fail. The benchmarks and training set it for speed; the tests run without it (no_tf32, below).
os.environ.pop("CUPY_TF32", None)

import minitf  # noqa: E402
from minitf.checkpoint import save_checkpoint  # noqa: E402
from minitf.data.tokenizer import Tokenizer  # noqa: E402

# Open MPI's mpiexec refuses to start as root (containers, GPU machines) unless told to; the tests' mpiexec
# runs inherit this (MPICH ignores it).
if hasattr(os, "geteuid") and os.geteuid() == 0:
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

WORDS = "the a cat dog sees runs small big red house tree man woman eats".split()

BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    """Several test processes (pytest-xdist's -n, as the README runs the suite): one BLAS thread each, unless the
    environment sets them. The test processes start after this (they and the commands the tests run inherit it).
    A BLAS thread with no work spins before it sleeps: on 2 cores, two test processes each with a second OpenBLAS
    thread took half the CPU from each other (one `base` update on the CuPy stand-in in each of two processes side by
    side: 13.3-13.7 s with NumPy's 2 threads, 6.2-6.3 s with 1; alone, 6.8 and 7.0 s)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    workers = getattr(config.option, "numprocesses", None)
    if workers not in (None, 0, 1):
        for var in BLAS_THREAD_VARS:
            os.environ.setdefault(var, "1")
    # the run's folder of compiles made once (tests/run_cache.py), removed at its end (pytest_unconfigure)
    import tempfile
    from run_cache import RUN_CACHE
    os.environ[RUN_CACHE] = config._minitf_run_cache = tempfile.mkdtemp(prefix="minitf-test-run-")


def pytest_unconfigure(config):
    folder = getattr(config, "_minitf_run_cache", None)
    if folder:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    """CUPY_TF32 unset in every test and after it (a test that wants TF32 sets it), and minitf's GEMMs' compute types
    looked up afresh: a bench script imported by a test (its argument parser, its functions) sets it for speed when it
    loads, and training sets it (train_wmt.py --device gpu in float32); the float32 attention and GEMMs read it."""
    from minitf import gemm
    monkeypatch.setenv("CUPY_TF32", "")    # recorded as it was, so that undoing the test removes what it set
    monkeypatch.delenv("CUPY_TF32")
    monkeypatch.setattr(gemm, "_TYPES", {})


@pytest.fixture
def standin(monkeypatch):
    """minitf's GPU path on tests/strict_cupy.py, the CuPy stand-in on NumPy, its RawKernels run
    through tests/cuda_emulator.py (skipped where no compiler builds the emulator)."""
    import strict_cupy
    from cuda_emulator import compiler
    from minitf import backend, kernels
    if compiler() is None:
        pytest.skip("needs g++ >= 12 to emulate the CUDA kernels on the CPU")
    monkeypatch.setattr(backend, "cupy", strict_cupy)
    monkeypatch.setattr(kernels, "_MODULES", {})
    monkeypatch.setattr(kernels, "COMPILE_ERRORS", {})
    return strict_cupy


def make_tiny_checkpoint(folder, n_layers=1, n_lines=300, seed=0):
    """Train a 60-piece SentencePiece model on random sentences and save an untrained tiny
    Transformer with it. Returns (checkpoint path, the sentences)."""
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(2, 8))) for _ in range(n_lines)]
    tok = Tokenizer.train(lines, folder / "spm.model", vocab_size=60)
    cfg = minitf.Config(vocab_size=tok.vocab_size, d_model=16, n_heads=2, d_ff=24, n_layers=n_layers)
    save_checkpoint(folder / "model.npz", minitf.Transformer(cfg, seed=0), tokenizer=tok.to_bytes())
    return folder / "model.npz", lines


EN = "a the man woman dog cat sees eats red big small house runs".split()
DE = "ein der mann frau hund katze sieht isst rot gross klein haus rennt".split()


def write_multi30k(folder, sizes=(("train", 400), ("val", 30), ("test_2016_flickr", 20)), seed=0):
    """A Multi30k-shaped folder of gzipped files: word-by-word 'translations' of 2-6 words, so
    there is something to learn. Returns the folder."""
    rng = np.random.default_rng(seed)
    for split, n in sizes:
        idx = [rng.integers(0, len(EN), size=rng.integers(2, 7)) for _ in range(n)]
        for lang, words in (("en", EN), ("de", DE)):
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(" ".join(words[i] for i in row) + "\n" for row in idx))
    return folder


def record_launches(monkeypatch):
    """The names of the kernels minitf.kernels launches from now on, in order (a list the caller may clear); each
    launch still runs (on the emulator, or the stand-in's)."""
    from minitf import kernels
    names, launch = [], kernels.LAUNCH["launch"]

    def record(name, *args):
        names.append(name)
        return launch(name, *args)
    monkeypatch.setitem(kernels.LAUNCH, "launch", record)
    return names
