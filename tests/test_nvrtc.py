"""The fused CUDA kernels (minitf/kernels.py) compile with NVRTC exactly as CuPy compiles them,
on machines without a GPU: for every storage dtype, for sm_80 (A100) and sm_90 (H100), and sm_75 (T4, RTX 20xx),
sm_86 (A10, A40, RTX 30xx) and sm_120 (RTX 50xx; with NVRTC 12.8 or newer, which knows it).

minitf builds each dtype's kernels with `cupy.RawModule(code=kernels.source(dtype),
options=("-std=c++14",))`. What CuPy then hands NVRTC, read in CuPy 13.6.0 and 14.0-14.2:

- cupy/_core/raw.pyx `_get_raw_module` calls cupy/_core/core.pyx `compile_with_cache` with
  `prepend_cupy_headers=False` (no CuPy header is put before the source), whose
  `assemble_cupy_compiler_options` keeps our `-std=c++14` (it adds `--std=c++11` in 13.x,
  `--std=c++17` in 14.x, only when no standard is given), puts the include directories of
  CuPy's bundled CCCL first (`-I<cupy>/_core/include/cupy/_cccl/{cub,thrust,libcudacxx}`) and
  appends `-I<cupy>/_core/include` and the CUDA headers' directory.
- cupy/cuda/compiler.py `_compile_with_cache_cuda` appends `-ftz=true` (and in 13.6
  `_get_extra_include_dir_opts()`, more `-I` for CUDA headers installed from wheels).
- `compile_using_nvrtc` (14.x: `_compile_using_nvrtc_no_warning`) appends
  `_get_arch_for_options_for_nvrtc(arch)`: `-arch=sm_XX` with the CUBIN kept (nvrtcGetCUBIN)
  when XX <= `_get_max_compute_capability()` (90 for NVRTC 12.0-12.7, 120 or 121 from 12.8)
  and CUPY_COMPILE_WITH_PTX is unset, else `-arch=compute_XX` and PTX; `_get_arch()` is the
  device's compute capability capped at that maximum. Then, without jitify (minitf's case),
  `--device-as-default-execution-space` (13.6 and 14.0: for NVRTC >= 12; 14.1+: always).
- `_NVRTCProgram.compile` runs nvrtcCompileProgram and nvrtcGetCUBIN; a failure raises
  CompileException with nvrtcGetProgramLog.
  Off unless asked for, and not asked for by minitf: `--device-debug --generate-line-info`
  (CUPY_CUDA_COMPILE_WITH_DEBUG), `--device-c` (cooperative groups), `-DCUPY_USE_JITIFY`,
  `--pch` (CUPY_NVRTC_USE_PCH), `-dlto`.

The `-I` directories hold CuPy's own headers and the CUDA toolkit's, which are not here
without CuPy; they are left out. The kernels include no header (float16 and bfloat16 go through the PTX
`cvt` instructions), so an include path changes nothing for them. Every other option is
CuPy's: `-std=c++14 -ftz=true -arch=sm_XX --device-as-default-execution-space`, so on an
A100 or H100 CuPy gets a CUBIN for the device itself, as here. (CuPy also compiles an empty
program with `-arch=compute_XX`, `_preprocess`, only to key its kernel cache.)
Checked on 2026-11-24 with cupy-cuda12x 13.6.0 and 14.2.0 and NVRTC 12.9 on a machine without
a GPU (CuPy's compile_with_cache called with arch="80"/"90", stopped before loading the
module): CuPy passed exactly these options plus its -I directories, and its CUBINs were
byte for byte the ones this file compiles, for every dtype and both architectures.

NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (the dev extra installs it on Linux
x86-64 and aarch64), loaded with ctypes. A compile error, or any diagnostic in NVRTC's log
(a warning included), fails the test with the log. The PTX of the same compile is read to
check each kernel's parameters against `kernels.SIGNATURES`, minitf's reading of the kernels'
declarations, which the CPU emulator's launchers take: the reading must give every parameter the width NVRTC
compiled it with. (What the Python wrappers pass is checked against the same types by the stand-in, which
refuses an argument whose dtype CuPy would pack otherwise: a kernel that expects another width reads garbage,
silently.)
"""
import base64
import ctypes
import functools
import glob
import importlib.util
import os
import platform
import re
import struct
import sys

import pytest

from minitf import kernels
from run_cache import once

ARCHS = ["sm_80", "sm_90", "sm_75", "sm_86", "sm_120"]   # A100, H100; T4, RTX 20xx; A10, A40, RTX 30xx; RTX 50xx
DTYPES = ["float16", "bfloat16", "float32", "float64"]
PACKAGE = "nvidia-cuda-nvrtc-cu12"


def cupy_options(arch):
    """The NVRTC options of CuPy's RawModule(code=..., options=("-std=c++14",)) on an sm_XX
    device, without CuPy's -I directories (see the module docstring)."""
    return ["-std=c++14", "-ftz=true", f"-arch={arch}", "--device-as-default-execution-space"]


# ----------------------------------------------------------------------------- libnvrtc via ctypes
def find_libnvrtc():
    """The path of a libnvrtc.so.*, or None: the nvidia-cuda-nvrtc-cu12 wheel's (nvidia/cuda_nvrtc/lib) first,
    then CUDA 13's wheels (nvidia/cu13/lib), then a CUDA toolkit's (CUDA_PATH, CUDA_HOME, /usr/local/cuda)."""
    def locations(name):
        try:
            spec = importlib.util.find_spec(name)   # namespace packages: no __init__.py
        except ImportError:                         # no nvidia.* package at all
            spec = None
        return list(spec.submodule_search_locations or []) if spec else []
    patterns = [os.path.join(folder, "lib", "libnvrtc.so.*") for folder in locations("nvidia.cuda_nvrtc")]
    patterns += [os.path.join(folder, "*", "lib", "libnvrtc.so.*") for folder in locations("nvidia")]
    patterns += [os.path.join(root, "lib64", "libnvrtc.so.*") for root in
                 (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda") if root]
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


class NVRTC:
    """The few libnvrtc calls CuPy's compile makes."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result, call):
        if result != 0:
            raise RuntimeError(f"{call}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def _get(self, prog, what):
        size = ctypes.c_size_t()
        self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), f"nvrtcGet{what}Size")
        buf = ctypes.create_string_buffer(size.value)
        self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
        return buf.raw

    def compile(self, source, options):
        """(succeeded, log, cubin, ptx); cubin and ptx are b"" when it failed."""
        prog = ctypes.c_void_p()
        # the program's name only labels the log (CuPy names it after the cache file)
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kern.cu", 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._get(prog, "ProgramLog").rstrip(b"\0").decode(errors="replace").strip()
            if result != 0:
                return False, f"{self.lib.nvrtcGetErrorString(result).decode()}\n{log}", b"", ""
            return True, log, self._get(prog, "CUBIN"), self._get(prog, "PTX").rstrip(b"\0").decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc():
    path = find_libnvrtc()
    if path is None:
        reason = f"libnvrtc not found: pip install {PACKAGE} (part of the dev extra on Linux x86-64/aarch64)"
        if os.environ.get("CI") == "true" and sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
            pytest.fail(f"{reason}; CI installs the dev extra, so it must be there")
        pytest.skip(reason)
    return NVRTC(path)


def assert_compiled(result, what):
    """Fails with NVRTC's log when the compile failed or NVRTC said anything (a warning too)."""
    ok, log, cubin, ptx = result
    assert ok, f"NVRTC could not compile {what}:\n{log}"
    assert not log, f"NVRTC compiled {what} with diagnostics:\n{log}"
    assert cubin and ptx, f"NVRTC returned an empty CUBIN or PTX for {what}"


# ----------------------------------------------------------------------------- reading the outputs
def cubin_functions(cubin):
    """Names of the global functions (the kernels) in the symbol table of an ELF64 CUBIN."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2 and cubin[5] == 1, "not a 64-bit little-endian ELF image"
    assert struct.unpack_from("<H", cubin, 0x12)[0] == 190, "not a CUDA ELF image (e_machine != EM_CUDA)"
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info = struct.unpack_from("<IB", cubin, at)
            if info >> 4 == 1 and info & 0xF == 2:  # STB_GLOBAL, STT_FUNC
                start = strings + name
                names.add(cubin[start:cubin.index(b"\0", start)].decode())
    return names


def ptx_entries(ptx):
    """{kernel name: [PTX parameter type, ...]} from the `.entry name(.param .u64 a, ...)` lines."""
    return {m.group(1): re.findall(r"\.param\s+(?:\.align\s+\d+\s+)?(\.\w+)", m.group(2))
            for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)}


PTX_TYPE = {"int": ".u32", "unsigned int": ".u32", "long long": ".u64", "unsigned long long": ".u64",
            "float": ".f32", "double": ".f64"}


def expected_ptx_types(signature, dtype):
    """The PTX parameter types of a kernel taking `signature` (kernels.SIGNATURES' C types)."""
    storage, accum = kernels.C_TYPES[kernels.dtype_name(dtype)]
    out = []
    for c in signature:
        if c.endswith("*"):
            out.append(".u64")
        else:
            c = {"T": storage, "A": accum}.get(c, c)
            out.append(PTX_TYPE.get(c, f"<{c}: add its PTX type to tests/test_nvrtc.py>"))
    return out


def signature_mismatches(ptx, signatures, dtype):
    """Where the compiled kernels and `signatures` disagree (names, parameter count or types)."""
    entries = ptx_entries(ptx)
    problems = [f"{name}: in SIGNATURES, not in the PTX" for name in sorted(set(signatures) - set(entries))]
    problems += [f"{name}: in the PTX, not in SIGNATURES" for name in sorted(set(entries) - set(signatures))]
    for name in sorted(set(signatures) & set(entries)):
        want = expected_ptx_types(signatures[name], dtype)
        if entries[name] != want:
            problems.append(f"{name}: the kernel takes {entries[name]}, SIGNATURES {signatures[name]} means {want}")
    return problems


# ----------------------------------------------------------------------------- minitf's kernels
@functools.lru_cache(maxsize=None)
def compiled(nvrtc, dtype, arch):
    """NVRTC's result for minitf's source, compiled once a test run per (dtype, arch) for all the tests (by the
    first of the test processes to ask: tests/run_cache.py)."""
    source, options = kernels.source(dtype), cupy_options(arch)

    def make():
        ok, log, cubin, ptx = nvrtc.compile(source, options)
        return [ok, log, base64.b64encode(cubin).decode(), ptx]
    ok, log, cubin, ptx = once("\n".join([nvrtc.path, repr(nvrtc.version), *options, source]), make)
    return ok, log, base64.b64decode(cubin), ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compile_as_cupy_compiles_them(nvrtc, dtype, arch):
    if arch == "sm_120" and nvrtc.version < (12, 8):
        pytest.skip(f"NVRTC {nvrtc.version[0]}.{nvrtc.version[1]} does not know sm_120 (12.8 and newer do)")
    result = compiled(nvrtc, dtype, arch)
    assert_compiled(result, f"minitf's {dtype} kernels for {arch} (NVRTC {nvrtc.version[0]}.{nvrtc.version[1]})")
    _, _, cubin, ptx = result
    assert f".target {arch}" in ptx.splitlines()
    missing = set(kernels.SIGNATURES) - cubin_functions(cubin)
    assert not missing, f"the {arch} CUBIN lacks the kernels {sorted(missing)}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_parameters_match_signatures(nvrtc, dtype):
    result = compiled(nvrtc, dtype, ARCHS[0])
    assert_compiled(result, f"minitf's {dtype} kernels")
    problems = signature_mismatches(result[3], kernels.SIGNATURES, dtype)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the checks can fail
def test_compile_error_fails_with_the_log(nvrtc):
    broken = 'extern "C" __global__ void k(float* x) { x[0] = not_declared; }'
    ok, log, cubin, _ = nvrtc.compile(broken, cupy_options("sm_80"))
    assert not ok and not cubin
    with pytest.raises(AssertionError, match="(?s)could not compile.*not_declared"):
        assert_compiled((ok, log, cubin, ""), "a broken source")


def test_warning_fails_with_the_log(nvrtc):
    warns = 'extern "C" __global__ void k(float* x) { int unused; x[0] = 1.0f; }'
    result = nvrtc.compile(warns, cupy_options("sm_90"))
    assert result[0], result[1]
    with pytest.raises(AssertionError, match="(?s)with diagnostics.*unused"):
        assert_compiled(result, "a source with an unused variable")


def test_signature_mismatch_is_reported(nvrtc):
    source = 'extern "C" __global__ void k(const float* x, long long n, float s) { }'
    result = nvrtc.compile(source, cupy_options("sm_80"))
    assert_compiled(result, "a one-kernel source")
    ptx = result[3]
    assert signature_mismatches(ptx, {"k": ["float*", "long long", "float"]}, "float32") == []
    assert signature_mismatches(ptx, {"k": ["float*", "long long", "A"]}, "float64") != []   # double, not float
    assert signature_mismatches(ptx, {"k": ["float*", "int", "float"]}, "float32") != []       # 4 bytes, not 8
    assert signature_mismatches(ptx, {"k": ["float*", "long long"]}, "float32") != []           # one fewer
    assert signature_mismatches(ptx, {"j": ["float*", "long long", "float"]}, "float32") != []  # other name
