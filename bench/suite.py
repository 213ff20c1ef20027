"""The GPU tests as the GPU benches run them (bench/gpu_report.py's suite section, bench/gpu_tune.py's first stage):
the command and the counts of pytest's last line. Importing it sets nothing (the benches that time set CUPY_TF32)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/test_gpu.py", "tests/test_nvrtc.py")
# What runs on the GPU itself: the kernels and the whole step against NumPy (test_nvrtc.py compiles for several
# architectures, the GPU's or not; ~60 s of NVRTC on a 2-core CPU, which CI runs too)
ON_THE_GPU = ("tests/test_gpu.py",)
ENV = {"COLUMNS": "250"}   # wide lines keep the failure summaries whole


def command(files=FILES):
    """pytest on those of `files` there are (the GPU tests), run from the project's root."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(f for f in files if (ROOT / f).exists())]


def counts(text):
    """{'passed': n, 'failed': n, 'skipped': n, 'error': n} as pytest's last line of `text` gives them."""
    lines = text.strip().splitlines()
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", lines[-1] if lines else "")}


def all_passed(text):
    """Whether pytest's last line counts passed tests and no failure or error."""
    c = counts(text)
    return c.get("passed", 0) > 0 and not c.get("failed") and not c.get("error")
