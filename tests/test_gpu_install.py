"""The GPU extras install everything a machine with only an NVIDIA driver needs: CuPy with its
CUDA wheels ([ctk]: CuPy 14 compiles its own elementwise kernels with the CUDA headers) and
NCCL for several GPUs, for CUDA 12 (`gpu`) and CUDA 13 (`gpu13`) drivers alike."""
import os
import re

try:
    import tomllib
except ImportError:                      # Python < 3.11: the copy pip vendors
    from pip._vendor import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extras():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_each_gpu_extra_brings_cupy_with_its_cuda_wheels_and_nccl_of_one_cuda():
    for extra, cuda in (("gpu", "12"), ("gpu13", "13")):
        reqs = extras()[extra]
        cupy = [r for r in reqs if r.startswith("cupy")]
        assert len(cupy) == 1 and re.fullmatch(rf"cupy-cuda{cuda}x\[ctk\]>=(\d+)", cupy[0]), (extra, reqs)
        assert int(re.search(r">=(\d+)", cupy[0]).group(1)) >= 14          # [ctk] exists from CuPy 14
        assert any(re.fullmatch(rf"nvidia-nccl-cu{cuda}(>=[\d.]+)?", r) for r in reqs), (extra, reqs)
        assert any(r.startswith("ml_dtypes") for r in reqs), (extra, reqs)   # --bf16: CuPy's bfloat16 dtype


def test_the_readme_names_the_extras_that_exist():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    named = set(re.findall(r'"\.\[(\w+)\]"', readme))
    assert {"gpu", "gpu13", "dev"} <= named and named <= set(extras()), named
