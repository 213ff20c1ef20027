"""The fused CUDA kernels (minitf/kernels.py) against the generic NumPy path, on the CPU.

The kernels' CUDA source runs here through tests/cuda_emulator.py (g++; a block's CUDA threads are
coroutines on one OS thread, each running to its next barrier in turn), through the same Python
wrappers the GPU uses; tests/test_gpu.py compares the fused path with the generic one with CuPy on
a GPU (elsewhere on the strict CuPy stand-in). Shapes are chosen so rows are shorter than, equal to and
longer than a block, and not multiples of it.
"""
import ctypes
import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from minitf import functional as F
from minitf import kernels
from minitf.backend import dtype_named
from minitf.loss import FusedLossCache, label_smoothed_nll, label_smoothed_nll_backward

from conftest import record_launches
from cuda_emulator import SHIM, Emulator, compiler, kernel_dir
from run_cache import once

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ with C++17, _Float16 and ucontext (g++ >= 12 on x86-64 Linux) to emulate the CUDA kernels")

BF16 = dtype_named("bfloat16")
DTYPES = [np.float64, np.float32, np.float16, pytest.param(BF16, id="bfloat16")]
# float64 computes in double like NumPy; float32 and the 16-bit dtypes compute in float32 (the generic
# path too); a value stored in bfloat16 keeps 8 bits of mantissa (float16 11)
TOL = {np.float64: 1e-12, np.float32: 2e-6, np.float16: 2e-3, BF16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def emulated():
    emu = Emulator(kernel_dir())
    saved = kernels.LAUNCH["launch"]
    kernels.LAUNCH["launch"] = emu.launch
    yield emu
    kernels.LAUNCH["launch"] = saved


def equal(a, b):
    """The same values, NaN where NaN (bfloat16 compared through float32, which holds it exactly)."""
    a, b = (x.astype(np.float32) if x.dtype == BF16 else x for x in (a, b))
    np.testing.assert_array_equal(a, b)


def close(a, b, dtype, scale=1.0):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    err = np.abs(a - b).max() / max(np.abs(b).max(), scale)
    assert err <= TOL[dtype], err


# The PTX ISA's fragment tables ("Matrix Fragments for mma.m16n8k16 with floating point type"; "ldmatrix"), stated
# here apart from the emulator: lane = 4 * groupID + threadID_in_group; element i of a lane's fragment (two 16-bit
# values a register, element 2j in register j's low half) -> (row, column) of its matrix.
def _ptx_a(g, t, i):   # A, 16 x 16 (.row)
    return g + 8 * (i in (2, 3, 6, 7)), 2 * t + (i & 1) + 8 * (i >= 4)


def _ptx_b(g, t, i):   # B, 16 x 8 (.col)
    return 2 * t + (i & 1) + 8 * (i >= 2), g


def _ptx_c(g, t, i):   # C and D, 16 x 8, float
    return g + 8 * (i >= 2), 2 * t + (i & 1)


# "Matrix Fragments for mma.m16n8k8" with .tf32 operands: one value a register.
def _ptx_a_tf32(g, t, i):   # A, 16 x 8 (.row): a0, a2 row groupID, a1, a3 groupID + 8; a0, a1 column tig, a2, a3 tig + 4
    return g + 8 * (i & 1), t + 4 * (i >> 1)


def _ptx_b_tf32(g, t, i):   # B, 8 x 8 (.col): b0 row tig, b1 tig + 4; column groupID
    return t + 4 * i, g


PROBES = r"""
extern "C" __global__ void probe_mma(const unsigned* a, const unsigned* b, float* c, int bf) {
    unsigned l = threadIdx.x;
    if (bf) emu_mma_16816<1>(c + 4 * l, a + 4 * l, b + 2 * l);
    else emu_mma_16816<0>(c + 4 * l, a + 4 * l, b + 2 * l);
}
extern "C" __global__ void probe_mma_tf32(const unsigned* a, const unsigned* b, float* c) {
    unsigned l = threadIdx.x;
    emu_mma_1688_tf32(c + 4 * l, a + 4 * l, b + 2 * l);
}
extern "C" __global__ void probe_ldmatrix(const unsigned short* src, const long long* row, unsigned* d, int trans) {
    unsigned l = threadIdx.x;
    if (trans) emu_ldmatrix_x4<1>(d + 4 * l, src + row[l]);
    else emu_ldmatrix_x4<0>(d + 4 * l, src + row[l]);
}
"""


MISUSED_BARRIERS = r"""
typedef float T;
typedef float A;
// threads at or past n leave before the barrier the others wait at
extern "C" __global__ void leaves_early(float* x, int n) {
    if ((int)threadIdx.x >= n) return;
    __syncthreads();
    x[threadIdx.x] = 1.0f;
}
// lanes below n shuffle with the whole warp's mask while the others go on to the block's barrier
extern "C" __global__ void shuffles_apart(float* x, int n) {
    float v = x[threadIdx.x];
    if ((int)threadIdx.x < n) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    x[threadIdx.x] = v;
}
// lanes at or past n return while the others shuffle with the whole warp's mask
extern "C" __global__ void shuffles_alone(float* x, int n) {
    if ((int)threadIdx.x >= n) return;
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}
// lanes below 16 shuffle with a mask of just them, reading lane + 1 (allowed) where n is 32, else lane ^ n: for n = 16
// a lane the mask does not name
extern "C" __global__ void shuffles_outside(float* x, int n) {
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffu, v, n == 32 ? 1 : n);
    __syncthreads();
    x[threadIdx.x] = v;
}
// lanes at or past n shuffle with a mask that names lane 0 and them, the others with the whole warp's mask: each waits
// for a lane at another mask, forever
extern "C" __global__ void shuffles_unmatched(float* x, int n) {
    unsigned mask = (int)threadIdx.x < n ? 0xffffffffu : 0xffff0001u;
    x[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 1);
}
// lanes below n make a tensor-core product (the emulator's mma.sync) while the others shuffle twice with the whole
// warp's mask: each waits for lanes at another instruction
extern "C" __global__ void mma_against_shuffles(float* x, int n) {
    float v = x[threadIdx.x];
    if ((int)threadIdx.x < n) {
        unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
        float c[4] = {0, 0, 0, 0};
        emu_mma_16816<0>(c, a, b);
        v += c[0];
    } else {
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
    }
    x[threadIdx.x] = v;
}
// lanes 0-15 shuffle among themselves, then the whole warp together, then lanes 16-31 among themselves (allowed: a
// shuffle of the whole warp waits for lanes 0-15 to come to it); n unused
extern "C" __global__ void shuffles_in_turn(float* x, int n) {
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v += 10.0f * __shfl_xor_sync(0xffffu, v, 1);
    v += 100.0f * __shfl_xor_sync(0xffffffffu, v, 16);
    if (threadIdx.x >= 16) v += 1000.0f * __shfl_xor_sync(0xffff0000u, v, 1);
    x[threadIdx.x] = v;
}
// lanes below n shuffle with a mask of just them (allowed) while the others go on to the block's barrier; n even
extern "C" __global__ void shuffles_masked(float* x, int n) {
    float v = x[threadIdx.x];
    if ((int)threadIdx.x < n) v = __shfl_xor_sync(n == 32 ? 0xffffffffu : (1u << n) - 1u, v, 1);
    __syncthreads();
    x[threadIdx.x] = v;
}
"""
def _launch_one_block(lib, name, threads, n):
    """launch_<name> of `lib` (MISUSED_BARRIERS built) on one block of `threads` threads over x = 0, 1, ..., with n:
    (x after it, what stopped the emulation or None)."""
    x = np.arange(threads, dtype=np.float32)
    return x, getattr(lib, f"launch_{name}")(ctypes.c_uint(1), ctypes.c_uint(threads), ctypes.c_void_p(x.ctypes.data),
                                            ctypes.c_int(n))


KERNELS_MISUSING = ("leaves_early", "shuffles_apart", "shuffles_alone", "shuffles_outside", "shuffles_unmatched",
                    "mma_against_shuffles")


@pytest.mark.parametrize("kernel,says", [("leaves_early", "ended while others wait at __syncthreads"),
                                         ("shuffles_apart", "mask skipped it"), ("shuffles_alone", "mask skipped it"),
                                         ("shuffles_outside", "reads a lane its mask does not name"),
                                         ("shuffles_unmatched", "none of which can pass"),
                                         ("mma_against_shuffles", "none of which can pass")])
def test_the_emulator_refuses_a_barrier_some_threads_skip(tmp_path, kernel, says):
    """A __syncthreads some threads of the block never reach (they returned), a warp-collective instruction some
    lanes of its mask skip (for the block's barrier, or returning), and a shuffle that reads a lane outside its mask
    are undefined on a GPU: the emulator stops the launch and says which, where every thread taking the same path
    runs; a shuffle whose mask names only the lanes that make it runs either way, and gives each lane its partner's
    value."""
    from cuda_emulator import build
    lib = build(MISUSED_BARRIERS, {name: ["float*", "int"] for name in KERNELS_MISUSING + ("shuffles_masked",)},
                str(tmp_path), "barriers")

    assert _launch_one_block(lib, kernel, 32, 32)[1] is None
    error = _launch_one_block(lib, kernel, 32, 16)[1]
    assert error is not None and says in error.decode()
    x, error = _launch_one_block(lib, "shuffles_masked", 32, 16)
    assert error is None and x.tolist() == [i ^ 1 for i in range(16)] + list(range(16, 32))


def test_the_emulator_lets_lanes_shuffle_in_turn_and_refuses_a_mask_past_the_block(tmp_path):
    """A shuffle passes when every lane its mask names is at a shuffle with that mask: lanes 0-15 may shuffle among
    themselves while lanes 16-31 wait at a shuffle of the whole warp, and each gets what CUDA gives. A mask that names
    lanes past the block's last thread (a block of 48 threads, the whole warp's mask in its second warp) stops the
    launch: those lanes never come."""
    from cuda_emulator import build
    lib = build(MISUSED_BARRIERS, {name: ["float*", "int"] for name in ("shuffles_in_turn", "shuffles_alone")},
                str(tmp_path), "in_turn")
    x, error = _launch_one_block(lib, "shuffles_in_turn", 32, 0)
    assert error is None
    want = np.arange(32, dtype=np.float32)
    lane = np.arange(32)
    want[:16] += 10 * want[lane[:16] ^ 1]
    want = want + 100 * want[lane ^ 16]
    want[16:] += 1000 * want[16:][(lane[16:] ^ 1) - 16]
    np.testing.assert_array_equal(x, want)    # e.g. lane 1: 1701, lane 16: 118016, lane 17: 1016117
    assert (x[1], x[16], x[17]) == (1701, 118016, 1016117)
    error = _launch_one_block(lib, "shuffles_alone", 48, 48)[1]
    assert error is not None and b"past the block's last thread" in error


MISALIGNED = r"""
typedef float T;
typedef float A;
struct alignas(16) Vec4 { float v[4]; };
// each reads (or writes) 16 bytes at x + n: 16-byte aligned for n a multiple of 4, not otherwise
extern "C" __global__ void vec_load_at(float* x, int n) {
    Vec4 v = *(const Vec4*)(x + n);
    __syncthreads();
    x[threadIdx.x] = v.v[0] + v.v[3];
}
extern "C" __global__ void vec_store_at(float* x, int n) {
    if (threadIdx.x == 0) *(Vec4*)(x + n) = Vec4{{1.0f, 2.0f, 3.0f, 4.0f}};
}
extern "C" __global__ void ldmatrix_at(float* x, int n) {
    unsigned d[4];
    emu_ldmatrix_x4<0>(d, x + n + 4 * (threadIdx.x & 7u));
    x[32 + threadIdx.x] = (float)(d[0] & 0xffffu);
}
// a __shared__ array, and a thread's own array, indexed at n (past its end for n >= 32, or 4)
extern "C" __global__ void shared_at(float* x, int n) {
    __shared__ float staged[32];
    __shared__ float after[32];
    staged[threadIdx.x] = x[threadIdx.x];
    after[threadIdx.x] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) staged[n] = -1.0f;
    __syncthreads();
    x[32 + threadIdx.x] = staged[threadIdx.x] + after[threadIdx.x];
}
extern "C" __global__ void local_at(float* x, int n) {
    float kept[4] = {x[0], x[1], x[2], x[3]};
    x[32 + threadIdx.x] = kept[n > 3 ? n : (int)threadIdx.x % 4];
}
// a shift by n (by the width or more for n >= 32), an integer division by n - 4
extern "C" __global__ void shift_by(float* x, int n) {
    x[32 + threadIdx.x] = (float)((1u << n) >> 16);
}
extern "C" __global__ void divide_by(float* x, int n) {
    x[32 + threadIdx.x] = (float)((int)threadIdx.x / (n - 4));
}
extern "C" __global__ void cp_async_at(float* x, int n) {
    __shared__ Vec4 staged[32];
    emu_cp_async16(&staged[threadIdx.x], x + n, 16);
    emu_cp_async_wait_all();
    __syncthreads();
    x[32 + threadIdx.x] = staged[threadIdx.x].v[0];
}
"""


@pytest.mark.parametrize("kernel,says", [("vec_load_at", "a misaligned reference binding ('const struct Vec4') at"),
                                         ("vec_store_at", "a misaligned store ('struct Vec4') at"),
                                         ("ldmatrix_at", "ldmatrix: a row's address not 16-byte aligned"),
                                         ("cp_async_at", "cp.async: a 16-byte copy from global memory"),
                                         ("shared_at", "index 33 out of bounds for 'float [32]'"),
                                         ("local_at", "index 5 out of bounds for 'float [4]'"),
                                         ("shift_by", "a shift of 'unsigned int' by 32"),
                                         ("divide_by", "an integer division or remainder of 'int' by 0")])
def test_the_emulator_stops_where_a_gpu_and_a_cpu_differ(tmp_path, kernel, says):
    """A GPU stops a kernel that loads or stores a type at an address its alignment does not divide ("misaligned
    address": a 16-byte vector off a 16-byte boundary, an ldmatrix row or a cp.async copy likewise), where an x86 CPU
    reads and writes on: the emulator's library checks typed loads and stores (-fsanitize=alignment) and ldmatrix's and
    cp.async's addresses, and stops the launch saying which, with the line of the kernels' source. So does an index
    past an array of known length (-fsanitize=bounds): a __shared__ array's (on a GPU it reaches the array beside it,
    silently) or a thread's local array's; and a shift by the type's width or more (a GPU gives 0 or the sign bits, x86
    shifts by the amount modulo the width) and an integer division by 0 (a GPU gives some value, x86 stops the
    process)."""
    from cuda_emulator import build
    lib = build(MISALIGNED, {kernel: ["float*", "int"]}, str(tmp_path), "misaligned")

    def launch(n):
        x = np.zeros(128, dtype=np.float32)   # NumPy's memory: 16-byte aligned at least
        assert x.ctypes.data % 16 == 0
        return getattr(lib, f"launch_{kernel}")(ctypes.c_uint(1), ctypes.c_uint(32), ctypes.c_void_p(x.ctypes.data),
                                                ctypes.c_int(n))
    fine, wrong = {"shared_at": (4, 33), "local_at": (3, 5), "shift_by": (31, 32), "divide_by": (5, 4)}.get(kernel, (4, 1))
    assert launch(fine) is None
    error = launch(wrong)
    assert error is not None and says in error.decode(), error
    access = {"vec_load_at": "*(const Vec4*)(x + n)", "vec_store_at": "*(Vec4*)(x + n)", "shared_at": "staged[n]",
              "local_at": "kept[n > 3", "shift_by": "(1u << n)", "divide_by": "/ (n - 4)"}.get(kernel)
    if access:   # the line of the access in MISALIGNED
        line = 1 + next(i for i, ln in enumerate(MISALIGNED.split("\n")) if access in ln)
        assert error.decode().endswith(f"line {line} of the kernels' source"), error


def test_the_emulator_reads_a_local_never_written_as_one_pattern(tmp_path):
    """A local variable read before anything is written to it holds anything on a GPU (a register): the emulator's
    library fills every local with 0xfe bytes where it is declared (-ftrivial-auto-var-init=pattern), so such a read
    gives the same value of about -1.7e38 (float's 0xfefefefe) every time, not whatever an earlier launch or call left on
    the thread's stack."""
    from cuda_emulator import build
    code = """
typedef float T;
typedef float A;
extern "C" __global__ void leftover(float* x, int n) {
    float v[2];
    if (n) { v[0] = x[threadIdx.x] + 1.0f; v[1] = 2.0f; }
    x[threadIdx.x] = v[0] + v[1];
}
"""
    lib = build(code, {"leftover": ["float*", "int"]}, str(tmp_path), "leftover")
    def launch(n):
        x = np.arange(4, dtype=np.float32)
        assert lib.launch_leftover(ctypes.c_uint(1), ctypes.c_uint(4), ctypes.c_void_p(x.ctypes.data),
                                   ctypes.c_int(n)) is None
        return x
    np.testing.assert_array_equal(launch(1), [3, 4, 5, 6])
    never_written = launch(0)
    assert (never_written < -1e38).all() and len(set(never_written.tolist())) == 1, never_written
    np.testing.assert_array_equal(launch(1), [3, 4, 5, 6])
    np.testing.assert_array_equal(launch(0), never_written)


@pytest.mark.parametrize("bf", [0, 1], ids=["float16", "bfloat16"])
def test_the_emulated_mma_and_ldmatrix_follow_the_ptx_isa_tables(tmp_path, bf):
    """The tensor-core attention is tested on the CPU only through the emulator's mma.sync m16n8k16 and ldmatrix
    .x4 (.trans): they are held here to the PTX ISA's fragment tables, stated above apart from the emulator. mma: D =
    A B + C over a warp, fragments placed by the tables (D exact: small integers). ldmatrix: the four 8 x 8 matrices'
    rows at addresses the lanes give (lanes 8 i .. 8 i + 7: matrix i), and what each lane receives."""
    from cuda_emulator import build
    lib = build(PROBES, {"probe_mma": ["unsigned int*", "unsigned int*", "float*", "int"],
                         "probe_ldmatrix": ["unsigned short*", "long long*", "unsigned int*", "int"]},
                str(tmp_path), "probes")
    rng = np.random.default_rng(bf)
    half = BF16 if bf else np.float16
    a, b = rng.integers(-8, 9, (16, 16)), rng.integers(-8, 9, (16, 8))
    c0 = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    bits = lambda m: m.astype(np.float32).astype(half).view(np.uint16).astype(np.uint32)   # noqa: E731
    ab, bb = bits(a), bits(b)
    fa, fb, fc = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(8):
            fa[lane, i // 2] |= ab[_ptx_a(g, t, i)] << (16 * (i & 1))
        for i in range(4):
            fb[lane, i // 2] |= bb[_ptx_b(g, t, i)] << (16 * (i & 1))
            fc[lane, i] = c0[_ptx_c(g, t, i)]
    ptr = lambda x: ctypes.c_void_p(x.ctypes.data)   # noqa: E731
    lib.launch_probe_mma(ctypes.c_uint(1), ctypes.c_uint(32), ptr(fa), ptr(fb), ptr(fc), ctypes.c_int(bf))
    want = a @ b + c0
    for lane in range(32):
        for i in range(4):
            assert fc[lane, i] == want[_ptx_c(lane >> 2, lane & 3, i)], (lane, i)
    # ldmatrix: matrix m's row r holds the values 256 m + 8 r + col, its rows scattered (16-byte aligned) in src
    src = np.zeros(40 * 8, np.uint16)
    place = rng.permutation(40)[:32]                      # where each (matrix, row) lies, in rows of 8 values
    for m in range(4):
        for r in range(8):
            src[8 * place[8 * m + r]: 8 * place[8 * m + r] + 8] = 256 * m + 8 * r + np.arange(8)
    rows = (8 * place).astype(np.int64)                   # lane 8 m + r gives matrix m's row r
    for trans in (0, 1):
        d = np.zeros((32, 4), np.uint32)
        lib.launch_probe_ldmatrix(ctypes.c_uint(1), ctypes.c_uint(32), ptr(src), ptr(rows), ptr(d), ctypes.c_int(trans))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for m in range(4):   # each lane: row g, columns 2t and 2t + 1; with .trans rows 2t and 2t + 1 of column g
                lo, hi = ((256 * m + 8 * (2 * t) + g, 256 * m + 8 * (2 * t + 1) + g) if trans else
                          (256 * m + 8 * g + 2 * t, 256 * m + 8 * g + 2 * t + 1))
                assert d[lane, m] == lo | (hi << 16), (trans, lane, m)


def test_the_emulated_tf32_mma_follows_the_ptx_isa_table(tmp_path):
    """The float32 tensor-core attention (TF32 operands) is tested on the CPU only through the emulator's mma.sync
    m16n8k8: it is held here to the PTX ISA's fragment table for .tf32, stated above apart from the emulator: D = A B
    + C over a warp (D exact: small integers, and the operands' low 13 bits, which the tensor cores do not read, set
    to garbage)."""
    from cuda_emulator import build
    lib = build(PROBES, {"probe_mma_tf32": ["unsigned int*", "unsigned int*", "float*"]}, str(tmp_path), "probes_tf32")
    rng = np.random.default_rng(7)
    a, b = rng.integers(-8, 9, (16, 8)), rng.integers(-8, 9, (8, 8))
    c0 = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    bits = lambda m: m.astype(np.float32).view(np.uint32) | rng.integers(0, 1 << 13, m.shape).astype(np.uint32)  # noqa
    ab, bb = bits(a), bits(b)
    fa, fb, fc = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            fa[lane, i] = ab[_ptx_a_tf32(g, t, i)]
            fc[lane, i] = c0[_ptx_c(g, t, i)]
        for i in range(2):
            fb[lane, i] = bb[_ptx_b_tf32(g, t, i)]
    ptr = lambda x: ctypes.c_void_p(x.ctypes.data)   # noqa: E731
    lib.launch_probe_mma_tf32(ctypes.c_uint(1), ctypes.c_uint(32), ptr(fa), ptr(fb), ptr(fc))
    want = a @ b + c0
    for lane in range(32):
        for i in range(4):
            assert fc[lane, i] == want[_ptx_c(lane >> 2, lane & 3, i)], (lane, i)


def test_the_emulators_bfloat16_narrowing_rounds_as_ml_dtypes(tmp_path):
    """bfloat16's narrowing on the emulator is the kernels' own integer rounding, which a GPU before sm_80 (whose PTX
    has no bfloat16 conversion) runs in place of cvt.rn.bf16.f32: it must round to nearest even exactly as ml_dtypes
    (the generic path's bfloat16) does, ties, NaN, infinities, float32's subnormals and overflow to infinity included,
    and widen back without loss."""
    src, so = tmp_path / "bf16.cpp", tmp_path / "bf16.so"
    src.write_text(SHIM + kernels.STORAGE16 + kernels.BFLOAT16 + """
extern "C" void narrow(const float* x, unsigned short* y, long long n) { for (long long i = 0; i < n; i++) y[i] = f2bf(x[i]); }
extern "C" void widen(const unsigned short* x, float* y, long long n) { for (long long i = 0; i < n; i++) y[i] = bf2f(x[i]); }
""")
    subprocess.run([compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                           (rng.integers(0, 2 ** 16, 4096, dtype=np.uint32) << 16) | 0x8000,   # ties
                           np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0x00000001, 0x807FFFFF, 0x7FC00001,
                                     0x7F800001, 0x3F808000, 0x3F818000], dtype=np.uint32)])
    x = bits.view(np.float32)
    got = np.empty(x.size, dtype=np.uint16)
    lib.narrow(x.ctypes.data_as(ctypes.c_void_p), got.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(x.size))
    want = x.astype(BF16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(BF16).astype(np.float32)))
    back = np.empty(got.size, dtype=np.float32)
    lib.widen(got.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(got.size))
    equal(back, got.view(BF16).astype(np.float32))


def neg(dtype):
    return -3e4 if dtype == np.float16 else -1e9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [5, 33, 128, 256, 257, 300])
def test_masked_softmax_padding_and_causal(dtype, s):
    """Rows up to 256 long take the warp kernel, longer ones a block per row; 45 rows, not a multiple
    of the warp kernel's 8 rows a block (4 warps of WARP_ROW_RUN = 2 rows): the last warp's second row
    lies past the end, and the two rows of a warp are two query positions with masks of their own."""
    assert kernels.WARP_ROWS * kernels.WARP_ROW_RUN == 8
    rng = np.random.default_rng(s)
    b, h, t = 3, 3, 5
    scores = (rng.normal(size=(b, h, t, s)) * 3).astype(dtype)
    pad = np.zeros((b, 1, 1, s), dtype=dtype)
    pad[1, ..., s // 2:] = neg(dtype)                       # second sentence half padding
    p = kernels.masked_softmax(scores, pad)
    close(p, F.softmax_forward(scores + pad), dtype)
    assert np.all(p[1, ..., s // 2:] == 0)
    # causal + padding: [B, 1, T, S] with a different mask per query row
    causal = np.triu(np.full((t, s), neg(dtype), dtype=dtype), k=1)[None, None] + pad
    p = kernels.masked_softmax(scores, causal)
    close(p, F.softmax_forward(scores + causal), dtype)
    np.testing.assert_allclose(p.astype(np.float64).sum(-1), 1.0, atol={np.float16: 3e-3, BF16: 2e-2}.get(dtype, 1e-6))
    # in place, and a bias shared by the whole batch (stride 0 on B)
    out = scores.copy()
    kernels.masked_softmax(out, causal[:1], out=out)
    close(out, F.softmax_forward(scores + causal[:1]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [5, 35, 301])
def test_softmax_rows_a_pitch_apart(dtype, s):
    """Rows of s values kernels.row_pitch apart (the head layout's attention weights; s whole vectors in no dtype, so
    the pitch is longer in each): the same bits as the same rows packed tight, forward and backward, in the warp
    kernels (s <= 256) and the block ones; the values past s are neither read (NaNs there change nothing) nor
    written (they keep their bits). An output gradient shaped otherwise than the weights is refused."""
    rng = np.random.default_rng(s)
    b, h, t = 2, 3, 5
    pitch = kernels.row_pitch(s, dtype)
    assert pitch % (16 // np.dtype(dtype).itemsize) == 0 and s < pitch < s + 16 // np.dtype(dtype).itemsize
    scores = (rng.normal(size=(b, h, t, s)) * 3).astype(dtype)
    bias = np.triu(np.full((t, s), neg(dtype), dtype=dtype), k=1)[None, None]
    wide = np.full((b, h, t, pitch), np.nan, dtype=dtype)
    wide[..., :s] = scores
    kernels.masked_softmax(wide, bias, out=wide, n=s)
    assert wide[..., :s].tobytes() == kernels.masked_softmax(scores, bias).tobytes()
    assert np.isnan(wide[..., s:].astype(np.float32)).all()
    dp = rng.normal(size=(b, h, t, s)).astype(dtype)
    dwide = np.full((b, h, t, pitch), np.nan, dtype=dtype)
    dwide[..., :s] = dp
    kernels.softmax_backward(dwide, wide, out=dwide, n=s)
    p = np.ascontiguousarray(wide[..., :s])
    assert dwide[..., :s].tobytes() == kernels.softmax_backward(dp, p).tobytes()
    assert np.isnan(dwide[..., s:].astype(np.float32)).all()
    with pytest.raises(ValueError, match=r"softmax: dp of shape \(2, 3, 5, %d\)" % s):
        kernels.softmax_backward(dp, wide, n=s)


def test_row_pitch_is_whole_16_byte_vectors_unless_switched_off(monkeypatch):
    assert [kernels.row_pitch(n, np.float16) for n in (1, 8, 34, 44)] == [8, 8, 40, 48]
    assert [kernels.row_pitch(n, np.float32) for n in (1, 34, 44)] == [4, 36, 44]
    assert [kernels.row_pitch(n, np.float64) for n in (1, 33, 34)] == [2, 34, 34]
    monkeypatch.setenv("MINITF_ATTN_PITCH", "0")
    assert [kernels.row_pitch(n, np.float16) for n in (1, 34, 44)] == [1, 34, 44]


def test_block_size_is_a_power_of_two_covering_the_row_within_bounds():
    assert kernels.block_size("softmax", 25) == 32 and kernels.block_size("softmax", 1) == 32
    assert kernels.block_size("softmax", 64) == 64 and kernels.block_size("softmax", 65) == 128
    assert kernels.block_size("softmax", 1000) == 128 and kernels.block_size("nll", 37000) == 512
    assert kernels.block_size("layernorm", 512) == 256


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [7, 40, 300])
def test_softmax_backward(dtype, s):
    """13 rows: the warp kernel's last warp has one row of its two."""
    rng = np.random.default_rng(1)
    p = F.softmax_forward(rng.normal(size=(1, 1, 13, s)).astype(dtype))
    dp = rng.normal(size=p.shape).astype(dtype)
    close(kernels.softmax_backward(dp, p), F.softmax_backward(dp, p), dtype)
    # non-contiguous upstream gradient (a transposed view), as matmul outputs can be
    dpt = np.ascontiguousarray(dp.swapaxes(-1, -2)).swapaxes(-1, -2)
    close(kernels.softmax_backward(dpt, p), F.softmax_backward(dp, p), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 256, 520])
def test_layernorm_forward_and_backward(dtype, d):
    rng = np.random.default_rng(d)
    x = (rng.normal(size=(3, 5, d)) * 2 + 1).astype(dtype)
    g, b = rng.normal(size=d), rng.normal(size=d)
    eps = 1e-6
    y, (xhat, rstd) = kernels.layernorm_forward(x, g, b, eps)
    y_ref, (xhat_ref, rstd_ref) = F.layernorm_forward(x, g.astype(dtype), b.astype(dtype), eps)
    assert y.dtype == dtype and xhat.dtype == kernels.accum_dtype(dtype)
    close(y, y_ref, dtype)
    close(xhat, xhat_ref, kernels.accum_dtype(dtype))
    close(rstd, rstd_ref, kernels.accum_dtype(dtype))
    dy = rng.normal(size=x.shape).astype(dtype)
    dg, db = np.zeros(d, dtype=dtype), np.zeros(d, dtype=dtype)
    dx_ref = F.layernorm_backward(dy, (xhat_ref, rstd_ref), g.astype(dtype), dg, db)
    close(kernels.layernorm_backward_input(dy, (xhat, rstd), g), dx_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [11, 512, 1500])
def test_label_smoothed_nll_rows_and_gradient(dtype, v):
    rng = np.random.default_rng(v)
    n, eps, pad = 6, 0.1, 0
    logits = (rng.normal(size=(n, v)) * 4).astype(dtype)
    gold = rng.integers(1, v, size=n)
    gold[2] = pad
    loss_ref, nll_ref, count, cache = label_smoothed_nll(logits, gold, eps, pad)
    lse, nll, smooth = kernels.smoothed_nll_rows(logits, gold)
    w = (gold != pad).astype(kernels.accum_dtype(dtype))
    loss = ((1 - eps) * nll + eps * smooth) @ w / w.sum()
    close(loss, loss_ref, dtype)
    close(nll @ w, nll_ref, dtype)
    dz_ref = label_smoothed_nll_backward(cache, 2.0)
    dz = kernels.smoothed_nll_backward(logits, gold, lse, w * (2.0 / w.sum()), eps)
    close(dz, dz_ref, dtype)
    assert np.all(dz[2] == 0)
    out = logits.copy()                                   # in place over the logits
    kernels.smoothed_nll_backward(out, gold, lse, w * (2.0 / w.sum()), eps, out=out)
    close(out, dz_ref, dtype)
    a = kernels.accum_dtype(dtype)                         # the loss scale read on the device (dscale[0])
    dz_scaled = kernels.smoothed_nll_backward(logits, gold, lse, w * (2.0 / w.sum()), eps, dscale=np.array([3.0], a))
    close(dz_scaled, (dz_ref.astype(a) * 3.0).astype(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_dropout_add(dtype, packed):
    """The kernel hashes each element's position: its mask is functional.hash_bits' (the xp
    path CuPy takes without the kernels), for the padded layout and for packed rows."""
    rng = np.random.default_rng(3)
    shape, p, key = (3, 7, 42), 0.1, F.DropoutSites(5, 9).next_site()[1]
    rowpos = np.array([0, 2, 3, 7, 8, 9, 15, 20]) if packed else None
    if packed:
        shape = (len(rowpos), shape[-1])
    y, x = rng.normal(size=shape).astype(dtype), rng.normal(size=shape).astype(dtype)
    y0 = y.copy()
    out, mask = kernels.dropout_add(key, rowpos, y, x, p)
    bits = F.hash_bits(np, key, rowpos, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    want_mask = (bits >= F.keep_threshold(p)) / (1 - p)
    close(mask, want_mask, dtype)
    close(out, y0 * want_mask.astype(dtype) + x, dtype)
    assert 0.8 < (mask != 0).mean() < 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed,drop,d,biased", [(False, True, 7, True), (True, True, 64, False),
                                                 (True, False, 33, True), (False, False, 512, False)])
def test_residual_layernorm_is_dropout_add_then_layernorm_bit_for_bit(dtype, packed, drop, d, biased):
    """LayerNorm(x + Dropout(y + b_y)) in one pass per row: the same mask, sum (written into y), output
    and cache, bit for bit, as the bias add, dropout_add and layernorm_forward one after the other (no
    dropout: the plain sum); the mask, kept as its key, stands for functional.hash_bits' mask for the
    padded layout and packed rows."""
    rng = np.random.default_rng(d)
    p, key = 0.1, F.DropoutSites(5, 9).next_site()[1]
    rowpos = np.array([0, 2, 3, 7, 8, 9, 15, 20]) if packed else None
    shape = (len(rowpos), d) if packed else (3, 4, d)
    y, x = rng.normal(size=shape).astype(dtype), rng.normal(size=shape).astype(dtype)
    g, b = rng.normal(size=d).astype(dtype), rng.normal(size=d).astype(dtype)
    y_bias = rng.normal(size=d).astype(dtype) if biased else None
    y1, y2 = y.copy(), y.copy() + (y_bias if biased else 0)     # the separate bias add, in the storage dtype
    out, mask, cache = kernels.residual_layernorm(key if drop else None, rowpos, y1, x, p, g, b, 1e-6, y_bias)
    assert type(cache) is kernels.NormCache and cache.x is y1                  # the sum kept, not xhat
    xhat, rstd = kernels.xhat_of(cache), cache.rstd
    if drop:
        s, want_mask = kernels.dropout_add(key, rowpos, y2, x, p)
        drawn = F.mask_array(mask, want_mask)          # the KeyedMask, as the array it stands for
        assert type(mask) is kernels.KeyedMask and (mask.key, mask.p) == (key, p)
        assert drawn.tobytes() == want_mask.tobytes() and 0.8 < (drawn != 0).mean() <= 1.0
    else:
        s, want_mask = (y2 + x).astype(dtype), None
        assert mask is None
    want, (want_xhat, want_rstd) = kernels.layernorm_forward(s, g, b, 1e-6)
    assert y1.tobytes() == s.tobytes()                     # the sum, written into y
    assert out.tobytes() == want.tobytes() and xhat.tobytes() == want_xhat.tobytes()   # xhat again: its bits
    assert rstd.tobytes() == want_rstd.tobytes() and out.shape == shape and rstd.shape == shape[:-1] + (1,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("warp", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_layernorm_backward_draws_the_forward_mask_again(dtype, warp, packed, monkeypatch):
    """A post-norm block's LayerNorm backward takes residual_layernorm's dropout mask as its key (a
    KeyedMask: no [rows, D] mask kept from the forward to the backward) and draws it again in its own pass:
    (dx, dx * mask) the same bits as with the mask dropout_add stores, in the block and the warp kernels,
    for the padded layout and packed rows; a wrong key, rate or row position changes the bits."""
    rng = np.random.default_rng(11)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    d, p = 32 * vec + 2 * vec, 0.1
    rowpos = np.array([0, 2, 3, 7, 8, 9, 15, 20, 21]) if packed else None
    n = 9
    key = F.DropoutSites(5, 9).next_site()[1]
    y, x, dy, dy2 = (rng.normal(size=(n, d)).astype(dtype) for _ in range(4))
    g = rng.normal(size=d).astype(dtype)
    monkeypatch.setenv("MINITF_FUSED_LNWARP", "1" if warp else "0")
    _, (xhat, rstd) = kernels.layernorm_forward(x, g, g, 1e-5)
    stored = kernels.dropout_add(key, rowpos, y.copy(), x, p)[1]

    def backward(mask):
        launched = []
        real = kernels.LAUNCH["launch"]
        monkeypatch.setitem(kernels.LAUNCH, "launch", lambda name, *a: (launched.append(name), real(name, *a)))
        out = kernels.layernorm_backward_input(dy.copy(), (xhat, rstd), g, dy2=dy2, mask=mask)
        monkeypatch.setitem(kernels.LAUNCH, "launch", real)
        assert launched == ["layernorm_backward_warp" if warp else "layernorm_backward"]
        return out

    dx, dxm = backward(kernels.KeyedMask(key, rowpos, p))
    want_dx, want_dxm = backward(stored)
    equal(dx, want_dx)
    equal(dxm, want_dxm)
    assert 0.8 < (dxm != 0).mean() < 0.97
    for wrong in (kernels.KeyedMask(key + 1, rowpos, p), kernels.KeyedMask(key, rowpos, 0.3),
                  kernels.KeyedMask(key, None if packed else np.arange(1, n + 1), p)):
        assert backward(wrong)[1].tobytes() != want_dxm.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", [(1, 5), (7, 33), (70, 64), (1000, 100), ((4, 5), 40)])
def test_column_sums_with_and_without_a_factor(dtype, n, d):
    """The bias / LayerNorm-weight gradients: sums over every axis but the last, of x or of
    x * y (y in the accumulation dtype), against NumPy in float64; columns not a multiple of
    a warp, one slab and several (1,000 rows), rows fewer than a block's groups; the same bits
    on a second call (the slabs are added in a fixed order)."""
    rng = np.random.default_rng(d)
    shape = (*n, d) if isinstance(n, tuple) else (n, d)
    x = rng.normal(size=shape).astype(dtype)
    y = rng.normal(size=shape).astype(kernels.accum_dtype(dtype))
    x64 = x.astype(np.float64).reshape(-1, d)
    for got, want in ((kernels.column_sums(x), x64.sum(axis=0)),
                      (kernels.column_sums(x, y), (x64 * y.reshape(-1, d)).sum(axis=0))):
        assert got.shape == (d,) and got.dtype == kernels.accum_dtype(dtype)
        close(got, want, kernels.accum_dtype(dtype), scale=np.sqrt(x64.shape[0]))
    equal(kernels.column_sums(x, y), kernels.column_sums(x, y))
    assert np.all(kernels.column_sums(np.zeros((0, d), dtype=dtype)) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual,masked", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("warp", [False, True])
def test_layernorm_backward_with_a_residual_gradient_and_a_dropout_mask(dtype, residual, masked, warp, monkeypatch):
    """functional.layernorm_backward through the kernels (one layernorm_backward launch, a block or a warp a row,
    and one launch of column sums added into dg, db and the sublayer's bias gradient) against the generic
    lines: dy + dy_residual as the upstream gradient, (dx, dx * mask) returned, dg, db and the
    sublayer's bias gradient (the sums of dx * mask) accumulated onto what they held."""
    monkeypatch.setenv("MINITF_FUSED_LNWARP", "1" if warp else "0")
    rng = np.random.default_rng(31)
    d = 40
    x = rng.normal(size=(9, d)).astype(dtype)
    g, b = rng.normal(size=d).astype(dtype), rng.normal(size=d).astype(dtype)
    _, cache = F.layernorm_forward(x, g, b, 1e-6)
    dy, dy2 = rng.normal(size=x.shape).astype(dtype), rng.normal(size=x.shape).astype(dtype)
    mask = ((rng.random(x.shape) > 0.2) / 0.8).astype(dtype) if masked else None
    grads0 = rng.normal(size=(3, d)).astype(dtype)
    results, launched = [], record_launches(monkeypatch)
    for fused in (False, True):
        monkeypatch.setattr(kernels, "enabled", lambda a, _f=fused: _f)
        dg, db, dsub = grads0[0].copy(), grads0[1].copy(), grads0[2].copy()
        launched.clear()
        out = F.layernorm_backward(dy.copy(), cache, g, dg, db, dy2 if residual else None, mask, dsub)
        results.append((out, dg, db, dsub))
    # the sublayer's bias gradient (the sums of the sublayer output's gradient) in the LayerNorm's sums' launch
    assert launched == ["layernorm_backward_warp" if warp else "layernorm_backward", "column_sums_into"]
    (want, dg_w, db_w, dsub_w), (got, dg_g, db_g, dsub_g) = results
    tol = kernels.accum_dtype(dtype)
    for dsub, out in ((dsub_w, want), (dsub_g, got)):   # each against float64 sums of its own gradient
        sub = out[1] if masked else out
        close(dsub, grads0[2].astype(np.float64) + sub.astype(np.float64).sum(axis=0), dtype, scale=3.0)
    if masked:
        assert isinstance(got, tuple) and len(got) == 2
        close(got[1], want[1], dtype)
        got, want = got[0], want[0]
    close(got, want, dtype)
    close(dg_g, dg_w, tol, scale=3.0)
    close(db_g, db_w, tol, scale=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("warp", [False, True])
def test_a_post_norm_blocks_backward_computes_xhat_again(dtype, warp, monkeypatch):
    """residual_layernorm keeps the sum and each row's mean and rstd (a kernels.NormCache), not xhat
    [rows, D]: the LayerNorm's backward and its parameter sums compute xhat again, and give the same bits
    as from the xhat layernorm_forward keeps for the same sum: dx, dx * mask, dg, db and the sublayer
    bias's sums (one backward launch and one of column sums each way), in the block and warp kernels."""
    rng = np.random.default_rng(12)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    n, d, eps, p = 9, 32 * vec + 2 * vec, 1e-5, 0.1
    x, y, dy, dy2 = (rng.normal(size=(n, d)).astype(dtype) for _ in range(4))
    g, b = rng.normal(size=d).astype(dtype), rng.normal(size=d).astype(dtype)
    rowpos, key = np.array([0, 2, 3, 7, 8, 9, 15, 20, 21]), F.DropoutSites(5, 9).next_site()[1]
    monkeypatch.setenv("MINITF_FUSED_LNWARP", "1" if warp else "0")
    monkeypatch.setattr(kernels, "enabled", lambda a: True)
    out, mask, cache = kernels.residual_layernorm(key, rowpos, y.copy(), x, p, g, b, eps)
    assert type(cache) is kernels.NormCache and cache.mean.shape == cache.rstd.shape == (n, 1)
    kept_out, kept = kernels.layernorm_forward(cache.x, g, b, eps)     # the same sum, xhat kept
    equal(kept_out, out)
    grads0 = rng.normal(size=(3, d)).astype(dtype)
    launched, results = record_launches(monkeypatch), []
    for c in (cache, kept):
        launched.clear()
        dg, db, dsub = grads0[0].copy(), grads0[1].copy(), grads0[2].copy()
        dx, dxm = F.layernorm_backward(dy.copy(), c, g, dg, db, dy2, mask, dsub)
        assert launched == ["layernorm_backward_warp" if warp else "layernorm_backward", "column_sums_into"]
        results.append((dx, dxm, dg, db, dsub))
    for got, want in zip(*results):
        equal(got, want)
    assert not np.array_equal(results[0][2], grads0[0])          # dg took its sums


@pytest.mark.parametrize("n", [5, 300, 5000])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_column_sums_into_a_buffer_add_to_it_in_one_launch(n, order, monkeypatch, emulated):
    """column_sums(x, out=buf) adds the sums into buf (a gradient buffer) in its dtype, in one
    launch whose last block adds the slabs (one slab and many); the ticket counter is back at 0
    after it, so the next launch works; the same bits as the two-launch sums, whichever block ends last
    (the emulator runs the blocks in either order)."""
    monkeypatch.setattr(emulated, "reverse", order == "descending")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, 70)).astype(np.float32)
    buf = rng.normal(size=70).astype(np.float32)
    want = buf.astype(np.float64) + x.astype(np.float64).sum(axis=0)
    launched = record_launches(monkeypatch)
    buf0 = buf.copy()
    assert kernels.column_sums(x, out=buf) is buf
    assert launched == ["column_sums_into"] and not kernels._counter(np).any()   # every chunk's ticket back at 0
    close(buf, want, np.float32, scale=np.sqrt(n))
    again = buf0.copy()
    kernels.column_sums(x, out=again)
    equal(again, buf)
    equal(buf, buf0 + kernels.column_sums(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 300, 5000])
def test_column_sums_of_stacked_planes_into_evenly_spaced_buffers_in_one_launch(dtype, n, monkeypatch):
    """column_sums_planes(x [3, n, d], out, stride): plane p's sums added into out + p * stride of one buffer
    (the stacked projections' biases), in one launch, the same bits as a column_sums(x[p], out=) each,
    and nothing else of the buffer written."""
    rng = np.random.default_rng(4)
    d, stride = 70, 90
    x = rng.normal(size=(3, n, d)).astype(dtype)
    buf = rng.normal(size=3 * stride).astype(dtype)
    want = buf.copy()
    for p in range(3):
        kernels.column_sums(x[p], out=want[p * stride:p * stride + d])
    launched = record_launches(monkeypatch)
    kernels.column_sums_planes(x, buf[:d], stride)
    assert launched == ["column_sums_into"] and not kernels._counter(np).any()
    equal(buf, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 300, 5000])
@pytest.mark.parametrize("factor", ["array", "from_mean"])
@pytest.mark.parametrize("third", [False, True])
def test_a_layernorms_sums_in_one_launch_are_the_separate_sums(dtype, n, factor, third, monkeypatch):
    """column_sums_pair(x, y, out_xy, out_x[, x3, out_x3]): the sums of x * y, of x (and of x3) added into their
    buffers in one launch, the same bits as column_sums(x, y) added in the accumulation dtype and column_sums(x,
    out=) (and column_sums(x3, out=)), with y an array or a NormCache whose xhat the kernel computes again; over
    one slab and many, and the ticket counters back at 0."""
    rng = np.random.default_rng(6)
    d = 70
    x, x3, s = (rng.normal(size=(n, d)).astype(dtype) for _ in range(3))
    a = kernels.accum_dtype(dtype)
    mean = s.astype(a).mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((s.astype(a) - mean) ** 2).mean(axis=1, keepdims=True) + a(1e-5))
    cache = kernels.NormCache(s, mean, rstd.astype(a))
    y = kernels.xhat_of(cache) if factor == "from_mean" else rng.normal(size=(n, d)).astype(a)
    outs = rng.normal(size=(3, d)).astype(dtype)
    want = outs.copy()
    want[0] = (want[0].astype(a) + kernels.column_sums(x, y)).astype(dtype)
    kernels.column_sums(x, out=want[1])
    if third:
        kernels.column_sums(x3, out=want[2])
    launched = record_launches(monkeypatch)
    got = outs.copy()
    kernels.column_sums_pair(x, cache if factor == "from_mean" else y, got[0], got[1], *((x3, got[2]) if third else ()))
    assert launched == ["column_sums_into"] and not kernels._counter(np).any()
    equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 700])
def test_relu_backward_inside_the_bias_sums_is_relu_backward_then_the_sums(dtype, n, monkeypatch):
    """relu_backward_sums(dy, y, out): dy zeroed in place where the ReLU's output y is not > 0 (a NaN or a
    negative zero in y too, as relu_backward has it; a NaN in dy where y > 0 stays) and out += the column sums of
    that dy, in one launch: the same bits as relu_backward then column_sums(dy, out=out), over one slab and
    several."""
    rng = np.random.default_rng(8)
    d = 70
    dy = rng.normal(size=(n, d)).astype(dtype)
    y = np.maximum(rng.normal(size=(n, d)), 0).astype(dtype)
    y.flat[::7] = np.nan
    y.flat[3::11] = -0.0
    y.flat[5::13] = np.inf
    dy.flat[5::26] = np.nan                      # where y is inf (> 0): kept, and the column's sum is NaN
    out = rng.normal(size=d).astype(dtype)
    want_dy, want = dy.copy(), out.copy()
    kernels.relu_backward(want_dy, y)
    kernels.column_sums(want_dy, out=want)
    launched = record_launches(monkeypatch)
    assert kernels.relu_backward_sums(dy, y, out) is dy
    assert launched == ["column_sums_relu_into"] and not kernels._counter(np).any()
    equal(dy, want_dy)
    equal(out, want)
    assert np.isnan(out).any() and not np.isnan(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_embedding_backward_stages_a_frequent_ids_rows_in_chunks(dtype):
    """An id with more rows than a block stages at once (EMB_CHUNK: two and a half chunks) in rows wider than a
    block's threads (two passes over the columns, the second partial): embedding_backward's sums are
    segment_sum_rows', with the mask stored and drawn again from its key (the same bits)."""
    from minitf.layers.embedding import segment_sum_rows
    chunk = int(re.search(r"#define EMB_CHUNK (\d+)", kernels.KERNELS).group(1))
    rng = np.random.default_rng(23)
    b, length, d, v, p = 10, chunk * 3 // 8, 300, 6, 0.2
    assert kernels._row_block(d) < d
    ids = np.where(rng.random((b, length)) < 0.7, 2, rng.integers(0, v, size=(b, length)))
    rowpos = np.flatnonzero(rng.random(b * length) < 0.9)
    assert (ids.reshape(-1)[rowpos] == 2).sum() > 2 * chunk
    dx = rng.normal(size=(len(rowpos), d)).astype(dtype)
    plan = kernels.embedding_plan(ids, rowpos, np)
    key = F.DropoutSites(7, 1).next_site()[1]
    keyed = kernels.KeyedMask(key, rowpos.astype(np.int64), p)
    mask = F.mask_array(keyed, dx)
    grad0 = rng.normal(size=(v, d)).astype(dtype)
    got, stored = grad0.copy(), grad0.copy()
    kernels.embedding_backward(dx, keyed, plan, got, 2.5)
    kernels.embedding_backward(dx, mask, plan, stored, 2.5)
    equal(got, stored)
    want = grad0.astype(np.float64)
    segment_sum_rows(ids.reshape(-1)[rowpos], dx.astype(np.float64) * mask * 2.5, want)
    close(got, want, dtype, scale=30.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed,dropout", [(False, False), (True, False), (True, True)])
def test_embed_rows_and_embedding_backward(dtype, packed, dropout):
    """embed_rows = dropout(pack(rows, weight[ids] * scale + PE)) with the mask functional.hash_bits
    gives at the kept positions, kept as its key (a KeyedMask); embedding_backward adds scale * (dx * mask)
    summed per id into the gradient, as segment_sum_rows does (ids repeated, some never used), with the
    mask drawn again from its key: the same bits as with the mask array."""
    from minitf.layers.embedding import segment_sum_rows
    from minitf.layers.positional import sinusoid_table
    from minitf.packing import Rows
    rng = np.random.default_rng(17)
    b, length, d, v, p = 3, 7, 12, 9, 0.25
    ids = rng.integers(0, v, size=(b, length))
    keep = rng.random((b, length)) < 0.7 if packed else np.ones((b, length), dtype=bool)
    rows = Rows(keep) if packed else None
    w = rng.normal(size=(v, d)).astype(dtype)
    pe = sinusoid_table(length, d).astype(dtype)
    key = F.DropoutSites(3, 4).next_site()[1] if dropout else None
    out, mask = kernels.embed_rows(w, ids, rows, length, pe, 2.5, key, p)
    full = ((w[ids] * np.asarray(2.5, dtype=dtype)).astype(dtype) + pe).reshape(-1, d)
    want = full if rows is None else full[rows.host_index]
    if dropout:
        pos = None if rows is None else rows.host_index
        bits = F.hash_bits(np, key, pos, want.shape[0], d)
        want_mask = ((bits >= F.keep_threshold(p)) / (1 - p)).astype(dtype)
        assert type(mask) is kernels.KeyedMask
        equal(F.mask_array(mask, want), want_mask)
        want = want * want_mask
    else:
        assert mask is None
    close(out, want, dtype)
    dx = rng.normal(size=out.shape).astype(dtype)
    grad0 = rng.normal(size=(v, d)).astype(dtype)
    got = grad0.copy()
    plan = kernels.embedding_plan(ids, None if rows is None else rows.host_index, np)
    kernels.embedding_backward(dx, mask, plan, got, 2.5)
    mask_array = None if mask is None else F.mask_array(mask, dx)
    kept_ids = ids.reshape(-1) if rows is None else ids.reshape(-1)[rows.host_index]
    want_g = grad0.astype(np.float64)
    segment_sum_rows(kept_ids, (dx.astype(np.float64) * (1 if mask is None else mask_array)) * 2.5, want_g)
    close(got, want_g, dtype, scale=10.0)
    if dropout:                  # the key drawn again: the bits of the stored mask
        stored = grad0.copy()
        kernels.embedding_backward(dx, mask_array, plan, stored, 2.5)
        equal(got, stored)
        other = grad0.copy()
        kernels.embedding_backward(dx, kernels.KeyedMask(key + 1, mask.rowpos, p), plan, other, 2.5)
        assert other.tobytes() != got.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_unpack_heads_and_pack_heads_are_unpack_split_and_merge_pack(dtype, packed):
    """unpack_heads = split_heads(unpack(rows, x + bias)) with zeros at the pads (the layer's
    generic path), pack_heads = pack(rows, merge_heads(x)); heads of 5 (not a warp's multiple),
    rows of 3 heads * 5 shorter than a block, and the bias optional."""
    from minitf.packing import Rows
    rng = np.random.default_rng(7)
    b, length, h, k = 3, 6, 3, 5
    keep = rng.random((b, length)) < 0.7 if packed else np.ones((b, length), dtype=bool)
    keep[:, 0] = True
    rows = Rows(keep)
    n = len(rows.host_index) if packed else b * length
    x = rng.normal(size=(n, h * k)).astype(dtype)
    bias = rng.normal(size=h * k).astype(dtype)
    inverse = rows.inverse if packed else None
    index = rows.index if packed else None
    want = F.split_heads((rows.unpack(x + bias) if packed else (x + bias).reshape(b, length, -1)), h)
    if packed:    # the pads are zeros, not the bias
        want = F.split_heads(rows.unpack(x + bias), h) * keep[:, None, :, None]
    got = kernels.unpack_heads(x, bias, inverse, b, length, h)
    assert got.shape == (b, h, length, k) and got.dtype == dtype
    close(got, want, dtype)
    equal(kernels.unpack_heads(x, None, inverse, b, length, h),
                                  F.split_heads(rows.unpack(x) if packed else x.reshape(b, length, -1), h))
    y = rng.normal(size=(b, h, length, k)).astype(dtype)
    merged = F.merge_heads(y)
    equal(kernels.pack_heads(y, index), rows.pack(merged) if packed else merged.reshape(n, -1))


def spans_of(lengths):
    """packing.Spans of sentences with these row counts, one after another (on the host: the emulator's arrays)."""
    from minitf.packing import Spans
    lengths = np.asarray(lengths)
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return Spans(start.astype(np.int32), lengths.astype(np.int32), len(lengths), int(lengths.max()))


def attention_reference(q, k, v, biases, lq, lk, h, causal, scale, dout=None):
    """(out, lse) of kernels.attention_rows in float64 NumPy, sentence by sentence and head by head (the
    biased projections rounded to their dtype first, as the kernels read them); with dout
    (out, lse, [dq, dk, dv])."""
    dt = q.dtype
    q, k, v = ((x + b).astype(dt).astype(np.float64) for x, b in zip((q, k, v), biases))
    kd = q.shape[1] // h
    out, lse = np.zeros_like(q), np.zeros((h, q.shape[0]))
    grads = [np.zeros_like(x) for x in (q, k, v)]
    qs, ks = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    for b in range(len(lq)):
        rq, rk = slice(qs[b], qs[b + 1]), slice(ks[b], ks[b + 1])
        for head in range(h):
            c = slice(head * kd, (head + 1) * kd)
            s = scale * q[rq, c] @ k[rk, c].T
            if causal:
                s = s + np.triu(np.full(s.shape, -np.inf), 1)
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            p = e / e.sum(axis=1, keepdims=True)
            out[rq, c] = p @ v[rk, c]
            lse[head, rq] = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
            if dout is not None:
                do = dout[rq, c].astype(np.float64)
                grads[2][rk, c] = p.T @ do
                dp = do @ v[rk, c].T
                ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
                grads[0][rq, c] = scale * ds @ k[rk, c]
                grads[1][rk, c] = scale * ds.T @ q[rq, c]
    return (out, lse) if dout is None else (out, lse, grads)


# (query lengths, key lengths, causal): sentences of one row, of fewer rows than a block's 16 (or a tile's 32) and of more
# (several blocks of queries, several tiles of keys)
ATTENTION_CASES = {"self": ([1, 5, 37, 70], None, False), "causal": ([1, 5, 37, 70], None, True),
                   "cross": ([3, 40, 1, 9], [70, 2, 33, 5], False)}


# the attention kernels a case runs on: tensor cores (float16 and bfloat16, and float32 with CUPY_TF32; K a multiple of
# 16) or CUDA cores (MINITF_FUSED_ATTN_MMA=0, float64, or any other K)
ATTENTION_CORES = [pytest.param(dt, cores, id=f"{np.dtype(dt).name}-{cores}") for dt in (np.float64, np.float32,
                   np.float16, BF16) for cores in (["cuda"] if dt == np.float64 else ["tensor", "cuda"])]
# float32 on tensor cores: TF32 operands, where float32 products run on TF32 (CUPY_TF32, which tests/conftest.py unsets)
ATTENTION_TOL = {(np.float64, "cuda"): 1e-12, (np.float32, "cuda"): 1e-5, (np.float32, "tensor"): 4e-3,
                 (np.float16, "tensor"): 4e-3, (np.float16, "cuda"): 4e-3, (BF16, "tensor"): 3e-2, (BF16, "cuda"): 3e-2}


def attention_cores(monkeypatch, dtype, cores):
    """The environment of a case on `cores`: MINITF_FUSED_ATTN_MMA, and CUPY_TF32 for float32 on tensor cores."""
    monkeypatch.setenv("MINITF_FUSED_ATTN_MMA", "1" if cores == "tensor" else "0")
    if dtype == np.float32 and cores == "tensor":
        monkeypatch.setenv("CUPY_TF32", "1")


@pytest.mark.parametrize("dtype,cores", ATTENTION_CORES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("h,k", [(3, 6), (2, 16), (1, 48), (1, 64)])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_attention_on_packed_rows_forward_and_backward(dtype, cores, case, h, k, order, monkeypatch, emulated):
    """kernels.attention_rows (one launch) and attention_rows_backward (one) against float64 NumPy per
    sentence and head: the output, its lse and the gradients of q, k and v (before their biases, which
    the kernels add), for self-attention with and without the causal mask and cross-attention with
    other lengths on the key side; heads of 6 values (not a multiple of the 4 threads a row, nor of the
    tensor cores' 16), 16 (one k-step of mma.sync), 48 (three) and 64 (the most); in 16 bits and in float32 (as TF32)
    on tensor cores (attention_rows_*_mma, where K allows) and on CUDA cores; the threads run in both orders between
    barriers."""
    monkeypatch.setattr(emulated, "reverse", order == "descending")
    attention_cores(monkeypatch, dtype, cores)
    launched = record_launches(monkeypatch)
    lq, lk, causal = ATTENTION_CASES[case]
    lk = lq if lk is None else lk
    rng = np.random.default_rng(5)
    nq, nk, hk = sum(lq), sum(lk), h * k
    q, dout = (rng.normal(size=(nq, hk)).astype(dtype) for _ in range(2))
    kk, v = (rng.normal(size=(nk, hk)).astype(dtype) for _ in range(2))
    biases = tuple(rng.normal(size=hk).astype(dtype) * 0.5 for _ in range(3))
    scale = 1 / np.sqrt(k)
    out, lse = kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lk), h, causal, scale)
    want_out, want_lse, want = attention_reference(q, kk, v, biases, lq, lk, h, causal, scale, dout)
    assert out.dtype == dtype and lse.dtype == kernels.accum_dtype(dtype) and lse.shape == (h, nq)
    tol = ATTENTION_TOL[(dtype, cores)]
    for got, ref in [(out, want_out), (lse, want_lse)]:
        assert np.abs(got.astype(np.float64) - ref).max() <= tol * np.abs(ref).max()
    dq, dk, dv = (np.full_like(x, np.nan) for x in (q, kk, v))
    kernels.attention_rows_backward(dout, out, lse, q, kk, v, biases, spans_of(lq), spans_of(lk), h, causal, scale,
                                    dq, dk, dv)
    for got, ref in zip((dq, dk, dv), want):
        assert np.abs(got.astype(np.float64) - ref).max() <= 2 * tol * np.abs(ref).max()
    mma = "_mma" if cores == "tensor" and k % 16 == 0 else ""
    assert launched == ["attention_rows_forward" + mma, "attention_rows_backward" + mma]


def _run_source(monkeypatch, emulated):
    """Sends minitf's launches to the emulator with the CUDA source held in the returned dict's "code" (set it before
    a launch: an altered copy of kernels.source)."""
    current = {}
    monkeypatch.setitem(kernels.LAUNCH, "launch", lambda name, dt, grid, block, args: emulated.launch(
        name, dt, grid, block, args, code=current["code"]))
    return current


def _without_tile_barriers(code):
    """The CUDA source `code` with the barrier at the top of each tile loop of the tensor-core attention taken out:
    att_mma_forward's, and the backward's query blocks' and key blocks'."""
    cuts = [("__device__ void att_mma_forward", "        __syncthreads();                        // the previous tile's "
             "readers are done\n"),
            ("mma_zero(acc);\n    int nk = att_keys_seen", "        __syncthreads();\n        mma_stage(k, bk,"),
            ("int block_first = first - warp * ATT_ROWS;", "        __syncthreads();\n        // each query's delta")]
    for after, barrier in cuts:
        at = code.index(barrier, code.index(after))
        code = code[:at] + barrier.replace("__syncthreads();", "", 1) + code[at + len(barrier):]
    return code


def test_the_emulator_shows_a_warp_staging_the_next_tile_before_another_has_read_this_one(monkeypatch, emulated):
    """The tensor-core attention stages each tile of keys (the forward's and the backward's query blocks) or queries
    (its key blocks) once for all the block's warps, and every warp reads all of it: the barrier at the top of the
    tile loop keeps a warp from staging the next tile over rows another warp has yet to read. The emulator runs a
    warp ahead of the others through its mma.sync, ldmatrix and shuffles (each the warp's own barrier), as a GPU may
    run it, so without those barriers the output and each gradient are wrong in one of the two thread orders (and
    with them right in both: test_attention_on_packed_rows_forward_and_backward)."""
    dtype, h, k = np.float16, 2, 16
    attention_cores(monkeypatch, dtype, "tensor")
    lq = [70, 37]                                   # 5 and 3 chunks of 16 rows: blocks of several warps, 3 tiles
    rng = np.random.default_rng(8)
    q, kk, v, dout = (rng.normal(size=(sum(lq), h * k)).astype(dtype) for _ in range(4))
    biases = tuple(np.zeros(h * k, dtype=dtype) for _ in range(3))
    want_out, _, want = attention_reference(q, kk, v, biases, lq, lq, h, False, 0.25, dout)
    out, lse = kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lq), h, False, 0.25)
    _run_source(monkeypatch, emulated)["code"] = _without_tile_barriers(kernels.source(dtype))
    launched = record_launches(monkeypatch)
    right = {}
    for order in ("ascending", "descending"):
        monkeypatch.setattr(emulated, "reverse", order == "descending")
        got = [kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lq), h, False, 0.25)[0]]
        got += [np.full_like(x, np.nan) for x in (q, kk, v)]
        kernels.attention_rows_backward(dout, out, lse, q, kk, v, biases, spans_of(lq), spans_of(lq), h, False, 0.25,
                                        *got[1:])
        right[order] = [bool(np.abs(g.astype(np.float64) - r).max() <= 8e-3 * np.abs(r).max())
                        for g, r in zip(got, [want_out] + want)]
    assert launched == ["attention_rows_forward_mma", "attention_rows_backward_mma"] * 2
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert not (right["ascending"][i] and right["descending"][i]), (what, right)


def test_the_emulator_refuses_a_kernel_that_writes_past_its_arrays(monkeypatch, emulated):
    """The emulator hands each array to a kernel between guard bytes: relu_backward altered to write one value
    past its rows (i <= n) fails its launch, naming the kernel; as written it runs, even on a view of a larger array
    whose next value it must not touch."""
    check = "if (i < n && !((A)y[i] > (A)0)) dy[i] = (T)(A)0;"
    code = kernels.source(np.float32)
    assert code.count(check) == 1
    monkeypatch.setenv("MINITF_FUSED_VEC", "0")
    y = -np.ones(8, np.float32)                       # every dy zeroed, and one more past the end when altered
    whole = np.ones(9, np.float32)
    kernels.relu_backward(whole[:8], y)
    assert whole.tolist() == [0.0] * 8 + [1.0]
    _run_source(monkeypatch, emulated)["code"] = code.replace(check, check.replace("i < n", "i <= n"))
    with pytest.raises(AssertionError, match="relu_backward wrote after the memory of its arrays"):
        kernels.relu_backward(np.ones(8, np.float32), y)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_shared_variable_of_the_kernels_starts_each_emulated_block_as_nan_bytes(dtype, emulated):
    """The emulator resets one section of its library before each block of a kernel that declares shared memory
    (cuda_emulator.shared_kernels): every __shared__ variable of the kernels must lie in it (g++ would place one
    inside a template function elsewhere, unreset), as many symbols in the section as there are __shared__
    declarations in the source, and each belong to a function shared_kernels finds."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which g++ needs) not found"
    code = kernels.source(dtype)
    declared = len(re.findall(r"\b__shared__\b", re.sub(r"//[^\n]*", "", code)))   # not in comments
    table = subprocess.run([objdump, "-t", emulated._lib(dtype)._name], capture_output=True, text=True, check=True)
    in_section = [line for line in table.stdout.splitlines() if " emu_shared" in line and "_ZZ" in line]
    assert declared > 0 and len(in_section) == declared, (declared, in_section)
    # the emulator resets the section before the blocks of the kernels shared_kernels finds: every function that
    # holds one of these variables (named in its mangled name, _ZZ<length><name>...) among them
    from cuda_emulator import shared_kernels
    found = shared_kernels(code)
    for line in in_section:
        m = re.search(r"_ZZ(\d+)", line)
        owner = line[m.end():m.end() + int(m.group(1))]
        assert owner in found, (owner, line)
    assert {"column_sums_into", "attention_rows_forward_mma", "update_check"} <= found
    assert not {"bias_relu", "adam_update", "masked_softmax_warp"} & found


def test_the_emulators_guards_copy_the_memory_arrays_span_once():
    """_Guarded takes the bytes an array's memory spans: a stride-0 view over 3 floats (its base no array) is 12
    bytes, not its 12,000; two overlapping arrays over one buffer share one copy (a write through one is read
    through the other), at the memory's address modulo 64; what a kernel changes is copied back, and a write into a
    guard is named."""
    from cuda_emulator import GUARD, _Guarded
    small = np.arange(3, dtype=np.float32)
    wide = np.lib.stride_tricks.as_strided(small, shape=(1000, 3), strides=(0, 4))
    raw = bytearray(16)
    first, second = np.frombuffer(raw, np.float32, 3), np.frombuffer(raw, np.float32, 2, offset=8)   # overlapping
    g = _Guarded([wide, small, first, second])
    assert sorted(hi - lo for lo, hi, _, _ in g.copies) == [12, 16]
    assert all((buf.ctypes.data + off) % 64 == lo % 64 for lo, hi, buf, off in g.copies)
    p = g.pointer(second)
    assert g.pointer(first) + 8 == p and g.pointer(wide) == g.pointer(small)
    ctypes.memmove(p, np.float32([5.0]).ctypes.data, 4)
    assert g.close("k") == [] and second[0] == 5.0 and first.tolist() == [0.0, 0.0, 5.0]
    g = _Guarded([small])
    ctypes.memmove(g.pointer(small) + 12, np.float32([1.0]).ctypes.data, 4)
    assert g.close("k") == [f"k wrote after the memory of its arrays (12 bytes at {small.ctypes.data:#x}): out of "
                            f"bounds"] and GUARD >= 4


def _forward_matches(monkeypatch, emulated, sources, qkv, biases, lq, h, want):
    """For each CUDA source of `sources` (kernels.source(dtype) or an altered copy, run by the emulator): whether
    kernels.attention_rows (self-attention over sentences of lq rows, h heads, scale 0.25) gives `want` (float64) to
    the tensor cores' rounding."""
    current = _run_source(monkeypatch, emulated)
    launched = record_launches(monkeypatch)
    right = []
    for code in sources:
        current["code"] = code
        out, _ = kernels.attention_rows(*qkv, biases, spans_of(lq), spans_of(lq), h, False, 0.25)
        right.append(bool(np.abs(out.astype(np.float64) - want).max() <= 4e-3 * np.abs(want).max()))
    assert launched == ["attention_rows_forward_mma"] * len(sources)
    return right


@pytest.mark.parametrize("bias", [False, True])
def test_the_emulator_shows_a_tile_read_before_its_copies_are_waited_for(bias, monkeypatch, emulated):
    """The tensor-core attention stages its tiles with cp.async (mma_copy16), which lands only when the copying
    thread waits (mma_copy_wait, before the caller's barrier, and before the bias is added to the copied values).
    The emulator lands a copy at the wait and not before, so without the wait the output is wrong, with a bias
    (read back by the copying lane) or without (read by the warps after the barrier)."""
    dtype, h, k, lq = np.float16, 2, 16, [40, 9]
    attention_cores(monkeypatch, dtype, "tensor")
    rng = np.random.default_rng(9)
    q, kk, v = (rng.normal(size=(sum(lq), h * k)).astype(dtype) for _ in range(3))
    biases = tuple((rng.normal(size=h * k) * bias).astype(dtype) for _ in range(3))
    want, _ = attention_reference(q, kk, v, biases, lq, lq, h, False, 0.25)
    wait = "    mma_copy_wait();\n    if (has_bias)"
    code = kernels.source(dtype)
    assert code.count(wait) == 1
    sources = [code, code.replace(wait, "    if (has_bias)")]
    assert _forward_matches(monkeypatch, emulated, sources, (q, kk, v), biases, lq, h, want) == [True, False]


def test_the_emulator_shows_a_block_reading_shared_memory_it_did_not_write(monkeypatch, emulated):
    """The tensor-core attention multiplies whole staged tiles, so mma_stage writes zeros into the rows past a short
    sentence's end. The emulator sets every block's shared memory to NaN bytes before it runs (a GPU's holds
    anything), so with those rows left unwritten the output is wrong, where the rows an earlier block left (finite
    here) would have given the right one."""
    dtype, h, k, lq = np.float16, 2, 16, [5, 9, 3]
    attention_cores(monkeypatch, dtype, "tensor")
    rng = np.random.default_rng(10)
    q, kk, v = (rng.normal(size=(sum(lq), h * k)).astype(dtype) for _ in range(3))
    biases = tuple(np.zeros(h * k, dtype=dtype) for _ in range(3))
    want, _ = attention_reference(q, kk, v, biases, lq, lq, h, False, 0.25)
    loop = "for (int j = lane / per_row; j < ATT_TILE; j += step)"
    code = kernels.source(dtype)
    assert code.count(loop) == 1
    sources = [code, code.replace(loop, loop.replace("j < ATT_TILE", "j < n"))]
    assert _forward_matches(monkeypatch, emulated, sources, (q, kk, v), biases, lq, h, want) == [True, False]


@pytest.mark.parametrize("dtype,cores", ATTENTION_CORES)
def test_attention_on_packed_rows_keeps_a_sentences_infinities_in_it(dtype, cores, monkeypatch):
    """A sentence whose q, k, v and dout are infinite (its results NaN) comes first, with more rows than a tile:
    the sentences after it, shorter than a tile, still match float64 NumPy. The tensor-core kernels multiply whole
    staged tiles, so the rows past a short sentence's end must be zeros, not what an earlier block left there."""
    attention_cores(monkeypatch, dtype, cores)
    lq, h, k = [40, 5, 20], 2, 16
    rng = np.random.default_rng(3)
    q, kk, v, dout = (rng.normal(size=(sum(lq), h * k)).astype(dtype) for _ in range(4))
    for x in (q, kk, v, dout):
        x[:lq[0]] = np.inf
    biases = tuple(np.zeros(h * k, dtype=dtype) for _ in range(3))
    out, lse = kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lq), h, False, 0.25)
    grads = [np.full_like(x, np.nan) for x in (q, kk, v)]
    kernels.attention_rows_backward(dout, out, lse, q, kk, v, biases, spans_of(lq), spans_of(lq), h, False, 0.25,
                                    *grads)
    rest = slice(lq[0], None)
    want_out, _, want = attention_reference(q[rest], kk[rest], v[rest], biases, lq[1:], lq[1:], h, False, 0.25,
                                            dout[rest])
    tol = ATTENTION_TOL[(dtype, cores)]
    for got, ref in zip([out] + grads, [want_out] + want):
        got = got[rest].astype(np.float64)
        assert np.isfinite(got).all() and np.abs(got - ref).max() <= 2 * tol * np.abs(ref).max()


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_attention_on_packed_rows_off_a_16_byte_boundary_takes_the_cuda_cores(dtype, monkeypatch):
    """The tensor-core kernels stage 16 bytes a load: q, k or v (or, in the backward, dout) starting off a 16-byte
    boundary (here one value in) runs the CUDA-core kernels instead, with the same results to rounding."""
    lq, h, k = [5, 20], 2, 16
    rng = np.random.default_rng(2)
    launched = record_launches(monkeypatch)
    for shifted in ("q", "dout", None):
        arrays = {}
        for name in ("q", "k", "v", "dout"):
            flat = rng.normal(size=sum(lq) * h * k + 1).astype(dtype)
            arrays[name] = (flat[1:] if name == shifted else flat[:-1]).reshape(sum(lq), h * k)
        q, kk, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
        biases = tuple(rng.normal(size=h * k).astype(dtype) for _ in range(3))
        launched.clear()
        out, lse = kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lq), h, True, 0.25)
        grads = [np.zeros_like(x) for x in (q, kk, v)]
        kernels.attention_rows_backward(dout, out, lse, q, kk, v, biases, spans_of(lq), spans_of(lq), h, True, 0.25,
                                        *grads)
        want_out, _, want = attention_reference(q, kk, v, biases, lq, lq, h, True, 0.25, dout)
        tol = {np.float16: 4e-3, BF16: 3e-2}[dtype]
        for got, ref in zip([out] + grads, [want_out] + want):
            assert np.abs(got.astype(np.float64) - ref).max() <= 2 * tol * np.abs(ref).max()
        fwd, bwd = ("" if shifted == "q" else "_mma"), ("" if shifted else "_mma")
        assert launched == ["attention_rows_forward" + fwd, "attention_rows_backward" + bwd], shifted


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["float16", "bfloat16", "float32-tf32"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_on_tensor_cores_gives_the_same_bits_whatever_the_warps_a_block(dtype, case, monkeypatch):
    """A tensor-core block takes min(MMA_WARPS, chunks) warps, each a chunk of 16 rows of one sentence and head, and
    stages each tile once for them all; a warp past its sentence's rows, or a causal block's earlier warp in a tile
    of later keys (or, in the key blocks, of earlier queries), makes the products the others make, on masked rows.
    Sentences of 1 to 70 rows (1 to 5 chunks): the output, lse and gradients the same bits with blocks of 1, 2, 3 and 4
    warps, launched as blocks of 32 x min(warps, chunks) threads, ceil(chunks / warps) of them a sentence and head."""
    attention_cores(monkeypatch, dtype, "tensor")
    lq, lk, causal = ATTENTION_CASES[case]
    lk = lq if lk is None else lk
    h, k = 2, 16
    rng = np.random.default_rng(8)
    q, dout = (rng.normal(size=(sum(lq), h * k)).astype(dtype) for _ in range(2))
    kk, v = (rng.normal(size=(sum(lk), h * k)).astype(dtype) for _ in range(2))
    biases = tuple(rng.normal(size=h * k).astype(dtype) * 0.5 for _ in range(3))
    launches, launch = [], kernels.LAUNCH["launch"]

    def record(name, dt, grid, block, args):
        launches.append((name, grid, block))
        return launch(name, dt, grid, block, args)
    monkeypatch.setitem(kernels.LAUNCH, "launch", record)
    got = {}
    for warps in (1, 2, 3, 4):
        monkeypatch.setattr(kernels, "MMA_WARPS", warps)
        launches.clear()
        out, lse = kernels.attention_rows(q, kk, v, biases, spans_of(lq), spans_of(lk), h, causal, 0.25)
        grads = [np.full_like(x, np.nan) for x in (q, kk, v)]
        kernels.attention_rows_backward(dout, out, lse, q, kk, v, biases, spans_of(lq), spans_of(lk), h, causal, 0.25,
                                        *grads)
        got[warps] = [out, lse] + grads
        qc, kc = -(-max(lq) // 16), -(-max(lk) // 16)
        w_f, w_b = min(warps, qc), min(warps, max(qc, kc))
        assert launches == [("attention_rows_forward_mma", len(lq) * h * -(-qc // w_f), 32 * w_f),
                            ("attention_rows_backward_mma", len(lq) * h * (-(-qc // w_b) + -(-kc // w_b)), 32 * w_b)]
    for warps in (2, 3, 4):
        for a, b in zip(got[1], got[warps]):
            equal(a, b)


def test_attention_on_tf32_tensor_cores_rounds_its_operands_to_nearest_ties_away(monkeypatch):
    """float32 on tensor cores (CUPY_TF32=1): a sentence of one row gives its one key the weight 1, so its output is
    its value as a TF32 operand: rounded to 10 mantissa bits, to nearest, ties away from zero (cvt.rna.tf32.f32),
    which NumPy computes here from the value's unit in the last place. Among the values, exact ties (the 13 dropped
    bits 0x1000) of both signs and values just below and above them."""
    monkeypatch.setenv("MINITF_FUSED_ATTN_MMA", "1")
    monkeypatch.setenv("CUPY_TF32", "1")
    rng = np.random.default_rng(4)
    n, h, k = 6, 1, 16
    v = rng.normal(size=(n, h * k)).astype(np.float32) * np.float32(3.0)
    bits = v.view(np.uint32)
    bits[:3] = (bits[:3] & np.uint32(0xffffe000)) | np.uint32(0x1000)    # ties
    bits[3] = (bits[3] & np.uint32(0xffffe000)) | np.uint32(0x0fff)      # just below
    bits[4] = (bits[4] & np.uint32(0xffffe000)) | np.uint32(0x1001)      # just above
    q, kk = (rng.normal(size=(n, h * k)).astype(np.float32) for _ in range(2))
    zero = tuple(np.zeros(h * k, dtype=np.float32) for _ in range(3))
    launched = record_launches(monkeypatch)
    out, _ = kernels.attention_rows(q, kk, v, zero, spans_of([1] * n), spans_of([1] * n), h, False, 0.25)
    assert launched == ["attention_rows_forward_mma"]
    x = v.astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.abs(x))) - 10)
    want = np.sign(x) * np.floor(np.abs(x) / ulp + 0.5) * ulp
    assert np.array_equal(out.astype(np.float64), want)
    assert (np.abs(want[:3]) > np.abs(x[:3])).all() and not np.array_equal(want, x)   # ties went away from zero


def test_attention_on_packed_rows_gradients_are_central_differences():
    """Every entry of q, k and v (float64): attention_rows_backward's gradients of sum(out * w) against
    central differences of attention_rows, causal self-attention and cross-attention."""
    rng = np.random.default_rng(9)
    h, k = 2, 3
    for lq, lk, causal in (([3, 5], [3, 5], True), ([2, 4], [5, 1], False)):
        sq, sk = spans_of(lq), spans_of(lk)
        q, w = (rng.normal(size=(sum(lq), h * k)) for _ in range(2))
        kk, v = (rng.normal(size=(sum(lk), h * k)) for _ in range(2))
        biases = tuple(rng.normal(size=h * k) for _ in range(3))

        def loss(q, kk, v):
            return float((kernels.attention_rows(q, kk, v, biases, sq, sk, h, causal, 0.7)[0] * w).sum())
        out, lse = kernels.attention_rows(q, kk, v, biases, sq, sk, h, causal, 0.7)
        grads = [np.zeros_like(x) for x in (q, kk, v)]
        kernels.attention_rows_backward(w, out, lse, q, kk, v, biases, sq, sk, h, causal, 0.7, *grads)
        arrays, eps = [q, kk, v], 1e-6
        for a, g in zip(arrays, grads):
            num = np.zeros_like(a)
            for i in np.ndindex(a.shape):
                keep = a[i]
                a[i] = keep + eps
                up = loss(*arrays)
                a[i] = keep - eps
                num[i] = (up - loss(*arrays)) / (2 * eps)
                a[i] = keep
            np.testing.assert_allclose(g, num, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_the_16_byte_kernels_give_the_same_bits_as_the_one_value_ones(dtype, packed, monkeypatch):
    """MINITF_FUSED_VEC=1: bias_relu, relu_backward, unpack_heads (three projections stacked, their
    biases a stride apart, pads) and pack_heads through the *_vec kernels, 16 bytes a thread, equal to
    the one-value-a-thread kernels to the bit; a width that is not whole vectors (or an unaligned
    view) takes the one-value kernels."""
    from minitf.packing import Rows
    rng = np.random.default_rng(17)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    b, length, h, k = 3, 5, 2, 4 * vec
    keep = rng.random((b, length)) < 0.7 if packed else np.ones((b, length), dtype=bool)
    keep[:, 0] = True
    rows = Rows(keep)
    n = len(rows.host_index) if packed else b * length
    inverse, index = (rows.inverse, rows.index) if packed else (None, None)
    x3 = rng.normal(size=(3, n, h * k)).astype(dtype)
    buf = rng.normal(size=3 * (h * k + 7)).astype(dtype)          # three biases 7 values apart in one buffer
    heads = rng.normal(size=(3, b, h, length, k)).astype(dtype)
    act = rng.normal(size=(n, 2 * k)).astype(dtype)
    act[0, 0] = np.nan
    bias = rng.normal(size=2 * k).astype(dtype)
    dy = rng.normal(size=act.shape).astype(dtype)
    launched = record_launches(monkeypatch)

    def run():
        y = kernels.bias_relu(act.copy(), bias)
        return (kernels.unpack_heads(x3, buf, inverse, b, length, h, bias_stride=h * k + 7),
                kernels.unpack_heads(x3[1], None, inverse, b, length, h), kernels.pack_heads(heads, index),
                kernels.pack_heads(heads[2], index), y, kernels.relu_backward(dy.copy(), y))

    monkeypatch.setenv("MINITF_FUSED_VEC", "0")
    one = run()
    assert not [name for name in launched if name.endswith("_vec")]
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    launched.clear()
    wide = run()
    assert sorted(set(launched)) == ["bias_relu_vec", "pack_heads_vec", "relu_backward_vec", "unpack_heads_vec"]
    for a, w in zip(one, wide):
        equal(a, w)
    launched.clear()
    odd = rng.normal(size=(4, 2 * k + 1)).astype(dtype)
    kernels.bias_relu(odd, rng.normal(size=2 * k + 1).astype(dtype))
    shifted = np.empty(act.size + 1, dtype=dtype)[1:].reshape(act.shape)   # contiguous, one value off 16 bytes
    shifted[...] = dy
    kernels.relu_backward(shifted, act.copy())
    assert launched == ["bias_relu", "relu_backward"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loss_rows_in_one_pass_over_the_logits(dtype, monkeypatch):
    """smoothed_nll_rows_vec reads each row once, keeping per thread a running max and the sum of
    exp(z - max) rescaled as the max grows: lse, nll and smooth against float64 NumPy on rows whose max
    comes last (every value a new max), first, in the middle of a wide range (a value about 100 above
    the rest, whose exp overflows float16's range and, taken from the row's first value, float32's too),
    and equal values."""
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    v = 24 * vec
    rng = np.random.default_rng(9)
    rows = [np.linspace(-3, 3, v), np.linspace(3, -3, v), rng.normal(size=v), np.zeros(v)]
    wide = rng.normal(size=v) - 50.0
    wide[v // 2 + 1] = 50.0
    with np.errstate(over="ignore"):   # float32's range: the max must be found before the exps are summed
        assert np.exp(np.float32(wide[v // 2 + 1] - wide[0])) == np.inf
    rows.append(wide)
    logits = np.stack(rows).astype(dtype)
    gold = np.array([v - 1, 0, 3, 5, v // 2 + 1])
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    launched = record_launches(monkeypatch)
    lse, nll, smooth = kernels.smoothed_nll_rows(logits, gold)
    assert launched == ["smoothed_nll_rows_vec"]
    z = logits.astype(np.float64)
    m = z.max(axis=1)
    want_lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    acc = kernels.accum_dtype(dtype)
    close(lse, want_lse, acc, scale=4.0)
    close(nll, want_lse - z[np.arange(5), gold], acc, scale=4.0)
    close(smooth, want_lse - z.mean(axis=1), acc, scale=4.0)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loss_kernels_16_bytes_a_thread(dtype, monkeypatch):
    """A vocabulary of whole vectors takes smoothed_nll_rows_vec and smoothed_nll_backward_vec: the
    backward gives the one-value kernel's bits (the same arithmetic on each value), the row terms
    agree to rounding (their sums run in another order); an odd vocabulary takes the one-value kernels."""
    rng = np.random.default_rng(5)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    n, v, eps = 5, 40 * vec, 0.1
    logits = (rng.normal(size=(n, v)) * 4).astype(dtype)
    gold = rng.integers(0, v, size=n)
    w = rng.random(n).astype(kernels.accum_dtype(dtype))
    launched = record_launches(monkeypatch)

    def run():
        lse, nll, smooth = kernels.smoothed_nll_rows(logits, gold)
        return (lse, nll, smooth), kernels.smoothed_nll_backward(logits, gold, lse, w, eps, w_scale=0.5)

    monkeypatch.setenv("MINITF_FUSED_VEC", "0")
    rows_one, _ = run()
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    launched.clear()
    rows_wide, dz_wide = run()
    assert launched == ["smoothed_nll_rows_vec", "smoothed_nll_backward_vec"]
    for a, b in zip(rows_one, rows_wide):
        close(b, a, kernels.accum_dtype(dtype))
    monkeypatch.setenv("MINITF_FUSED_VEC", "0")
    equal(kernels.smoothed_nll_backward(logits, gold, rows_wide[0], w, eps, w_scale=0.5),
                                  dz_wide)
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    launched.clear()
    odd = logits[:, :v - 1].copy()
    kernels.smoothed_nll_backward(odd, gold % (v - 1), kernels.smoothed_nll_rows(odd, gold % (v - 1))[0], w, eps)
    assert launched == ["smoothed_nll_rows", "smoothed_nll_backward"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", ["kept", "longer"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_the_loss_forward_and_backward_in_one_launch(dtype, width, order, monkeypatch, emulated):
    """smoothed_nll_rows with grad: one launch (smoothed_nll_rows_grad_vec) gives smoothed_nll_rows_vec's
    lse, nll and smooth and writes smoothed_nll_backward_vec's gradient over the logits, bit for bit,
    with and without the loss scale on the device; rows a thread keeps in registers ("kept") and rows
    longer than NLL_KEEP vectors a thread, whose rest it reads again two vectors at a time ("longer": a
    block's worth and 3 more, so that threads 0-2 read two and the others one; gold in the last). The threads run in
    both orders between barriers (z[gold] must be read before its thread writes over it). An odd
    vocabulary takes the one-value kernels, one after the other, with the same bits as called apart."""
    monkeypatch.setattr(emulated, "reverse", order == "descending")
    rng = np.random.default_rng(11)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    keep = int(re.search(r"#define NLL_KEEP (\d+)", kernels.KERNELS).group(1))
    n, eps = 3, 0.1
    block = kernels.block_size("nll", 1 << 30)
    v = 40 * vec if width == "kept" else (keep * block + block + 3) * vec
    if width == "longer":
        assert v // vec > keep * kernels.block_size("nll", v)
    logits = (rng.normal(size=(n, v)) * 4).astype(dtype)
    gold = np.array([0, v - 1, v // 2 + 1])
    acc = kernels.accum_dtype(dtype)
    launched = record_launches(monkeypatch)
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    for dscale in (None, np.array([3.0], acc)):
        launched.clear()
        rows = kernels.smoothed_nll_rows(logits, gold)
        dz = kernels.smoothed_nll_backward(logits, gold, rows[0], None, eps, w_scale=0.25, dscale=dscale)
        assert launched == ["smoothed_nll_rows_vec", "smoothed_nll_backward_vec"]
        launched.clear()
        written = logits.copy()
        both = kernels.smoothed_nll_rows(written, gold, grad=(0.25, dscale, eps))
        assert launched == ["smoothed_nll_rows_grad_vec"]
        for a, b in zip(rows, both):
            equal(b, a)
        equal(written, dz)
    odd = logits[:, :41].copy()
    rows = kernels.smoothed_nll_rows(odd, gold % 41)
    dz = kernels.smoothed_nll_backward(odd, gold % 41, rows[0], None, eps, w_scale=0.25)
    launched.clear()
    both = kernels.smoothed_nll_rows(odd, gold % 41, grad=(0.25, None, eps))
    assert launched == ["smoothed_nll_rows", "smoothed_nll_backward"]
    for a, b in zip(rows, both):
        equal(b, a)
    equal(odd, dz)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.smoothed_nll_rows(logits[:, ::2], gold // 2, grad=(0.25, None, eps))


def test_the_loss_given_its_gradients_weight_hands_out_what_its_forward_wrote(monkeypatch):
    """label_smoothed_nll(..., grad=(dloss, dscale)) on the fused path: the backward returns the
    gradient the forward wrote, equal to the one computed after it; a backward asking for another
    dloss or another loss-scale array is refused (the gradient was written for the first)."""
    rng = np.random.default_rng(12)
    logits = (rng.normal(size=(5, 64)) * 3).astype(np.float32)
    gold = rng.integers(0, 64, size=5)
    scale = np.array([8.0], np.float32)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    loss, nll, n, cache = label_smoothed_nll(logits.copy(), gold, 0.1, None)
    assert isinstance(cache, FusedLossCache) and cache.grad_for is None
    want = label_smoothed_nll_backward(cache, 0.5, scale)
    got_loss, got_nll, got_n, early = label_smoothed_nll(logits.copy(), gold, 0.1, None, grad=(0.5, scale))
    assert (float(got_loss), float(got_nll), got_n) == (float(loss), float(nll), n)
    assert early.grad_for == (0.5, scale)
    equal(label_smoothed_nll_backward(early, 0.5, scale), want)
    with pytest.raises(ValueError, match="dloss=0.25.*dloss=0.5"):
        label_smoothed_nll_backward(early, 0.25, scale)
    with pytest.raises(ValueError, match="another dscale"):
        label_smoothed_nll_backward(early, 0.5, scale.copy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layernorm_kernels_a_warp_per_row(dtype, monkeypatch):
    """By default (MINITF_FUSED_LNWARP=0 turns it off) layernorm_forward, residual_layernorm and the LayerNorm's
    backward take a warp per row with 16-byte loads (rows of whole vectors, 2 lanes' shares uneven, rows not a multiple
    of the warps a block): the block kernels' results to rounding (the sums run in another order), the
    same dropout mask, and residual_layernorm the same bits as dropout_add then the LayerNorm; rows that
    are not whole vectors take the block kernels."""
    rng = np.random.default_rng(8)
    vec = kernels.VEC_BYTES // np.dtype(dtype).itemsize
    n, d, eps, p = 7, 32 * vec + 3 * vec, 1e-5, 0.1
    x, y, dy, dy2 = (rng.normal(size=(n, d)).astype(dtype) for _ in range(4))
    g, b, yb = (rng.normal(size=d).astype(dtype) for _ in range(3))
    rowpos, key = np.array([0, 2, 3, 7, 8, 9, 15]), F.DropoutSites(5, 9).next_site()[1]
    launched = record_launches(monkeypatch)
    acc_t = kernels.accum_dtype(dtype)

    def run(g=g, b=b):
        fwd = kernels.layernorm_forward(x, g, b, eps)
        res = kernels.residual_layernorm(key, rowpos, y.copy(), x, p, g, b, eps, y_bias=yb)
        dy_own = dy.copy()
        back = kernels.layernorm_backward_input(dy_own, fwd[1], g, dy2=dy2, mask=res[1])
        return fwd, res, back, dy_own

    monkeypatch.setenv("MINITF_FUSED_LNWARP", "0")
    (y1, (xh1, rs1)), (o1, m1, c1), (dx1, dxm1), dys1 = run()
    rxh1, rrs1 = kernels.xhat_of(c1), c1.rstd
    assert not [name for name in launched if name.endswith("_warp")]
    monkeypatch.delenv("MINITF_FUSED_LNWARP")
    launched.clear()
    (y2, (xh2, rs2)), (o2, m2, c2), (dx2, dxm2), dys2 = run()
    rxh2, rrs2 = kernels.xhat_of(c2), c2.rstd
    assert launched == ["layernorm_forward_warp", "residual_layernorm_warp", "layernorm_backward_warp"]
    for got, want, kind in ((y2, y1, dtype), (xh2, xh1, acc_t), (rs2, rs1, acc_t), (o2, o1, dtype), (rxh2, rxh1, acc_t),
                            (rrs2, rrs1, acc_t), (dx2, dx1, dtype), (dxm2, dxm1, dtype)):
        close(got, want, kind, scale=3.0)
    equal(F.mask_array(m2, o2), F.mask_array(m1, o1))
    equal(dys2, dys1)            # dy + dy2, written back into dy
    summed = kernels.dropout_add(key, rowpos, (y.astype(acc_t) + yb.astype(acc_t)).astype(dtype), x, p)[0]
    alone = kernels.layernorm_forward(summed, g, b, eps)
    equal(o2, alone[0])
    equal(rxh2, alone[1][0])
    launched.clear()
    kernels.layernorm_forward(x[:, :d - 1].copy(), g[:d - 1], b[:d - 1], eps)
    assert launched == ["layernorm_forward"]
    # parameters that do not start on 16 bytes (views of a flat buffer can lie anywhere) take the block kernels
    gbuf, bbuf = (np.concatenate([np.zeros(1, dtype), v]) for v in (g, b))
    launched.clear()
    (y3, (xh3, _)), (o3, _, _), (dx3, dxm3), _ = run(gbuf[1:], bbuf[1:])
    assert launched == ["layernorm_forward", "residual_layernorm", "layernorm_backward"]
    for got, want in ((y3, y1), (xh3, xh1), (o3, o1), (dx3, dx1), (dxm3, dxm1)):
        equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_relu_and_relu_backward_in_place(dtype):
    """bias_relu(x, b) = relu_forward(x + b) in x's memory; relu_backward(dy, y) = dy * (y > 0) in
    dy's memory; NaN stays NaN in the forward as in maximum(x, 0)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(7, 37)).astype(dtype)
    x[0, 0] = np.nan
    bias = rng.normal(size=37).astype(dtype)
    want = F.relu_forward(x + bias)
    out = kernels.bias_relu(x, bias)
    assert out is x
    equal(out, want)
    dy = rng.normal(size=x.shape).astype(dtype)
    want_dy = F.relu_backward(dy, out)
    got = kernels.relu_backward(dy, out)
    assert got is dy
    equal(got, want_dy)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_update_is_adams_passes_in_one(dtype, weight_decay):
    """Three steps of the fused update equal the generic Adam's (optim.Adam._update, then
    sync_weights): moments and master weights in the accumulation dtype, the float16 copy
    refreshed, a loss scale divided out."""
    from minitf.optim import Adam
    if dtype == BF16:   # a bfloat16 model is the GPU path's only: its flat buffers, on NumPy, for the kernel
        model = tiny_model("float16")
        model.flat_params, model.flat_grads = (a.astype(BF16) for a in (model.flat_params, model.flat_grads))
    else:
        model = tiny_model(np.dtype(dtype).name)
    rng = np.random.default_rng(5)
    fused, generic = Adam(model, lr=3e-3, weight_decay=weight_decay), Adam(model, lr=3e-3, weight_decay=weight_decay)
    start = model.weights.copy()
    grads = [rng.normal(size=model.flat_grads.size) * 512.0 for _ in range(3)]
    ends = []
    for opt, use_kernel in ((fused, True), (generic, False)):
        model.weights[...] = start
        model.sync_weights()
        for step in range(3):
            model.flat_grads[...] = grads[step]
            if use_kernel:
                kernels.adam_update(model.flat_grads, opt._m, opt._v, model.weights,
                                    model.flat_params if model.master_params is not None else None,
                                    (1 / 512.0, opt.beta1, opt.beta2, 1.0 - 3e-3 * weight_decay,
                                     1 / np.sqrt(1 - opt.beta2 ** (step + 1)), opt.eps, 3e-3 / (1 - opt.beta1 ** (step + 1))))
            else:
                opt.step_count = step
                opt.step(grad_divisor=512.0)
        ends.append((model.weights.copy(), opt._m.copy(), opt._v.copy(), model.flat_params.copy()))
    acc = np.float64 if dtype == np.float64 else np.float32
    for got, want in zip(*ends):
        close(got, want, acc)


def test_signatures_are_read_from_the_declarations():
    """SIGNATURES (what the emulator's launchers and the NVRTC tests take as a kernel's argument types) is read
    from the CUDA declarations: const dropped, pointers kept, multi-word integer types whole, every kernel."""
    code = ('extern "C" __global__ void k1(const T* x, A* y, unsigned long long key, const long long* ids,\n'
            '                                  unsigned int* counter, long long n, int d, A eps) {}\n'
            '__device__ inline int helper(int a) { return a; }\n'
            'extern "C" __global__ void k2(T *out) {}\n'
            'extern "C"  __global__\nvoid k3 (int n) {}\n'
            'extern "C" __global__ void __launch_bounds__(256, 8)\nk4(T* x, long long n) {}\n')
    assert kernels.declared_signatures(code) == {
        "k1": ["T*", "A*", "unsigned long long", "long long*", "unsigned int*", "long long", "int", "A"],
        "k2": ["T*"], "k3": ["int"], "k4": ["T*", "long long"]}
    from strict_cupy import parse_kernels, parse_launch_bounds   # the stand-in's own reading of the declarations
    assert kernels.SIGNATURES == parse_kernels(kernels.KERNELS)
    assert parse_launch_bounds(code) == {"k4": 256}
    assert f"#define WARP_SLOTS {kernels.WARP_ROW_MAX // 32}" in kernels.KERNELS   # the warp softmax's registers
    assert f"#define WARP_ROW_RUN {kernels.WARP_ROW_RUN} " in kernels.KERNELS   # ... and its rows a warp (the grid)
    bounds = parse_launch_bounds(kernels.KERNELS)       # the launches stay within them
    assert bounds == {"column_sums_into": kernels.COLUMN_BLOCK, "column_sums_relu_into": kernels.COLUMN_BLOCK,
                      "smoothed_nll_rows_grad_vec": kernels.BLOCK["nll"]}


NVCC = shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def _nvcc_version():
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout


def nvcc_compile(dtype, arch):
    """(PTX, {kernel: [registers, shared memory bytes, stack frame, spill stores, spill loads]}) of
    kernels.source(dtype) for `arch`: `nvcc -cubin -Xptxas -v` (its PTX kept with --keep, its resource report read
    from ptxas's lines), compiled once a test run per (dtype, arch) (tests/run_cache.py)."""
    source = kernels.source(dtype)
    command = ["-cubin", f"-arch={arch}", "-std=c++14", "-Xptxas", "-v", "--keep"]

    def make():
        with tempfile.TemporaryDirectory() as d:
            cu = os.path.join(d, "k.cu")
            with open(cu, "w") as f:
                f.write(source)
            r = subprocess.run([NVCC] + command + ["--keep-dir", d, cu, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True, cwd=d)
            assert r.returncode == 0, r.stderr
            ptx = [n for n in os.listdir(d) if n.endswith(".ptx")]
            assert len(ptx) == 1, sorted(os.listdir(d))
            with open(os.path.join(d, ptx[0])) as f:
                ptx = f.read()
        out, name, sizes = {}, None, None
        for line in r.stderr.splitlines():
            if m := re.search(r"Function properties for (\w+)", line):
                name = m.group(1)
            elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
                sizes = tuple(int(x) for x in m.groups())
            elif (m := re.search(r"Used (\d+) registers", line)) and name:
                smem = re.search(r"(\d+) bytes smem", line)
                out[name] = [int(m.group(1)), int(smem.group(1)) if smem else 0, *sizes]
                name = None
        return ptx, out
    return tuple(once("\n".join([NVCC, _nvcc_version(), *command, source]), make))


def ptxas_report(dtype, arch):
    """{kernel: (registers, shared memory bytes, stack frame, spill stores, spill loads)} from ptxas's
    resource report (`nvcc -cubin -Xptxas -v`) on kernels.source(dtype)."""
    return {name: tuple(sizes) for name, sizes in nvcc_compile(dtype, arch)[1].items()}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA syntax check needs it")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_source_compiles_with_nvcc(dtype):
    ptx = nvcc_compile(np.dtype(dtype).name, "sm_80")[0]
    for name in kernels.SIGNATURES:
        assert f".entry {name}(" in ptx


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the register report needs ptxas")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_without_spills(dtype, arch):
    """ptxas's resource report (`nvcc -cubin -Xptxas -v`) for every kernel: no stack frame, no
    spill stores or loads (docs/performance.md lists the registers and shared memory)."""
    report = ptxas_report(np.dtype(dtype).name, arch)
    assert set(kernels.SIGNATURES) <= set(report), sorted(report)
    assert [name for name, (_, _, *sizes) in report.items() if any(sizes)] == [], report


def _nvcc_release():
    if NVCC is None:
        return None
    m = re.search(r"release (\d+\.\d+)", _nvcc_version())
    return m and m.group(1)


@pytest.mark.skipif(_nvcc_release() != "13.0", reason="docs/performance.md's register table is nvcc 13.0's "
                                                      "(another ptxas allocates registers differently)")
def test_performance_mds_register_table_is_ptxas_report():
    """docs/performance.md's table of every kernel's registers on sm_90 in each storage dtype and its
    shared memory: ptxas's report, row by row, for every kernel the source has."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| (\d+|-) \| (\d+|-) \| (\d+|-) \| (\d+|-) \| ([^|]+) \|$", text, re.M)
    assert {name for name, *_ in rows} == set(kernels.SIGNATURES)

    def size(b):
        if b == 0 or b < 1024:
            return f"{b} bytes" if b else "0"
        return f"{b // 1024} KB" + (f" + {b % 1024} bytes" if b % 1024 else "")
    for name, *regs, smem in rows:
        reports = [ptxas_report(dt, "sm_90")[name] for dt in ("float32", "float16", "bfloat16", "float64")]
        if name in kernels.MMA_KERNELS:   # the tensor-core kernels: empty bodies in float64 ("-"); TF32 in float32
            assert regs[3] == "-" and reports[3][1] == 0, name
            assert [int(r) for r in regs[:3]] == [rep[0] for rep in reports[:3]], name
            assert smem.strip() == f"{size(reports[1][1])} ({size(reports[0][1])} in float32)", name
            assert reports[1][1] == reports[2][1] != reports[0][1], name
            continue
        assert [int(r) for r in regs] == [rep[0] for rep in reports], name
        want = size(reports[0][1]) + ("" if reports[3][1] == reports[0][1] else f" ({size(reports[3][1])} in float64)")
        assert smem.strip() == want and reports[1][1] == reports[2][1] == reports[0][1], name


# ----------------------------------------------------------------------------- the whole model, fused
def route_through_kernels(monkeypatch):
    """Route NumPy arrays through the fused kernels (emulated), as CuPy arrays are on a GPU.
    Blocks of 4-8 threads keep the emulation fast; the kernels above run at the real sizes."""
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    monkeypatch.setattr(kernels, "BLOCK", {"softmax": 4, "layernorm": 8, "nll": 8})
    monkeypatch.setattr(kernels, "MIN_BLOCK", 1)


@pytest.fixture
def fused(monkeypatch):
    route_through_kernels(monkeypatch)


def tiny_model(dtype, **kw):
    import minitf
    base = dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2, dropout=0.0, max_len=64)
    base.update(kw)
    return minitf.Transformer(minitf.Config(**base), dtype=dtype, seed=0)


SRC = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 5, 6, 7, 3]])
TGT_IN = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 11, 12]])
TGT_OUT = np.array([[4, 6, 8, 3, 0], [7, 5, 11, 12, 3]])


def loss_and_grads(model):
    model.zero_grad()
    loss = model.forward_loss(SRC, TGT_IN, TGT_OUT)
    model.backward()
    return loss, model.flat_grads.copy(), model.forward(SRC, TGT_IN)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_whole_model_fused_equals_generic_float64(positional, monkeypatch):
    generic = loss_and_grads(tiny_model("float64", positional=positional))
    route_through_kernels(monkeypatch)
    fused = loss_and_grads(tiny_model("float64", positional=positional))
    assert abs(fused[0] - generic[0]) <= 1e-12 * abs(generic[0])
    np.testing.assert_allclose(fused[2], generic[2], rtol=0, atol=1e-12 * np.abs(generic[2]).max())
    model = tiny_model("float64")
    for name, (start, stop, _) in model.slices.items():
        g, f = generic[1][start:stop], fused[1][start:stop]
        if name.endswith(".k.bias"):          # exactly 0 up to round-off on both paths
            continue
        assert np.linalg.norm(f - g) <= 1e-10 * np.linalg.norm(g), name


def test_fused_float16_with_loss_scaling_trains_like_float32(monkeypatch):
    """The mixed-precision step on the fused path (float16 kernels, float32 master weights),
    on the mixed-precision test's task: the loss falls like generic float32's."""
    from test_mixed_precision import train
    from minitf.optim import LossScaler
    _, l32, _ = train("float32", steps=60)
    route_through_kernels(monkeypatch)
    model, l16, skipped = train("float16", steps=60, scaler=LossScaler(init_scale=2.0 ** 12))
    assert np.mean(l16[-10:]) < 0.7 * np.mean(l16[:10])
    assert abs(np.mean(l16[-10:]) - np.mean(l32[-10:])) < 0.15 * np.mean(l32[-10:])
    assert model.flat_params.dtype == np.float16


def test_fused_dropout_path_trains(fused):
    """Dropout through the fused dropout+residual kernel: masks differ per call, loss falls."""
    import minitf
    model = tiny_model("float32", dropout=0.1)
    opt = minitf.Adam(model, lr=3e-3)
    losses = []
    for _ in range(40):
        model.zero_grad()
        losses.append(model.forward_loss(SRC, TGT_IN, TGT_OUT))
        model.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
    model.forward_loss(SRC, TGT_IN, TGT_OUT)
    masks = [model.encoder.layer_list[0].drop1.cache, model.decoder.layer_list[1].drop3.cache]
    assert masks[0].key != masks[1].key
    for m in masks:   # kept as their keys (the backward draws them again), standing for 0 / (1 / 0.9) masks
        assert type(m) is kernels.KeyedMask
        drawn = F.mask_array(m, np.empty((m.rowpos.size, 16), np.float32))
        assert set(np.unique(drawn)) == {0.0, np.float32(1 / 0.9)}


def test_compile_failure_falls_back_to_the_generic_path_with_one_warning(monkeypatch):
    import warnings

    class BrokenCupy:
        ndarray = np.ndarray       # so backend.xp_of(x) names this module

        class RawModule:
            def __init__(self, **kw):
                raise RuntimeError("NVRTC_ERROR_COMPILATION")
    monkeypatch.setattr(kernels.backend, "cupy", BrokenCupy)
    monkeypatch.setattr(kernels.backend, "is_gpu", lambda xp: True)
    monkeypatch.setattr(kernels, "_MODULES", {})
    monkeypatch.setattr(kernels, "COMPILE_ERRORS", {})
    x = np.zeros(3, np.float32)
    with pytest.warns(UserWarning, match="float32 did not compile.*NVRTC_ERROR_COMPILATION"):
        assert kernels.enabled(x) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.enabled(x) is False                  # decided once, no second warning
    assert "float32" in kernels.COMPILE_ERRORS


def test_decoding_through_the_kernels_matches_generic(monkeypatch):
    """Decoding uses masked_softmax with a scalar bias (cached self-attention) and a padding
    bias (cross-attention), and LayerNorm on single rows: same outputs both ways."""
    from minitf.decode import beam_search, greedy_search
    model = tiny_model("float64", dropout=0.1).eval()
    want = greedy_search(model, SRC, max_len_b=6), beam_search(model, SRC, beam_size=3, max_len_b=6)
    route_through_kernels(monkeypatch)
    got = greedy_search(model, SRC, max_len_b=6), beam_search(model, SRC, beam_size=3, max_len_b=6)
    assert got == want


def test_each_kernel_is_looked_up_once_not_on_every_launch(monkeypatch):
    """RawModule.get_function builds a new kernel object and asks the driver for the function
    each time: a training step launches ~130 kernels, so each is looked up once, at compile."""
    looked_up = []

    class Module:
        def __init__(self, code, options):
            pass

        def get_function(self, name):
            looked_up.append(name)
            return lambda grid, block, args: None

    class Cupy:
        RawModule = Module
    monkeypatch.setattr(kernels.backend, "cupy", Cupy)
    monkeypatch.setattr(kernels, "_MODULES", {})
    monkeypatch.setattr(kernels, "_FUNCTIONS", {})
    for _ in range(5):
        for name in ("softmax_backward", "dropout_add"):
            kernels._cupy_launch(name, np.float32, 1, 32, ())
    assert looked_up == list(kernels.SIGNATURES)           # each once, when the module compiled


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_check_decides_as_the_hosts_rules(dtype):
    """kernels.update_check on a run of outcomes (finite; an inf or NaN gradient anywhere, the last
    element included; a non-finite loss) gives what train.take_step's rules give on the host:
    ok, the finite flags, the sums, and optim.LossScaler's scale and good-update count (growth
    after `growth_interval` good updates, halving on an overflow, not below min_scale, unchanged by
    a non-finite loss); the launch leaves its counters at 0; without a scaler the scale stays 1."""
    from minitf.optim import LossScaler
    a = np.float64 if dtype == np.float64 else np.float32
    n = 5000   # several blocks of the grid-stride scan
    grad = np.random.default_rng(3).normal(size=n).astype(dtype)
    cases = [(None, 1.0)] * 3 + [(17, 1.0), (None, np.inf), (n - 1, 1.0), (None, 1.0), (0, 1.0), (None, np.nan)] \
        + [(2500, 1.0)] * 12 + [(None, 1.0)] * 5
    for with_scaler in (True, False):
        scaler = LossScaler(init_scale=8.0, growth_interval=3, min_scale=1.0) if with_scaler else None
        host = LossScaler(init_scale=8.0, growth_interval=3, min_scale=1.0)
        ctl, counter = np.zeros(8, dtype=a), np.zeros(2, dtype=np.uint32)
        ctl[0] = 8.0 if with_scaler else 1.0
        seen = []
        for bad, loss in cases:
            g = grad.copy()
            if bad is not None:
                g[bad] = np.inf if bad % 2 else np.nan
            scale_used = host.scale if with_scaler else 1.0
            kernels.update_check(g, np.array(loss * 3.0, dtype=a), np.array(2.5, dtype=a), ctl, counter, scaler)
            grads_ok, loss_ok = bad is None, bool(np.isfinite(loss))
            if with_scaler and loss_ok:
                host.update(grads_ok)
            assert list(counter) == [0, 0]
            assert ctl[3] == (grads_ok and loss_ok) and ctl[6] == grads_ok and ctl[7] == loss_ok, (bad, loss, ctl)
            assert ctl[2] == 1.0 / scale_used and ctl[5] == 2.5
            assert ctl[4] == loss * 3.0 or (np.isnan(loss) and np.isnan(ctl[4]))
            if with_scaler:
                assert ctl[0] == host.scale and ctl[1] == host.good_steps % host.growth_interval, (ctl, host.scale)
            else:
                assert ctl[0] == 1.0 and ctl[1] == 0.0
            seen.append(float(ctl[0]))
        if with_scaler:   # 12 overflows in a row reach min_scale, not below; then 3 good updates double it
            assert min(seen) == 1.0 and seen[-6:] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0], seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_update_reads_the_outcome_on_the_device(dtype):
    """adam_update with ctl: ok = 0 leaves every buffer as it was, bit for bit (weights, moments,
    the 16-bit copy); ok = 1 is the update with ctl's inv_scale in place of the argument's."""
    from minitf.optim import Adam
    model = tiny_model("float16" if dtype in ("float16", BF16) else np.dtype(dtype).name)
    if dtype == BF16:
        model.flat_params, model.flat_grads = (x.astype(BF16) for x in (model.flat_params, model.flat_grads))
    opt = Adam(model, lr=3e-3)
    a = np.float64 if dtype == np.float64 else np.float32
    model.flat_grads[...] = np.random.default_rng(8).normal(size=model.flat_grads.size) * 64.0
    copy = model.flat_params if model.master_params is not None else None
    coef = (1.0, opt.beta1, opt.beta2, 1.0, 1 / np.sqrt(1 - opt.beta2), opt.eps, 3e-3 / (1 - opt.beta1))
    before = [x.copy() for x in (model.weights, opt._m, opt._v, model.flat_params)]
    kernels.adam_update(model.flat_grads, opt._m, opt._v, model.weights, copy, coef,
                        ctl=np.array([64.0, 0, 1 / 64.0, 0, 0, 0, 0, 1], dtype=a))
    for got, want in zip((model.weights, opt._m, opt._v, model.flat_params), before):
        assert got.tobytes() == want.tobytes()
    kernels.adam_update(model.flat_grads, opt._m, opt._v, model.weights, copy, coef,
                        ctl=np.array([64.0, 0, 1 / 64.0, 1, 0, 0, 1, 1], dtype=a))
    with_ctl = [x.copy() for x in (model.weights, opt._m, opt._v, model.flat_params)]
    for x, b in zip((model.weights, opt._m, opt._v, model.flat_params), before):
        x[...] = b
    kernels.adam_update(model.flat_grads, opt._m, opt._v, model.weights, copy, (1 / 64.0, *coef[1:]))
    for got, want in zip(with_ctl, (model.weights, opt._m, opt._v, model.flat_params)):
        assert got.tobytes() == want.tobytes()
    assert with_ctl[0].tobytes() != before[0].tobytes()


def test_column_sums_into_a_buffer_refuses_a_second_factor():
    """column_sums(x, y, out=...) would add the sums of x alone (the one-launch kernel's parts = 1
    reads no y): it is refused, and column_sums_pair is the call for x * y."""
    x, y = np.ones((4, 3), dtype=np.float32), np.ones((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="column_sums_pair"):
        kernels.column_sums(x, y, out=np.zeros(3, dtype=np.float32))
