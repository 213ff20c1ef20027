"""Fused CUDA kernels for the GPU training step (one CuPy RawModule per dtype).

The NumPy-style code in functional.py and loss.py makes several passes over memory per
operation (softmax: max, subtract, exp, sum, divide). On a GPU those passes, not the
arithmetic, cost the time, so each operation below is ONE kernel that writes its outputs
once: one CUDA block per row for those that reduce a row (a row of attention scores, a d_model
vector, a vocabulary row; `block_size` threads, reducing in shared memory; the *_warp kernels a
warp per row), one thread per value (or per 16 bytes) for the elementwise ones; the attention_rows
kernels a block per 16 query (or key) rows of one sentence and head, 4 threads a row.

  masked_softmax        p = softmax(scores + bias) over the last axis (bias broadcast)
  softmax_backward      dx = p * (dp - sum(dp * p))
  (masked_softmax_warp, softmax_backward_warp: the same for rows up to 256 long, a warp per 2 rows; all four
  read a row's n values at its pitch: the head layout's rows lie row_pitch apart)
  layernorm_forward     y = xhat * g + b with xhat = (x - mean) * rstd, per row
  layernorm_backward    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
  dropout_add           out = y * mask + x, mask = (u >= round(p 2^16)) / (1 - p), u 16-bit, hashed from (key, position)
  residual_layernorm    LayerNorm(x + Dropout(y + b)) of a post-norm block: the sublayer's last bias add,
                        dropout_add and layernorm_forward in one pass per row, keeping the sum, mean and rstd
                        (layernorm_backward computes xhat and the mask again, column_sums_into xhat)
  smoothed_nll_rows     per row: logsumexp, -log p[gold], mean_v -log p[v]
  loss_totals           the batch's loss, NLL sum and loss sum from those rows' terms, one block
  smoothed_nll_backward dlogits = (softmax - q) * w, q = (1 - eps) onehot + eps / V_o
  smoothed_nll_rows_grad_vec  smoothed_nll_rows_vec and smoothed_nll_backward_vec in one launch, the gradient
                        written over the logits (training's loss: a row read once up to NLL_KEEP
                        16-byte vectors a thread, the rest of a longer row twice)
  column_partial_sums   the bias and LayerNorm parameter gradients: sums over the rows of
  column_sums_finish    x [rows, d] (or of x * y), in two passes of fixed order (deterministic)
  column_sums_into      the same sums ADDED into the gradient buffers in one launch (the training step's)
  column_sums_relu_into the same with ReLU's backward first, in place (relu_backward_sums)
  add_partials          a weight gradient's split-K parts (and the rows they left over) added into it
  unpack_heads          x [rows, H*K] (+ bias) -> [B, H, L, K]: a projection's kept rows put back
                        in the padded batch and split into heads, zeros at the pads, one pass
  pack_heads            x [B, H, L, K] -> [rows, H*K]: the heads merged and the kept rows taken
  bias_relu             x = max(x + b, 0) in place (the feed-forward's first layer and its ReLU)
  relu_backward         dy = dy * (y > 0) in place
  attention_rows_forward  softmax(scale q k^T + mask) v per sentence and head on packed rows [rows, H*K]
                        (the projections' outputs, biases added on load; no [B, H, T, S] array), and each
                        row's log-sum-exp; attention_rows_backward computes the weights again from it, in
                        blocks over the query rows (dq) and blocks over the key rows (dk, dv)
  attention_rows_*_mma  the same two on tensor cores (mma.sync; a warp a 16-row chunk, up to 3 a block sharing
                        each staged tile): float16 and bfloat16 (m16n8k16), float32 with TF32 products (m16n8k8,
                        CUPY_TF32=1), heads of 16, 32, 48 or 64 values, sm_80 and newer (attention_tensor_cores)
  adam_update           one Adam(W) update over the flat buffers (+ the 16-bit copy of the weights)
  update_check          an update's outcome on the device: every gradient finite, the loss scale's next value
  embed_rows            the kept rows' (embedding * sqrt(D) + PE) * dropout mask, one pass
  embedding_backward    the embedding's gradient summed per id in a fixed order (no atomics)
  *_vec                 bias_relu, relu_backward, unpack_heads, pack_heads, smoothed_nll_rows and
                        smoothed_nll_backward loading and storing 16 bytes a thread (kernels.vec_ok)
  *_warp (LayerNorm)    layernorm_forward, residual_layernorm and layernorm_backward with a warp per row
                        and 16-byte loads (kernels.ln_warp_ok; MINITF_FUSED_LNWARP=0 keeps the block kernels)

Every kernel reads and writes activations and gradients in the storage dtype (float16, bfloat16, float32 or
float64: the C type `T` of the source) and computes in the accumulation dtype (float32, or float64 for float64
arrays: `A`), in which it also keeps its statistics, caches and partial sums (and Adam its master weights and
moments; residual_layernorm keeps its input sum in the storage dtype, to compute xhat again),
like functional.py's generic path,
which stays the reference: tests/test_gpu.py compares the fused path with it on a GPU (elsewhere on the
strict CuPy stand-in), and
tests/test_kernels.py checks each kernel, running the same CUDA source on the CPU through a small emulator
(tests/cuda_emulator.py), so the kernels' logic is tested on machines without a GPU.

`enabled(x)` says whether x takes the fused path: CuPy arrays only, unless the environment
sets MINITF_FUSED=0 (then the generic path runs everywhere, for comparisons).

The file reads as llm.c's kernel headers do: after the prelude (16-bit storage, reductions), the dtypes, switches
and launching, one section per kernel family (softmax; dropout and LayerNorm; the loss; gradient sums; heads and
ReLU; attention on packed rows; Adam and the update's outcome; the embedding), each its CUDA source, then the
functions that launch it. KERNELS joins the sections' sources at the end, and SIGNATURES (each kernel's argument
types) is read from their declarations.
"""


import os
import re
import warnings
from typing import NamedTuple


import numpy as np


from . import backend


BLOCK = {"softmax": 128, "layernorm": 256, "nll": 512}   # most threads per row (powers of 2)
MIN_BLOCK = 32                                            # one warp
COLUMN_BLOCK = 256           # column sums: 8 groups of 32 threads a block (SLAB_RUNS in the CUDA source;
                             # column_sums_into's __launch_bounds__ there)
COLUMN_BLOCKS = 1024         # column sums: about this many blocks (several per multiprocessor) ...
COLUMN_MIN_ROWS = 64         # ... at most ceil(rows / this) slabs (about this many rows each, more than half of it)
WARP_ROW_MAX = 256           # softmax rows up to this long: a warp per WARP_ROW_RUN rows (masked_softmax_warp)
WARP_ROWS = 4                # ... and this many warps a block (a warp per row in the LayerNorms) ...
WARP_ROW_RUN = 2             # ... each taking this many softmax rows (WARP_ROW_RUN in the CUDA source)


def block_size(kind, n):
    """Threads for rows of length n: the power of 2 covering n, between MIN_BLOCK and
    BLOCK[kind] (a 32-wide LayerNorm row, the tiny preset's, gets one warp, not 256 threads mostly idle)."""
    return min(BLOCK[kind], max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length()))


# The CUDA source. `T` (storage) and `A` (accumulation) are typedef-ed per dtype in
# `source(dtype)`; the blocks below are plain CUDA C++ that NVRTC and the emulator both take.
# Each kernel's shared buffer holds 1024 values, the most threads a CUDA block can have.
# 16-bit storage without cuda_fp16.h or cuda_bf16.h (so NVRTC needs no include path): 16 raw bits
# in a struct that converts to and from float with a narrowing and a widening function.
STORAGE16 = r"""
#define MINITF_STORAGE16(NAME, NARROW, WIDEN) \
struct NAME { \
    unsigned short bits; \
    __device__ NAME() {} \
    __device__ NAME(float f) : bits(NARROW(f)) {} \
    __device__ NAME(double f) : bits(NARROW((float)f)) {} \
    __device__ operator float() const { return WIDEN(bits); } \
};
"""


# float16: converted with the PTX cvt instructions (round to nearest even).
HALF = r"""
#ifndef MINITF_EMULATE
__device__ inline float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ inline unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#endif
MINITF_STORAGE16(half_t, f2h, h2f)
"""


# bfloat16: the top 16 bits of a float32 (widening is a shift), narrowed with cvt.rn.bf16.f32 (round
# to nearest even; sm_80 and newer) or, before sm_80 and on the CPU emulator, the same rounding on the bits. Only in
# the bfloat16 source.
BFLOAT16 = r"""
#define MINITF_BF16 1   // the bfloat16 source (smoothed_nll_rows_grad_vec)
#ifndef MINITF_EMULATE
__device__ inline float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
#endif
#if __CUDA_ARCH__ >= 800 && !defined(MINITF_EMULATE)
__device__ inline unsigned short f2bf(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#else
// before sm_80 PTX has no bfloat16 conversion: round to nearest even on the bits, as cvt.rn.bf16.f32 does (a NaN gives
// the canonical NaN 0x7fff, as CUDA's own fallback in cuda_bf16.hpp does); the CPU emulator runs this too, and
// tests/test_kernels.py holds it to ml_dtypes' rounding
__device__ inline unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fffu;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
MINITF_STORAGE16(bf16_t, f2bf, bf2f)
"""


PRELUDE = r"""
#define NEG_BIG (-3.0e38f)

__device__ inline float a_exp(float x) { return expf(x); }
__device__ inline double a_exp(double x) { return exp(x); }
// exp(x) as 2^(x log2(e)) where every value of a long row takes an exp (the loss's rows): on a GPU one multiply and
// ex2.approx.ftz (the MUFU.EX2 instruction), where expf spends 9 instructions on its range reduction (ptxas for
// sm_90); within ex2.approx's 2 ulp (exp2f's bound in CUDA's math library) and the product's rounding, about
// |x| 2^-24 relative, the most for the values farthest below the max (the least of the sums); a result below
// float32's normal range is 0. The CPU emulator takes exp2f. float64 (tests only) keeps exp.
#ifndef MINITF_EMULATE
__device__ inline float a_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
#else
__device__ inline float a_exp2(float x) { return exp2f(x); }
#endif
__device__ inline float a_exp2e(float x) { return a_exp2(x * 1.4426950408889634f); }
__device__ inline double a_exp2e(double x) { return exp(x); }
__device__ inline float a_log(float x) { return logf(x); }
__device__ inline double a_log(double x) { return log(x); }
__device__ inline float a_sqrt(float x) { return sqrtf(x); }
__device__ inline double a_sqrt(double x) { return sqrt(x); }
__device__ inline float a_max(float a, float b) { return a > b ? a : b; }
__device__ inline int a_finite(float x) { return isfinite(x); }
__device__ inline int a_finite(double x) { return isfinite(x); }
__device__ inline double a_max(double a, double b) { return a > b ? a : b; }

// Tree reductions over the block (blockDim.x a power of 2; on a GPU at least 32, kernels.MIN_BLOCK, but the CPU
// emulator's tests run blocks of 4 or 8: their shuffles stay inside the block); every thread returns the result.
// `buf` holds blockDim.x values. The tree: for s = blockDim.x / 2, ..., 1, value t becomes op(value t, value
// t + s) for t < s; the result is value 0. Its steps across warps (s >= 32) are warp 0's alone: lane l takes the
// values l, l + 32, l + 64, ..., which at each of those steps read only values of the same lane (t + s, s a multiple
// of 32), so no barrier is needed between them; its steps within a warp (s = 16 .. 1) are shuffles, where lane 0
// combines what the tree's value 0 combines, in the same order: the tree's bits, with 3 block barriers where the
// tree took one a step (10 for 256 threads). Every warp makes the shuffles, on its own values; only warp 0's lane 0
// keeps its result.
#define BLOCK_TREE(OP)                                                                      \
    unsigned t = threadIdx.x;                                                               \
    if (blockDim.x > 32) {                                                                  \
        buf[t] = v;                                                                         \
        __syncthreads();                                                                    \
        if (t < 32) {                                                                       \
            for (unsigned s = blockDim.x / 2; s >= 32; s >>= 1)                             \
                for (unsigned i = t; i < s; i += 32) buf[i] = OP(buf[i], buf[i + s]);      \
            v = buf[t];                                                                     \
        }                                                                                   \
    }                                                                                       \
    unsigned w = blockDim.x < 32 ? blockDim.x : 32;                                        \
    unsigned lanes = w == 32 ? 0xffffffffu : (1u << w) - 1u;                                \
    for (unsigned o = w / 2; o > 0; o >>= 1) v = OP(v, __shfl_xor_sync(lanes, v, o));      \
    if (t == 0) buf[0] = v;                                                                 \
    __syncthreads();                                                                        \
    A r = buf[0];                                                                           \
    __syncthreads();                                                                        \
    return r;

__device__ inline A a_add(A a, A b) { return a + b; }
__device__ A block_sum(A v, A* buf) { BLOCK_TREE(a_add) }
__device__ A block_max(A v, A* buf) { BLOCK_TREE(a_max) }

// 16 bytes of storage values (VEC: 8 float16 or bfloat16, 4 float32, 2 float64), loaded and stored at once by the
// *_vec kernels where the arrays are 16-byte aligned and the widths whole vectors (kernels.vec_ok).
#define VEC ((int)(16 / sizeof(T)))
struct alignas(16) Vec { T v[16 / sizeof(T)]; };
#define AVEC ((int)(16 / sizeof(A)))   // 16 bytes of the accumulation type: a Vec's values are VEC / AVEC of them
struct alignas(16) AVec { A v[16 / sizeof(A)]; };
"""


# ----------------------------------------------------------------------------- dtypes and switches
C_TYPES = {"float16": ("half_t", "float"), "bfloat16": ("bf16_t", "float"), "float32": ("float", "float"),
           "float64": ("double", "double")}
_NAMES = {}   # dtype (or scalar type, or name) -> its name: np.dtype(d).name costs ~2 us, and a step asks
# hundreds of times (~1,400 before the lookups were cached: docs/benchmarks.md)


def dtype_name(dtype):
    """np.dtype(dtype).name, looked up once per dtype."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name   # (a name NumPy
        # knows only once ml_dtypes is imported)
    return name


def accum_dtype(dtype):
    """The dtype the kernels compute (and keep LayerNorm's cache) in: float64 stays float64."""
    return np.float64 if dtype_name(dtype) == "float64" else np.float32


def source(dtype):
    """The complete CUDA source for one storage dtype: its typedefs, the prelude, then KERNELS (the sections
    below, each a kernel family's CUDA beside the functions that launch it)."""
    name = dtype_name(dtype)
    t, a = C_TYPES[name]
    mma = {"float16": '#define ATT_MMA 1\n#define ATT_MMA_TF32 0\n#define ATT_MMA_BF16 0\n#define ATT_MMA_AB "f16"\n',
           "bfloat16": '#define ATT_MMA 1\n#define ATT_MMA_TF32 0\n#define ATT_MMA_BF16 1\n#define ATT_MMA_AB "bf16"\n',
           "float32": '#define ATT_MMA 1\n#define ATT_MMA_TF32 1\n'}.get(name, "#define ATT_MMA 0\n#define ATT_MMA_TF32 0\n")
    # column_sums_into's blocks a multiprocessor (its comment): 8 on sm_90, sm_100 and sm_103 (2,048 threads a
    # multiprocessor), but in float64 (tests only); 6 on sm_80 to sm_89 and on the others from sm_90 on (1,536 threads on
    # sm_86, sm_89, Thor's sm_101 (sm_110 from CUDA 13) and sm_120); 4 before sm_80 (sm_75 runs at most 1,024)
    eight = "0" if name == "float64" else "__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || __CUDA_ARCH__ == 1030"
    sums = (f"#if {eight}\n#define SUMS_BLOCKS 8\n#elif __CUDA_ARCH__ >= 800\n#define SUMS_BLOCKS 6\n"
            "#else\n#define SUMS_BLOCKS 4\n#endif\n")
    sums += f"#define NLL_BLOCKS {1 if name == 'float64' else 2}\n"   # smoothed_nll_rows_grad_vec's (its comment)
    return (STORAGE16 + HALF + (BFLOAT16 if name == "bfloat16" else "") + f"typedef {t} T;\ntypedef {a} A;\n" + mma
            + sums + PRELUDE + KERNELS)


# The switches below are read on every call (bench/gpu_ab.py flips them between steps), hundreds
# of times a GPU step: as a lookup in os.environ's own store where Python keeps one (a dict of encoded keys and
# values, kept in step with every change to os.environ), not os.environ.get's encoding and decoding.
_ENV_STORE = getattr(os.environ, "_data", None)
_ENV_KEYS = {}
_ENV_VALUES = {v: os.environ.encodevalue(v) for v in ("0", "1")} if _ENV_STORE is not None else {}


def _env_is(name, value):
    """os.environ.get(name) == value, for value "0" or "1"."""
    if _ENV_STORE is None:
        return os.environ.get(name) == value
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    return _ENV_STORE.get(key) == _ENV_VALUES[value]


def switched_off(name):
    """Whether the environment sets `name` to 0 (a switch that is on by default)."""
    return _env_is(name, "0")


def switched_on(name):
    """Whether the environment sets `name` to 1 (a switch that is off by default)."""
    return _env_is(name, "1")


def enabled(x):
    """Whether x (an array) takes the fused kernels: CuPy arrays whose dtype's kernels
    compiled, unless MINITF_FUSED=0. A compile failure is reported once (warning) and that
    dtype stays on the generic path: training goes on, slower."""
    if not backend.is_gpu(backend.xp_of(x)) or switched_off("MINITF_FUSED"):
        return False
    return _module(x.dtype) is not None


def fused(x, name):
    """Whether x takes the fusion `name`: `enabled(x)`, unless the environment sets
    MINITF_FUSED_<NAME>=0 (then that part runs as separate passes, for comparisons:
    bench/gpu_ab.py). The names: 'relu' (bias + ReLU, and its backward, in place),
    'adam' (one Adam kernel), 'embed' (the embedding of the kept rows and its gradient, one kernel each), 'grads' (gradient sums added where they go: a LayerNorm's
    backward with its residual gradient, dropout mask and parameter sums; a bias's sum, but the attention
    projections' bias sums, which follow MINITF_CUBLAS), 'norm' (a
    post-norm block's residual sum, dropout and LayerNorm forward in one pass: residual_layernorm), 'loss' (the
    loss's gradient written during its forward when the backward's weight is known: smoothed_nll_rows' grad)."""
    return enabled(x) and not switched_off("MINITF_FUSED_" + name.upper())


# ----------------------------------------------------------------------------- launching
_MODULES = {}        # dtype name -> compiled cupy.RawModule, or None if it failed to compile
COMPILE_ERRORS = {}  # dtype name -> the error
_FUNCTIONS = {}      # (dtype name, kernel name) -> cupy RawKernel: looked up once, not on every launch


def _module(dtype):
    key = dtype_name(dtype)
    if key not in _MODULES:
        if key not in C_TYPES:
            _MODULES[key] = None
            return None
        try:
            module = backend.cupy.RawModule(code=source(dtype), options=("-std=c++14",))
            for name in SIGNATURES:            # compiles now, not in the middle of a step
                _FUNCTIONS[(key, name)] = module.get_function(name)
            _MODULES[key] = module
        except Exception as e:  # NVRTC or driver error: fall back to the generic CuPy path
            _MODULES[key] = None
            COMPILE_ERRORS[key] = e
            warnings.warn(f"minitf: the fused CUDA kernels for {key} did not compile ({type(e).__name__}: {e}); "
                          f"using the generic CuPy path (slower). Set MINITF_FUSED=0 to silence this.")
    return _MODULES[key]


def _function(name, dtype):
    key = (dtype_name(dtype), name)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        module = _module(dtype)             # compiling it looks up every kernel of SIGNATURES
        fn = _FUNCTIONS.get(key) or _FUNCTIONS.setdefault(key, module.get_function(name))
    return fn


def _cupy_launch(name, dtype, grid, block, args):
    _function(name, dtype)((grid,), (block,), args)


# launch(name, dtype, grid, block, args): CuPy's on a GPU; tests swap in the CPU emulator
LAUNCH = {"launch": _cupy_launch}


def _launch(name, dtype, grid, block, args):
    if grid > 0:
        LAUNCH["launch"](name, dtype, grid, block, args)


def _rows(x):
    """x [..., n] -> (number of rows, n)."""
    n = x.shape[-1]
    return x.size // n if n else 0, n


def _as(p, dtype):
    """A parameter vector in the kernel's storage dtype: itself when it already is (the model's)."""
    xp = backend.xp_of(p)
    return p if p.dtype == dtype and p.flags.c_contiguous else xp.ascontiguousarray(p, dtype=dtype)


ELEMENTWISE_BLOCK = 256      # threads a block for the one-thread-per-element kernels
_PLACEHOLDERS = {}           # (array module, dtype) -> a 1-element array for an argument a kernel does not read


def _placeholder(xp, dtype):
    key = (id(xp), dtype_name(dtype))
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = (xp, xp.zeros(1, dtype=dtype))
    return _PLACEHOLDERS[key][1]


def _row_block(n):
    """Threads for a block that walks a row of n values (a warp at least, 256 at most)."""
    return min(256, max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length()))


VEC_BYTES = 16   # the vectorized kernels' load: VEC_BYTES / itemsize values a thread


def vec_ok(*arrays, width):
    """Whether the *_vec kernels apply: unless the environment sets MINITF_FUSED_VEC=0, when
    every array 16-byte aligned, and `width` (the values that must lie in whole vectors: a row's
    length, a head's K) a multiple of VEC."""
    if switched_off("MINITF_FUSED_VEC"):
        return False
    vec = VEC_BYTES // arrays[0].itemsize
    return width % vec == 0 and _aligned(*arrays)


def _address(a):
    """The address of a's first element (a CuPy array's device pointer, or a NumPy array's on the emulator)."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr   # (NumPy's .data refuses bfloat16)


def _aligned(*arrays):
    """Whether every array starts on a 16-byte boundary (what 16-byte loads need: the *_vec kernels, and the
    tensor-core attention's staging; a row of H*K 16-bit or float32 values, K a multiple of 16, is whole 16-byte
    vectors)."""
    return all(_address(a) % VEC_BYTES == 0 for a in arrays)


# ----------------------------------------------------------------------------- softmax
# The attention weights of the head layout and their gradient: a block per row, or a warp per row up to
# WARP_ROW_MAX (paper 3.2.1).
SOFTMAX = r"""
// p = softmax(scores + bias) over rows of length n; scores [B, H, L, pitch] as rows r = (b*H + h)*L + t (L queries:
// Tq), row r's values at r * pitch .. r * pitch + n - 1 (pitch >= n: the values past n are neither read nor written).
// bias is read at b*sb + h*sh + t*st + j*sj (element strides; 0 on broadcast axes).
// p may alias scores (in place).
extern "C" __global__ void masked_softmax(const T* scores, const T* bias, T* p, int n, int H, int Tq,
                                          long long sb, long long sh, long long st, long long sj, long long pitch) {
    __shared__ A buf[1024];
    long long r = blockIdx.x;
    long long t = r % Tq, h = (r / Tq) % H, b = r / ((long long)Tq * H);
    const T* x = scores + r * pitch;
    const T* bb = bias + b * sb + h * sh + t * st;
    T* y = p + r * pitch;
    A m = NEG_BIG;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = a_max(m, (A)x[j] + (A)bb[j * sj]);
    m = block_max(m, buf);
    A s = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += a_exp((A)x[j] + (A)bb[j * sj] - m);
    s = block_sum(s, buf);
    A inv = (A)1 / s;
    for (int j = threadIdx.x; j < n; j += blockDim.x) y[j] = (T)(a_exp((A)x[j] + (A)bb[j * sj] - m) * inv);
}

// dx = p * (dp - sum_j dp_j p_j) per row of length n (row r at r * pitch, as masked_softmax); dx may alias dp.
extern "C" __global__ void softmax_backward(const T* dp, const T* p, T* dx, int n, long long pitch) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * pitch;
    A s = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (A)dp[off + j] * (A)p[off + j];
    s = block_sum(s, buf);
    for (int j = threadIdx.x; j < n; j += blockDim.x) dx[off + j] = (T)((A)p[off + j] * ((A)dp[off + j] - s));
}

// The same two kernels for short rows (n <= WARP_ROW_MAX), a warp per WARP_ROW_RUN rows: the block's warps take
// rows (blockIdx.x * warps + warp) * WARP_ROW_RUN + u, each lane the row's elements lane, lane + 32, ...; the
// reductions are warp shuffles (no shared memory, no block barrier). Every warp runs the same shuffles, also
// past the last row (valid = 0 there), so the block's threads stay in step. A lane keeps its (at most
// WARP_SLOTS) values of each row in registers: the row is read once, every load of the warp's rows issued before the
// first is used (a warp per row had one row's loads in flight: 68-88 bytes of float16 scores, and the bias's, for
// the 34-44 keys of a WMT-shaped sentence), and each value's exponential is taken once (the same values, sums and bits as reading the
// row three times, row by row).
#define WARP_SLOTS 8     // kernels.WARP_ROW_MAX / 32
#define WARP_ROW_RUN 2   // rows a warp, each row's loads issued before the first row's sums (kernels.WARP_ROW_RUN)
__device__ inline A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = a_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ inline A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void masked_softmax_warp(const T* scores, const T* bias, T* p, long long rows, int n, int H,
                                               int Tq, long long sb, long long sh, long long st, long long sj,
                                               long long pitch) {
    int lane = threadIdx.x % 32;
    long long r0 = ((long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * WARP_ROW_RUN;
    A v[WARP_ROW_RUN][WARP_SLOTS];   // row u's value k: element lane + 32 k of the row, scores + bias
    int len[WARP_ROW_RUN];
#pragma unroll
    for (int u = 0; u < WARP_ROW_RUN; u++) {   // every row's loads first
        long long r = r0 + u;
        int valid = r < rows;
        long long rr = valid ? r : 0;
        long long bh = rr / Tq, t = rr - bh * Tq, b = bh / H, h = bh - b * H;   // two divisions, not three
        const T* x = scores + rr * pitch;
        const T* bb = bias + b * sb + h * sh + t * st;
        len[u] = valid ? n : 0;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            int j = lane + 32 * k;
            if (32 * k >= len[u]) break;            // the same for the whole warp
            v[u][k] = j < len[u] ? (A)x[j] + (A)bb[j * sj] : (A)NEG_BIG;
        }
    }
#pragma unroll
    for (int u = 0; u < WARP_ROW_RUN; u++) {
        A m = NEG_BIG;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            if (32 * k >= len[u]) break;
            if (lane + 32 * k < len[u]) m = a_max(m, v[u][k]);
        }
        m = warp_max(m);
        A s = 0;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            if (32 * k >= len[u]) break;
            if (lane + 32 * k < len[u]) { v[u][k] = a_exp(v[u][k] - m); s += v[u][k]; }
        }
        A inv = (A)1 / warp_sum(s);
        T* y = p + (r0 + u < rows ? r0 + u : 0) * pitch;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            int j = lane + 32 * k;
            if (32 * k >= len[u]) break;
            if (j < len[u]) y[j] = (T)(v[u][k] * inv);
        }
    }
}

extern "C" __global__ void softmax_backward_warp(const T* dp, const T* p, T* dx, long long rows, int n,
                                                 long long pitch) {
    int lane = threadIdx.x % 32;
    long long r0 = ((long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * WARP_ROW_RUN;
    A g[WARP_ROW_RUN][WARP_SLOTS], q[WARP_ROW_RUN][WARP_SLOTS];   // dp and p of row u's element lane + 32 k
    int len[WARP_ROW_RUN];
#pragma unroll
    for (int u = 0; u < WARP_ROW_RUN; u++) {   // every row's loads first
        len[u] = r0 + u < rows ? n : 0;
        long long off = (r0 + u < rows ? r0 + u : 0) * pitch;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            int j = lane + 32 * k;
            if (32 * k >= len[u]) break;
            if (j < len[u]) { g[u][k] = (A)dp[off + j]; q[u][k] = (A)p[off + j]; }
        }
    }
#pragma unroll
    for (int u = 0; u < WARP_ROW_RUN; u++) {
        long long off = (r0 + u < rows ? r0 + u : 0) * pitch;
        A s = 0;
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            if (32 * k >= len[u]) break;
            if (lane + 32 * k < len[u]) s += g[u][k] * q[u][k];
        }
        s = warp_sum(s);
#pragma unroll
        for (int k = 0; k < WARP_SLOTS; k++) {
            int j = lane + 32 * k;
            if (32 * k >= len[u]) break;
            if (j < len[u]) dx[off + j] = (T)(q[u][k] * (g[u][k] - s));
        }
    }
}
"""


def row_pitch(n, dtype):
    """The elements between the starts of the head layout's rows of n attention weights (or scores, or their gradients):
    n rounded up to whole 16-byte vectors (8 values in 16 bits, 4 in float32, 2 in float64), so that every row, and
    every head's matrix of them, starts on a 16-byte boundary, as cuBLAS's kernels that load 16 bytes at a time need of
    an operand's leading dimension and batch stride (a sentence of 34 keys leaves 68 bytes a float16 row: cuBLAS then
    takes kernels that load 2 or 4 bytes at a time). The values past n are never read. n itself where the environment
    sets MINITF_ATTN_PITCH=0 (for comparisons)."""
    if switched_off("MINITF_ATTN_PITCH"):
        return n
    vec = VEC_BYTES // np.dtype(dtype).itemsize
    return -(-n // vec) * vec


def _row_length(x, n):
    """(rows, n, pitch) of x [..., pitch] C-contiguous holding rows of n <= pitch values (n None: the whole rows)."""
    pitch = x.shape[-1]
    n = pitch if n is None else n
    if not x.flags.c_contiguous or not 0 <= n <= pitch:
        raise ValueError(f"softmax: rows of {n} values in an array of shape {x.shape} (C-contiguous: "
                         f"{x.flags.c_contiguous}): expected C-contiguous rows of at least {n}")
    return (x.size // pitch if pitch else 0), n, pitch


def _like(x, ref, name):
    """x, where it is C-contiguous and shaped like ref (the softmax kernels index both alike), else a ValueError."""
    if x.shape != ref.shape or not x.flags.c_contiguous:
        raise ValueError(f"softmax: {name} of shape {x.shape} (C-contiguous: {x.flags.c_contiguous}) where the rows "
                         f"are {ref.shape}: expected a C-contiguous array of that shape")
    return x


def masked_softmax(scores, bias, out=None, n=None):
    """softmax(scores + bias) over the last axis; scores [B, H, T, S] C-contiguous, bias
    broadcastable to it (read through strides, never materialized). Writes into `out`
    (which may be scores). n: the rows hold their n first values (scores [B, H, T, P], P >= n: row_pitch), the
    softmax over those, bias broadcastable to [B, H, T, n]; the values past n are neither read nor written."""
    xp = backend.xp_of(scores)
    b, h, t, _ = scores.shape
    rows, n, pitch = _row_length(scores, n)
    bias = xp.asarray(bias, dtype=scores.dtype)
    bias = xp.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + bias.shape), (b, h, t, n))
    sb, sh, st, sj = (stride // bias.itemsize for stride in bias.strides)
    out = xp.empty_like(scores) if out is None else _like(out, scores, "out")
    if n <= WARP_ROW_MAX:       # a warp per WARP_ROW_RUN rows, WARP_ROWS warps a block
        _launch("masked_softmax_warp", scores.dtype, -(-rows // (WARP_ROWS * WARP_ROW_RUN)), 32 * WARP_ROWS,
                (scores, bias, out, np.int64(rows), np.int32(n), np.int32(h), np.int32(t), np.int64(sb), np.int64(sh),
                 np.int64(st), np.int64(sj), np.int64(pitch)))
        return out
    _launch("masked_softmax", scores.dtype, rows, block_size("softmax", n),
            (scores, bias, out, np.int32(n), np.int32(h), np.int32(t), np.int64(sb), np.int64(sh), np.int64(st),
             np.int64(sj), np.int64(pitch)))
    return out


def softmax_backward(dp, p, out=None, n=None):
    """dx = p * (dp - sum(dp * p)) over the last axis; p C-contiguous, `out` may be dp. n: the rows hold their n first
    values (as masked_softmax's n; dp then C-contiguous too, shaped like p)."""
    xp = backend.xp_of(p)
    dp = _like(xp.ascontiguousarray(dp), p, "dp")
    out = xp.empty_like(p) if out is None else _like(out, p, "out")
    rows, n, pitch = _row_length(p, n)
    if n <= WARP_ROW_MAX:
        _launch("softmax_backward_warp", p.dtype, -(-rows // (WARP_ROWS * WARP_ROW_RUN)), 32 * WARP_ROWS,
                (dp, p, out, np.int64(rows), np.int32(n), np.int64(pitch)))
        return out
    _launch("softmax_backward", p.dtype, rows, block_size("softmax", n), (dp, p, out, np.int32(n), np.int64(pitch)))
    return out


# ----------------------------------------------------------------------------- dropout and LayerNorm
# Dropout's mask drawn again from its key wherever it is needed, LayerNorm's forward and backward (a block
# per row, or a warp where its 16-byte loads apply), and a post-norm block's residual sum, dropout and LayerNorm
# in one pass (paper 3.1, 5.4).
LAYERNORM = r"""
// Dropout's mask value from its key: u = 16 bits of splitmix64(key + w * GOLDEN), w = pos * ceil(d / 4) + c / 4 + 1
// for column c of a row at position pos of the padded [B*L, d] batch (rowpos[r] where the rows are packed, else r);
// kept where u >= thresh = round(p 2^16), as scale = 1 / (1 - p) (functional.hash_bits: the same bits with xp
// operations). dropout_add, residual_layernorm and embed_rows use it, and layernorm_backward and embedding_backward
// (and the *_warp forms) to draw the forward's mask again.
__device__ inline unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The mask value of column c of a row at position pos: scale where the hashed u >= thresh, else 0.
__device__ inline A dropout_keep(unsigned long long key, unsigned long long pos, int d, int c, int thresh, A scale) {
    unsigned long long w = pos * (unsigned long long)((d + 3) / 4) + (unsigned long long)(c / 4) + 1ULL;
    int u = (int)((mix64(key + w * 0x9E3779B97F4A7C15ULL) >> (16 * (c & 3))) & 0xffffULL);
    return u >= thresh ? scale : (A)0;
}

// The mask value of column c of a row (at off, position pos) as it was stored in the storage type T: (mode 1)
// read from mask, (mode 2) drawn again from its key and rounded to T (the same bits as the stored mask).
__device__ inline A mask_at(int mode, const T* mask, long long off, unsigned long long pos, unsigned long long key,
                            int d, int c, int thresh, A scale) {
    return mode == 1 ? (A)mask[off + c] : (A)(T)dropout_keep(key, pos, d, c, thresh, scale);
}

// One row of length d at x + off whose sum (this thread's share of it) is s: mean, rstd = (var + eps)^-1/2
// (biased variance, a second pass over the row), xhat = (x - mean) * rstd, y = xhat * g + b; rstd[row] by
// thread 0. Kept for backward, in the accumulation type: xhat [rows, d] in `keep` (keep_mean 0), or only the
// mean, keep[row] (keep_mean 1: the backward computes xhat again from x, mean and rstd, the same bits).
// layernorm_forward and residual_layernorm end with it.
__device__ void layernorm_row(const T* x, long long off, int d, A s, const T* g, const T* bvec, T* y, A* keep,
                              int keep_mean, A* rstd, long long row, A eps, A* buf) {
    A mean = block_sum(s, buf) / d;
    A v = 0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) { A c = (A)x[off + j] - mean; v += c * c; }
    A rs = (A)1 / a_sqrt(block_sum(v, buf) / d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        A xh = ((A)x[off + j] - mean) * rs;
        if (!keep_mean) keep[off + j] = xh;
        y[off + j] = (T)(xh * (A)g[j] + (A)bvec[j]);
    }
    if (threadIdx.x == 0) {
        rstd[row] = rs;
        if (keep_mean) keep[row] = mean;
    }
}

// xhat of element j of a row at off: read from the kept xhat (from_mean 0), or computed again from the
// LayerNorm's input xs, its row's mean and rstd rs (from_mean 1) as layernorm_row computed it (the same bits).
__device__ inline A xhat_at(int from_mean, const A* xhat, const T* xs, A mean, A rs, long long off, int j) {
    return from_mean ? ((A)xs[off + j] - mean) * rs : xhat[off + j];
}

// Per row of length d: its sum, then layernorm_row.
extern "C" __global__ void layernorm_forward(const T* x, const T* g, const T* bvec, T* y, A* xhat, A* rstd,
                                             int d, A eps) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * d;
    A s = 0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += (A)x[off + j];
    layernorm_row(x, off, d, s, g, bvec, y, xhat, 0, rstd, blockIdx.x, eps, buf);
}

// dxhat = dy * g; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) per row.
// has_dy2: the upstream gradient is dy + dy2 (a residual branch's gradient of the same output),
// rounded to the storage type and written back into dy (the parameter gradients' column sums read it there).
// has_mask: also dxm = dx * mask (the gradient of the dropout's input before this LayerNorm), the mask read from
// `mask` (1) or drawn again from its key as residual_layernorm drew it (2: rowpos, has_rows, key, thresh, scale).
// from_mean: xhat computed again from the LayerNorm's input xs and mean (residual_layernorm's cache), not read.
extern "C" __global__ void layernorm_backward(T* dy, const T* dy2, int has_dy2, const A* xhat, const A* rstd,
                                              const T* g, T* dx, const T* mask, int has_mask, T* dxm, int d,
                                              const long long* rowpos, int has_rows, unsigned long long key,
                                              int thresh, A scale, const T* xs, const A* mean, int from_mean) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * d;
    A rs = rstd[blockIdx.x], mu = from_mean ? mean[blockIdx.x] : (A)0;
    unsigned long long pos = has_mask == 2 ? (unsigned long long)(has_rows ? rowpos[blockIdx.x] : blockIdx.x) : 0ULL;
    A s1 = 0, s2 = 0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        A a = (A)dy[off + j], gj = (A)g[j], xh = xhat_at(from_mean, xhat, xs, mu, rs, off, j);   // every load before
        if (has_dy2) {                    // the store below (which the compiler could not move them past)
            T sum = (T)(a + (A)dy2[off + j]);
            dy[off + j] = sum;
            a = (A)sum;
        }
        A dxh = a * gj;
        s1 += dxh;
        s2 += dxh * xh;
    }
    A m1 = block_sum(s1, buf) / d;
    A m2 = block_sum(s2, buf) / d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        A dxh = (A)dy[off + j] * (A)g[j];
        T v = (T)(rs * (dxh - m1 - xhat_at(from_mean, xhat, xs, mu, rs, off, j) * m2));
        dx[off + j] = v;
        if (has_mask) dxm[off + j] = (T)((A)v * mask_at(has_mask, mask, off, pos, key, d, j, thresh, scale));
    }
}

// out = y * mask + x with mask = dropout_keep(...) (above); one thread per element.
extern "C" __global__ void dropout_add(const long long* rowpos, int has_rows, unsigned long long key, const T* y,
                                       const T* x, T* mask, T* out, long long n, int d, int thresh, A scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long r = i / d;
        int c = (int)(i - r * d);
        A m = dropout_keep(key, (unsigned long long)(has_rows ? rowpos[r] : r), d, c, thresh, scale);
        mask[i] = (T)m;
        out[i] = (T)((A)y[i] * m + (A)x[i]);
    }
}

// The sum of a post-norm block and its LayerNorm in one pass per row (paper 3.1):
// s = x + Dropout(y + yb) as dropout_add computes it (has_drop; else s = x + y + yb), yb the bias of
// the sublayer's last Linear (has_yb; y + yb rounded to the storage type first, as the separate add stores it),
// s rounded to the storage type and written into y (a sublayer output nothing else holds); then
// layernorm_forward of s: the same bits as the separate kernels one after the other. Kept for backward: s
// (in y), the rows' mean and rstd, not xhat (layernorm_backward computes it again) and not the mask (drawn
// again from its key).
extern "C" __global__ void residual_layernorm(const long long* rowpos, int has_rows, unsigned long long key,
                                              int has_drop, T* y, const T* yb, int has_yb, const T* x,
                                              int thresh, A scale, const T* g, const T* bvec, T* out, A* mean,
                                              A* rstd, int d, A eps) {
    __shared__ A buf[1024];
    long long r = blockIdx.x;
    long long off = r * d;
    unsigned long long pos = (unsigned long long)(has_rows ? rowpos[r] : r);
    A s = 0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        A m = has_drop ? dropout_keep(key, pos, d, j, thresh, scale) : (A)1;
        A yj = has_yb ? (A)(T)((A)y[off + j] + (A)yb[j]) : (A)y[off + j];
        T v = (T)(yj * m + (A)x[off + j]);
        y[off + j] = v;     // read back below by this same thread only
        s += (A)v;
    }
    layernorm_row(y, off, d, s, g, bvec, out, mean, 1, rstd, r, eps, buf);
}

// LayerNorm with a warp per row and 16-byte loads (kernels.ln_warp_ok: unless MINITF_FUSED_LNWARP=0, d whole
// vectors, 16-byte aligned rows and parameters): the block's warps take rows blockIdx.x * warps + warp, lane l the
// row's values l VEC .. l VEC + VEC - 1, then those 32 VEC further on, ...; the sums are warp shuffles (no shared
// memory, no block barrier). The formulas of the block kernels above; the sums run in another order (not
// their bits). Every warp runs the same shuffles, also past the last row (len = 0 there). Every load and store is
// 16 bytes a lane: the row, g and b as Vecs, xhat (the accumulation type) as VEC / AVEC AVecs; a row's first pass is
// unrolled twice (but residual_layernorm_warp's), so that a lane of a 512-wide float16 row (two Vecs) waits on
// memory once, not twice.
// xhat's VEC values of a lane at column j, into xh: read (from_mean 0) or computed again from the LayerNorm's input
// xs, its mean and rstd (from_mean 1), as xhat_at gives them.
__device__ inline void xhat_vec(A* xh, int from_mean, const A* xhat, const T* xs, A mean, A rs, long long at) {
    if (from_mean) {
        Vec v = *(const Vec*)(xs + at);
        for (int k = 0; k < VEC; k++) xh[k] = ((A)v.v[k] - mean) * rs;
    } else {
        for (int q = 0; q < VEC / AVEC; q++) {
            AVec w = *(const AVec*)(xhat + at + q * AVEC);
            for (int i = 0; i < AVEC; i++) xh[q * AVEC + i] = w.v[i];
        }
    }
}

// After the row's sum s (this lane's share): mean, rstd, xhat and y, as layernorm_row.
__device__ void layernorm_row_warp(const T* x, long long off, int len, int d, A s, const T* g, const T* bvec, T* y,
                                   A* keep, int keep_mean, A* rstd, long long row, A eps, int lane) {
    A mean = warp_sum(s) / d;
    A v = 0;
#pragma unroll 2
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec a = *(const Vec*)(x + off + j);
        for (int k = 0; k < VEC; k++) { A c = (A)a.v[k] - mean; v += c * c; }
    }
    A rs = (A)1 / a_sqrt(warp_sum(v) / d + eps);
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec a = *(const Vec*)(x + off + j), gv = *(const Vec*)(g + j), bv = *(const Vec*)(bvec + j);
        Vec o;
        A xh[VEC];
        for (int k = 0; k < VEC; k++) {
            xh[k] = ((A)a.v[k] - mean) * rs;
            o.v[k] = (T)(xh[k] * (A)gv.v[k] + (A)bv.v[k]);
        }
        *(Vec*)(y + off + j) = o;
        if (!keep_mean)
            for (int q = 0; q < VEC / AVEC; q++) {
                AVec w;
                for (int i = 0; i < AVEC; i++) w.v[i] = xh[q * AVEC + i];
                *(AVec*)(keep + off + j + q * AVEC) = w;
            }
    }
    if (lane == 0 && len > 0) {
        rstd[row] = rs;
        if (keep_mean) keep[row] = mean;
    }
}

extern "C" __global__ void layernorm_forward_warp(const T* x, const T* g, const T* bvec, T* y, A* xhat, A* rstd,
                                                  int d, A eps, long long rows) {
    int lane = threadIdx.x % 32;
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int len = r < rows ? d : 0;
    long long off = (r < rows ? r : 0) * d;
    A s = 0;
#pragma unroll 2
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec a = *(const Vec*)(x + off + j);
        for (int k = 0; k < VEC; k++) s += (A)a.v[k];
    }
    layernorm_row_warp(x, off, len, d, s, g, bvec, y, xhat, 0, rstd, r, eps, lane);
}

// residual_layernorm with a warp per row: the same sum (and bits) as dropout_add then layernorm_forward_warp.
extern "C" __global__ void residual_layernorm_warp(const long long* rowpos, int has_rows, unsigned long long key,
                                                   int has_drop, T* y, const T* yb, int has_yb, const T* x,
                                                   int thresh, A scale, const T* g, const T* bvec, T* out, A* mean,
                                                   A* rstd, int d, A eps, long long rows) {
    int lane = threadIdx.x % 32;
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int len = r < rows ? d : 0;
    long long rr = r < rows ? r : 0, off = rr * d;
    unsigned long long pos = (unsigned long long)(has_rows ? rowpos[rr] : rr);
    A s = 0;
    // not unrolled: unrolled twice, the dropout hashes of two Vecs took 94 registers in float16 (56 once)
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec yv = *(const Vec*)(y + off + j);
        Vec xv = *(const Vec*)(x + off + j);
        Vec bv;
        if (has_yb) bv = *(const Vec*)(yb + j);
        for (int k = 0; k < VEC; k++) {
            A m = has_drop ? dropout_keep(key, pos, d, j + k, thresh, scale) : (A)1;
            A yj = has_yb ? (A)(T)((A)yv.v[k] + (A)bv.v[k]) : (A)yv.v[k];
            yv.v[k] = (T)(yj * m + (A)xv.v[k]);
            s += (A)yv.v[k];
        }
        *(Vec*)(y + off + j) = yv;   // read back below by this same lane only
    }
    layernorm_row_warp(y, off, len, d, s, g, bvec, out, mean, 1, rstd, r, eps, lane);
}

// layernorm_backward with a warp per row (as above).
extern "C" __global__ void layernorm_backward_warp(T* dy, const T* dy2, int has_dy2, const A* xhat, const A* rstd,
                                                   const T* g, T* dx, const T* mask, int has_mask, T* dxm, int d,
                                                   const long long* rowpos, int has_rows, unsigned long long key,
                                                   int thresh, A scale, const T* xs, const A* mean, int from_mean,
                                                   long long rows) {
    int lane = threadIdx.x % 32;
    long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int len = r < rows ? d : 0;
    long long rr = r < rows ? r : 0, off = rr * d;
    A rs = rstd[rr], mu = from_mean ? mean[rr] : (A)0;
    unsigned long long pos = has_mask == 2 ? (unsigned long long)(has_rows ? rowpos[rr] : rr) : 0ULL;
    A s1 = 0, s2 = 0;
#pragma unroll 2
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec a = *(Vec*)(dy + off + j), gv = *(const Vec*)(g + j);
        if (has_dy2) {
            Vec b = *(const Vec*)(dy2 + off + j);
            for (int k = 0; k < VEC; k++) a.v[k] = (T)((A)a.v[k] + (A)b.v[k]);
            *(Vec*)(dy + off + j) = a;
        }
        A xh[VEC];
        xhat_vec(xh, from_mean, xhat, xs, mu, rs, off + j);
        for (int k = 0; k < VEC; k++) {
            A dxh = (A)a.v[k] * (A)gv.v[k];
            s1 += dxh;
            s2 += dxh * xh[k];
        }
    }
    A m1 = warp_sum(s1) / d;
    A m2 = warp_sum(s2) / d;
    for (int j = lane * VEC; j < len; j += 32 * VEC) {
        Vec a = *(const Vec*)(dy + off + j), gv = *(const Vec*)(g + j);
        Vec o, om;
        A xh[VEC];
        xhat_vec(xh, from_mean, xhat, xs, mu, rs, off + j);
        for (int k = 0; k < VEC; k++) {
            A dxh = (A)a.v[k] * (A)gv.v[k];
            o.v[k] = (T)(rs * (dxh - m1 - xh[k] * m2));
        }
        *(Vec*)(dx + off + j) = o;
        if (has_mask == 1) {
            Vec mk = *(const Vec*)(mask + off + j);
            for (int k = 0; k < VEC; k++) om.v[k] = (T)((A)o.v[k] * (A)mk.v[k]);
            *(Vec*)(dxm + off + j) = om;
        } else if (has_mask == 2) {
            for (int k = 0; k < VEC; k++) om.v[k] = (T)((A)o.v[k] * mask_at(2, mask, off, pos, key, d, j + k, thresh, scale));
            *(Vec*)(dxm + off + j) = om;
        }
    }
}
"""


def _launch_layernorm(name, dtype, rows, d, args, warp):
    """A LayerNorm kernel over `rows` rows of d: its *_warp form (a warp per row; the row count
    appended to the arguments) where `warp`, else a block per row."""
    if warp:
        _launch(name + "_warp", dtype, -(-rows // WARP_ROWS), 32 * WARP_ROWS, args + (np.int64(rows),))
    else:
        _launch(name, dtype, rows, block_size("layernorm", d), args)


def ln_warp_ok(d, *arrays):
    """Whether the LayerNorm kernels take a warp per row (layernorm_forward_warp, residual_layernorm_warp,
    layernorm_backward_warp): where the 16-byte loads apply (vec_ok: rows of d whole vectors; the rows, the
    parameters (views of the flat parameter buffer) and xhat 16-byte aligned), unless MINITF_FUSED_LNWARP=0
    (the block kernels: `base` steps 4-11% longer on an H200, docs/benchmarks.md)."""
    return not switched_off("MINITF_FUSED_LNWARP") and vec_ok(*arrays, width=d)


def layernorm_forward(x, g, b, eps):
    """Returns y (x's dtype) and the cache (xhat [..., D], rstd [..., 1]) in the accumulation dtype."""
    xp = backend.xp_of(x)
    x = xp.ascontiguousarray(x)
    a = accum_dtype(x.dtype)
    rows, d = _rows(x)
    y = xp.empty_like(x)
    xhat = xp.empty(x.shape, dtype=a)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=a)
    g, b = _as(g, x.dtype), _as(b, x.dtype)
    args = (x, g, b, y, xhat, rstd, np.int32(d), a(eps))
    _launch_layernorm("layernorm_forward", x.dtype, rows, d, args, ln_warp_ok(d, x, y, g, b, xhat))
    return y, (xhat, rstd)


class NormCache(NamedTuple):
    """A LayerNorm's cache without xhat (residual_layernorm's): its input x [..., D] in the storage dtype
    and each row's mean and rstd [..., 1] in the accumulation dtype; the backward kernels compute
    xhat = (x - mean) * rstd again, the forward's bits (a [..., D] array in the accumulation dtype less
    to keep, write and read)."""
    x: object
    mean: object
    rstd: object


def xhat_of(cache):
    """xhat [..., D] (accumulation dtype) of a LayerNorm cache: (xhat, rstd), or a NormCache's computed
    with array operations (the kernels' bits)."""
    if type(cache) is not NormCache:
        return cache[0]
    return (cache.x.astype(cache.mean.dtype) - cache.mean) * cache.rstd


class KeyedMask(NamedTuple):
    """A dropout mask kept as what draws it (residual_layernorm's and embed_rows'): layernorm_backward_input
    and embedding_backward draw it again in their own pass (the same bits) instead of reading a stored
    [rows, d] array.
    rowpos: the rows' positions in the padded batch (a device int64 array), or None (row r at r)."""
    key: int
    rowpos: object
    p: float


def keep_threshold(p):
    """Kept where the 16-bit uniform u >= round(p * 65536): p to 1/65536 (the kernels' masks and
    functional.dropout_mask's)."""
    return round(p * (1 << 16))


def _drawn_mask_args(xp, mask, a):
    """The kernel arguments that say how a backward reads a dropout mask (an array, a KeyedMask or None):
    (mode: 0 none, 1 read from the array, 2 drawn again from its key; rowpos, has_rows, key, thresh, scale),
    the last five placeholders unless the mask is keyed; a: the accumulation dtype."""
    keyed = type(mask) is KeyedMask
    rowpos = mask.rowpos if keyed else None
    return (np.int32(0 if mask is None else 2 if keyed else 1),
            _placeholder(xp, np.int64) if rowpos is None else xp.ascontiguousarray(rowpos, dtype=np.int64),
            np.int32(rowpos is not None), np.uint64(mask.key if keyed else 0),
            np.int32(keep_threshold(mask.p) if keyed else 0), a(1.0 / (1.0 - mask.p) if keyed else 1.0))


def layernorm_backward_input(dy, cache, g, dy2=None, mask=None):
    """dx for layernorm_forward or residual_layernorm (the parameter gradients are column sums, left to
    the caller); cache: the forward's, (xhat, rstd) or a NormCache. dy2: a second upstream gradient:
    dy + dy2 is used, and written into dy (which must then be the caller's own, C-contiguous). mask (an
    array shaped as dy, or a KeyedMask): returns (dx, dx * mask) instead of dx."""
    xp = backend.xp_of(dy)
    from_mean = type(cache) is NormCache
    xhat, rstd = (cache.rstd, cache.rstd) if from_mean else cache   # xhat: a placeholder where it is not read
    if dy2 is None:
        dy = xp.ascontiguousarray(dy)
    rows, d = _rows(dy)
    dx = xp.empty_like(dy)
    dxm = None if mask is None else xp.empty_like(dy)
    has_dy2 = dy2 is not None
    dy2 = xp.ascontiguousarray(dy2) if has_dy2 else dy
    keyed = type(mask) is KeyedMask
    mask_ = dy if mask is None or keyed else xp.ascontiguousarray(mask)   # placeholders where the kernel reads nothing
    dxm_ = dx if dxm is None else dxm
    mode, *drawn = _drawn_mask_args(xp, mask, accum_dtype(dy.dtype))
    g = _as(g, dy.dtype)
    args = (dy, dy2, np.int32(has_dy2), xhat, rstd, g, dx, mask_, mode, dxm_, np.int32(d), *drawn,
            cache.x if from_mean else dy, cache.mean if from_mean else rstd, np.int32(from_mean))
    warp = ln_warp_ok(d, dy, dy2, dx, mask_, dxm_, g, cache.x if from_mean else xhat)
    _launch_layernorm("layernorm_backward", dy.dtype, rows, d, args, warp)
    return dx if mask is None else (dx, dxm)


def dropout_add(key, rowpos, y, x, p):
    """(out, mask): out = y * mask + x, mask = (u >= round(p 2^16)) / (1 - p) with the 16-bit uniforms u of
    functional.hash_bits(key, rowpos) (rowpos: the rows' positions in the padded batch, or None).
    `out` is written into y (a sublayer output nothing else holds)."""
    xp = backend.xp_of(y)
    y, x = xp.ascontiguousarray(y), xp.ascontiguousarray(x)
    mask = xp.empty_like(y)
    n, threads = y.size, 256
    rows = xp.zeros(1, dtype=np.int64) if rowpos is None else xp.ascontiguousarray(rowpos, dtype=np.int64)
    _launch("dropout_add", y.dtype, (n + threads - 1) // threads, threads,
            (rows, np.int32(rowpos is not None), np.uint64(key), y, x, mask, y, np.int64(n), np.int32(y.shape[-1]),
             np.int32(keep_threshold(p)), accum_dtype(y.dtype)(1.0 / (1.0 - p))))
    return y, mask


def residual_layernorm(key, rowpos, y, x, p, g, b, eps, y_bias=None):
    """(out, mask, cache): out = LayerNorm(x + Dropout(y + y_bias)) of a post-norm block in one pass per
    row, the dropout as `dropout_add` draws it (key None: no dropout, mask None; y_bias None: no bias);
    the sum is written into y (a sublayer output nothing else holds). The cache is a NormCache (the sum
    y, each row's mean and rstd: no xhat), the mask a KeyedMask (no [rows, d] array is stored:
    layernorm_backward_input draws it again)."""
    xp = backend.xp_of(y)
    y, x = xp.ascontiguousarray(y), xp.ascontiguousarray(x)
    a = accum_dtype(y.dtype)
    rows, d = _rows(y)
    out = xp.empty_like(y)
    stats = xp.empty((2,) + y.shape[:-1] + (1,), dtype=a)      # one allocation for both
    mean, rstd = stats[0], stats[1]
    positions = _placeholder(xp, np.int64) if rowpos is None else xp.ascontiguousarray(rowpos, dtype=np.int64)
    yb, g, b = y if y_bias is None else _as(y_bias, y.dtype), _as(g, y.dtype), _as(b, y.dtype)
    args = (positions, np.int32(rowpos is not None), np.uint64(key or 0), np.int32(key is not None), y,
            yb, np.int32(y_bias is not None), x, np.int32(0 if key is None else keep_threshold(p)),
            a(1.0 if key is None else 1.0 / (1.0 - p)), g, b, out, mean, rstd, np.int32(d), a(eps))
    _launch_layernorm("residual_layernorm", y.dtype, rows, d, args, ln_warp_ok(d, y, x, out, yb, g, b))
    mask = None if key is None else KeyedMask(key, positions if rowpos is not None else None, p)
    return out, mask, NormCache(y, mean, rstd)


# ----------------------------------------------------------------------------- the loss
# The label-smoothed cross-entropy's terms per row of the logits, the batch's totals, and the gradient over
# the logits (paper 5.4).
LOSS = r"""
// Row blockIdx.x's terms from its max m, sum of exp(z - m) s and sum of z tot: lse, nll = lse - z[gold], smooth.
__device__ inline void nll_row_terms(const T* z, long long off, const long long* gold, A m, A s, A tot, int V,
                                     A* lse, A* nll, A* smooth) {
    A l = m + a_log(s);
    lse[blockIdx.x] = l;
    nll[blockIdx.x] = l - (A)z[off + gold[blockIdx.x]];
    smooth[blockIdx.x] = l - tot / V;
}

// Label-smoothed NLL, per row of logits z [rows, V_o] (the kernel's V columns) with gold[rows]:
// lse = max + log(sum exp(z - max)); nll = lse - z[gold]; smooth = lse - mean_v z.
// The loss of the row is (1 - eps) * nll + eps * smooth (loss.py).
extern "C" __global__ void smoothed_nll_rows(const T* z, const long long* gold, A* lse, A* nll, A* smooth, int V) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * V;
    A m = NEG_BIG, tot = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) { A zj = (A)z[off + j]; m = a_max(m, zj); tot += zj; }
    m = block_max(m, buf);
    tot = block_sum(tot, buf);
    A s = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += a_exp((A)z[off + j] - m);
    s = block_sum(s, buf);
    if (threadIdx.x == 0) nll_row_terms(z, off, gold, m, s, tot, V, lse, nll, smooth);
}

// One 16-byte vector a of a row into a thread's running max mt, its sum st of exp(z - mt), rescaled when mt grows
// (one exp a value either way; no positive exponent), and its sum tot of z. (The vector's max first, then its exps,
// would take fewer instructions, but ptxas then spilled the bfloat16 loss kernel's kept vectors.)
__device__ inline void online_add(const Vec& a, A& mt, A& st, A& tot) {
    for (int k = 0; k < VEC; k++) {
        A zj = (A)a.v[k];
        tot += zj;
        if (zj > mt) { st = st * a_exp2e(mt - zj) + (A)1; mt = zj; } else st += a_exp2e(zj - mt);
    }
}

// The vectors j0, j0 + blockDim.x, ... below nv of a row zr into a thread's running sums (online_add), in that
// order, two loads in flight.
__device__ inline void online_add_from(const Vec* zr, int j0, int nv, A& mt, A& st, A& tot) {
    for (int j = j0; j < nv; j += 2 * blockDim.x) {
        Vec a = zr[j], b;
        bool two = j + blockDim.x < nv;
        if (two) b = zr[j + blockDim.x];
        online_add(a, mt, st, tot);
        if (two) online_add(b, mt, st, tot);
    }
}

// A row's terms from each thread's running max mt, sum st and sum of z tot (online_add): the block's max m, then
// the sum of the threads' sums * exp(mt - m); thread 0 writes lse, nll and smooth. Returns lse to every thread.
__device__ inline A nll_row_reduce(const T* z, long long off, const long long* gold, A mt, A st, A tot, int V, A* buf,
                                   A* lse, A* nll, A* smooth) {
    A m = block_max(mt, buf);
    tot = block_sum(tot, buf);
    A s = block_sum(st * a_exp(mt - m), buf);
    if (threadIdx.x == 0) nll_row_terms(z, off, gold, m, s, tot, V, lse, nll, smooth);
    return m + a_log(s);
}

// smoothed_nll_rows with 16-byte loads (V a multiple of VEC): thread j takes values j VEC .. j VEC + VEC - 1,
// then the ones blockDim.x VEC further on (the sums' order differs from the one-value kernel's: not the same bits).
extern "C" __global__ void smoothed_nll_rows_vec(const T* z, const long long* gold, A* lse, A* nll, A* smooth,
                                                 int V) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * V;
    const Vec* zr = (const Vec*)(z + off);
    int nv = V / VEC;
    // One pass over the row: each thread's running max and sum (online_add), then the block's (nll_row_reduce).
    A mt = NEG_BIG, st = 0, tot = 0;
    online_add_from(zr, threadIdx.x, nv, mt, st, tot);
    nll_row_reduce(z, off, gold, mt, st, tot, V, buf, lse, nll, smooth);
}

// The batch's loss from its rows' terms: out[0] = scale * sum_r ((1 - eps) nll[r] + eps smooth[r]),
// out[1] = sum_r nll[r] (every row has a loss), out[2] = out[0] * count (the loss summed over the
// tokens, as training adds it up); one block, the same order every run.
extern "C" __global__ void loss_totals(const A* nll, const A* smooth, long long rows, A eps, A scale, A count,
                                       A* out) {
    __shared__ A buf[1024];
    A s = 0, t = 0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) {
        s += ((A)1 - eps) * nll[r] + eps * smooth[r];
        t += nll[r];
    }
    s = block_sum(s, buf);
    t = block_sum(t, buf);
    if (threadIdx.x == 0) {
        out[0] = s * scale;
        out[1] = t;
        out[2] = out[0] * count;
    }
}

// One value's gradient of the label-smoothed NLL: (exp(z - lse) - u - (1 - eps) [gold]) * wr, u = eps / V_o (the
// kernel's V columns).
__device__ inline A nll_grad(A zj, A l, A u, A eps, bool gold, A wr) {
    A d = a_exp2e(zj - l) - u;
    if (gold) d -= (A)1 - eps;
    return d * wr;
}

// Vector j of a row (its values a) made their gradients (nll_grad; gold at g of the row).
__device__ inline void nll_grad_vec(Vec& a, int j, long long g, A l, A u, A eps, A wr) {
    int gk = (int)(g - (long long)j * VEC);   // gold's place in the vector (k == gk; exact in an int: |gk| < V),
                                               // one compare a value where j VEC + k == g took a 64-bit one
    for (int k = 0; k < VEC; k++) a.v[k] = (T)nll_grad((A)a.v[k], l, u, eps, k == gk, wr);
}

// dz = (exp(z - lse) - eps / V_o - (1 - eps) [j == gold]) * w per row (V_o: the kernel's V columns; has_w; else
// w = 1) * wscale (* dscale[0], the loss scale kept on the device, when has_dscale); dz may alias z.
extern "C" __global__ void smoothed_nll_backward(const T* z, const long long* gold, const A* lse, const A* w,
                                                 int has_w, A wscale, const A* dscale, int has_dscale, T* dz, int V,
                                                 A eps) {
    long long off = (long long)blockIdx.x * V;
    A l = lse[blockIdx.x], wr = (has_w ? w[blockIdx.x] : (A)1) * wscale * (has_dscale ? dscale[0] : (A)1), u = eps / V;
    long long g = gold[blockIdx.x];
    for (int j = threadIdx.x; j < V; j += blockDim.x) dz[off + j] = (T)nll_grad((A)z[off + j], l, u, eps, j == g, wr);
}

// The same with 16-byte loads and stores (V a multiple of VEC): the same arithmetic on each value (the same bits).
extern "C" __global__ void smoothed_nll_backward_vec(const T* z, const long long* gold, const A* lse, const A* w,
                                                     int has_w, A wscale, const A* dscale, int has_dscale, T* dz,
                                                     int V, A eps) {
    long long off = (long long)blockIdx.x * V;
    A l = lse[blockIdx.x], wr = (has_w ? w[blockIdx.x] : (A)1) * wscale * (has_dscale ? dscale[0] : (A)1), u = eps / V;
    long long g = gold[blockIdx.x];
    int nv = V / VEC;
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        Vec a = ((const Vec*)(z + off))[j];
        nll_grad_vec(a, j, g, l, u, eps, wr);
        ((Vec*)(dz + off))[j] = a;
    }
}

// smoothed_nll_rows_vec and smoothed_nll_backward_vec (every row weighing wscale, * dscale[0] when has_dscale) in one
// launch: the loss's forward and backward, each row read once up to NLL_KEEP * blockDim.x vectors. The first
// NLL_KEEP vectors a thread reads stay in its registers for the gradient; a row longer than NLL_KEEP * blockDim.x
// vectors reads the rest a second time.
// The same sums in the same order as smoothed_nll_rows_vec and the same arithmetic per value as
// smoothed_nll_backward_vec: the bits of the two launches. dz may alias z.
// Held to 64 registers a thread (__launch_bounds__(512, NLL_BLOCKS): two blocks of 512 threads a multiprocessor; 71
// on sm_80 in 16 bits without it, one block). float64 (tests only) keeps one block.
#define NLL_KEEP 10
extern "C" __global__ void __launch_bounds__(512, NLL_BLOCKS)
smoothed_nll_rows_grad_vec(const T* z, const long long* gold, A* lse, A* nll, A* smooth, int V, A wscale,
                           const A* dscale, int has_dscale, T* dz, A eps) {
    __shared__ A buf[1024];
    long long off = (long long)blockIdx.x * V;
    const Vec* zr = (const Vec*)(z + off);
    Vec* dr = (Vec*)(dz + off);
    int nv = V / VEC;
    A mt = NEG_BIG, st = 0, tot = 0;
    Vec keep[NLL_KEEP];
    // Every load first, then the sums: the thread's NLL_KEEP loads in flight at once. (Loaded and summed in one loop,
    // each load waited for the sums of the vector before it: one load in flight a warp, and the pass waited on
    // memory's latency NLL_KEEP times a row; ptxas for sm_90.)
#ifndef MINITF_BF16
#pragma unroll
    for (int i = 0; i < NLL_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < nv) keep[i] = zr[j];
    }
#pragma unroll
    for (int i = 0; i < NLL_KEEP; i++)
        if (threadIdx.x + i * blockDim.x < nv) online_add(keep[i], mt, st, tot);
#else   // bfloat16: loaded and summed in one loop (loaded first, ptxas widened them early and spilled at 64 registers)
#pragma unroll
    for (int i = 0; i < NLL_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
            keep[i] = zr[j];
            online_add(keep[i], mt, st, tot);
        }
    }
#endif
    online_add_from(zr, threadIdx.x + NLL_KEEP * blockDim.x, nv, mt, st, tot);   // a longer row's rest
    A l = nll_row_reduce(z, off, gold, mt, st, tot, V, buf, lse, nll, smooth);
    __syncthreads();   // z[gold] is read before any thread writes over the row
    A wr = wscale * (has_dscale ? dscale[0] : (A)1), u = eps / V;
    long long g = gold[blockIdx.x];
#pragma unroll
    for (int i = 0; i < NLL_KEEP; i++) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
            Vec a = keep[i];
            nll_grad_vec(a, j, g, l, u, eps, wr);
            dr[j] = a;
        }
    }
    for (int j = threadIdx.x + NLL_KEEP * blockDim.x; j < nv; j += 2 * blockDim.x) {   // two loads in flight
        Vec a = zr[j], b;
        bool two = j + blockDim.x < nv;
        if (two) b = zr[j + blockDim.x];
        nll_grad_vec(a, j, g, l, u, eps, wr);
        dr[j] = a;
        if (two) {
            nll_grad_vec(b, j + blockDim.x, g, l, u, eps, wr);
            dr[j + blockDim.x] = b;
        }
    }
}
"""


def smoothed_nll_rows(logits, gold, grad=None):
    """logits [rows, V_o], gold [rows] -> (lse, nll, smooth), each [rows] in the accumulation dtype.

    grad (w_scale, dscale, eps): also write the loss's gradient over the logits, as
    smoothed_nll_backward(logits, gold, lse, None, eps, out=logits, w_scale=w_scale, dscale=dscale)
    would: in the same launch where the 16-byte loads apply (smoothed_nll_rows_grad_vec: each row read once where it is at
    most NLL_KEEP vectors a thread, 10 x 512, the rest of a longer row read twice), else in a second one.
    The logits must then be C-contiguous (ValueError otherwise: the gradient is written over them)."""
    xp = backend.xp_of(logits)
    if grad is not None and not logits.flags.c_contiguous:
        raise ValueError("smoothed_nll_rows with grad writes over the logits: they must be C-contiguous")
    logits = xp.ascontiguousarray(logits)
    a = accum_dtype(logits.dtype)
    rows, v = _rows(logits)
    lse, nll, smooth = (xp.empty(rows, dtype=a) for _ in range(3))
    gold = xp.ascontiguousarray(gold, dtype=np.int64)
    vec = vec_ok(logits, width=v)
    if grad is not None and vec:
        w_scale, dscale, eps = grad
        _launch("smoothed_nll_rows_grad_vec", logits.dtype, rows, block_size("nll", v),
                (logits, gold, lse, nll, smooth, np.int32(v), a(w_scale), lse if dscale is None else dscale,
                 np.int32(dscale is not None), logits, a(eps)))
        return lse, nll, smooth
    _launch("smoothed_nll_rows_vec" if vec else "smoothed_nll_rows", logits.dtype, rows, block_size("nll", v),
            (logits, gold, lse, nll, smooth, np.int32(v)))
    if grad is not None:
        w_scale, dscale, eps = grad
        smoothed_nll_backward(logits, gold, lse, None, eps, out=logits, w_scale=w_scale, dscale=dscale)
    return lse, nll, smooth


def smoothed_nll_backward(logits, gold, lse, w, eps, out=None, w_scale=1.0, dscale=None):
    """dlogits [rows, V_o] = (softmax - q) * w[:, None] * w_scale (w None: every row weighs w_scale),
    times dscale[0] when given (a 1-element device array: the loss scale kept on the device);
    `out` may be logits (in place)."""
    xp = backend.xp_of(logits)
    a = accum_dtype(logits.dtype)
    out = xp.empty_like(logits) if out is None else out
    rows, v = _rows(logits)
    name = "smoothed_nll_backward_vec" if vec_ok(logits, out, width=v) else "smoothed_nll_backward"
    _launch(name, logits.dtype, rows, block_size("nll", v),
            (logits, xp.ascontiguousarray(gold, dtype=np.int64), lse,
             lse if w is None else xp.ascontiguousarray(w, dtype=a), np.int32(w is not None), a(w_scale),
             lse if dscale is None else dscale, np.int32(dscale is not None), out, np.int32(v), a(eps)))
    return out


def loss_totals(nll, smooth, eps, scale, dtype, count=1.0):
    """[3] in the accumulation dtype: the loss, `scale` (1/N) * sum((1 - eps) * nll + eps * smooth), sum(nll)
    over rows that all have a loss (smoothed_nll_rows' outputs for logits of `dtype`), and the loss
    times count (the token count: the loss's sum, which training adds up), in one launch."""
    xp = backend.xp_of(nll)
    a = accum_dtype(dtype)
    out = xp.empty(3, dtype=a)
    _launch("loss_totals", dtype, 1, BLOCK["nll"], (nll, smooth, np.int64(nll.size), a(eps), a(scale), a(count), out))
    return out


# ----------------------------------------------------------------------------- gradient sums
# The bias and LayerNorm parameter gradients: column sums over slabs of rows, added in one fixed order (the
# same bits on every run), into the gradient buffers by one launch.
SUMS = r"""
// Column sums of x [n, d], or of x * y (has_y), pass 1 of 2. Block b sums the 32 columns from
// c0 = (b % chunks) * 32 over one slab of rows [slab * rows_per_slab, +rows_per_slab), slab = b / chunks:
// its threads are groups of 32 (a warp reads 32 neighbouring values of a row), group g taking the
// slab's rows g, g + groups, ...; the groups' sums are added in order into partial[slab * d + c].
extern "C" __global__ void column_partial_sums(const T* x, const A* y, int has_y, A* partial, long long n, int d,
                                               long long rows_per_slab) {
    __shared__ A buf[1024];
    int chunks = (d + 31) / 32;
    int lane = threadIdx.x % 32, group = threadIdx.x / 32, groups = blockDim.x / 32;
    int c = (blockIdx.x % chunks) * 32 + lane;
    long long slab = blockIdx.x / chunks;
    long long r0 = slab * rows_per_slab;
    long long r1 = r0 + rows_per_slab < n ? r0 + rows_per_slab : n;
    A s = 0;
    if (c < d) {
        for (long long r = r0 + group; r < r1; r += groups) {
            long long i = r * d + c;
            s += has_y ? (A)x[i] * y[i] : (A)x[i];
        }
    }
    buf[threadIdx.x] = s;
    __syncthreads();
    if (group == 0 && c < d) {
        A t = 0;
        for (int k = 0; k < groups; k++) t += buf[k * 32 + lane];
        partial[slab * d + c] = t;
    }
}

// The sum over the slabs of partial[k * w + col], in the one order every column-sum kernel uses (so their
// bits agree): SLAB_RUNS interleaved runs (run g adds slabs g, g + SLAB_RUNS, g + 2 SLAB_RUNS, ... in turn),
// then the run totals in run order. Run g's sum alone:
#define SUM_ROWS 4         // column_slab_sums: the rows whose loads a thread issues before it adds them, one part,
#define SUM_ROWS_PARTS 2   // and several (ptxas fits them in SUMS_BLOCKS' registers, 32 on sm_90, 40 on sm_80 and
                           // in float64, without a spill in every dtype; other counts spilled on sm_90 in some)
#define SLAB_RUNS 8   // = COLUMN_BLOCK / 32: column_sums_into's groups of a block each add one run
__device__ inline A slab_run(const A* partial, long long w, long long col, long long slabs, int g) {
    A t = 0;   // __ldcg: read at L2, where the other blocks' partials are (not a stale L1 line)
    for (long long k = g; k < slabs; k += SLAB_RUNS) t += __ldcg(partial + k * w + col);
    return t;
}

// Pass 2: out[c] = the sum of partial[slab * d + c] over the slabs, in that order; a thread per column.
extern "C" __global__ void column_sums_finish(const A* partial, A* out, int slabs, int d) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < d) {
        A t = 0;
        for (int g = 0; g < SLAB_RUNS; g++) t += slab_run(partial, d, c, slabs, g);
        out[c] = t;
    }
}

// column_slab_sums' sums of `parts` planes of x (plane values apart; one part: x itself), no factor: R rows' loads
// issued, then their adds in row order.
template <int R>
__device__ inline void plane_sums(const T* x, int parts, long long plane, long long r0, long long r1, int groups,
                                  int group, int c, long long d, A& s0, A& s1, A& s2) {
    long long step = groups * d;                    // a thread's rows lie groups apart
    const T* p = x + (r0 + group) * d + c;
    for (int left = (int)(r1 - r0) - group; left > 0; left -= R * groups, p += R * step) {   // rows from p on
        T v0[R], v1[R], v2[R];
#pragma unroll
        for (int u = 0; u < R; u++)
            if (u * groups < left) {
                v0[u] = p[u * step];
                if (parts > 1) v1[u] = p[plane + u * step];
                if (parts > 2) v2[u] = p[2 * plane + u * step];
            }
#pragma unroll
        for (int u = 0; u < R; u++)
            if (u * groups < left) {
                s0 += (A)v0[u];
                if (parts > 1) s1 += (A)v1[u];
                if (parts > 2) s2 += (A)v2[u];
            }
    }
}

// The column sums of x [n, d] ADDED into gradient buffers of the storage dtype, in ONE launch:
// parts = 1: out1 += the sums of x; parts = 2: out1 += the sums of x * y and out2 += the sums of x (a
// LayerNorm's weight and bias gradients); parts = 3: also out3 += the sums of x3 (the bias of the sublayer
// before it). Each block sums its slab of rows for one chunk of 32 columns as column_partial_sums does, every
// part in the same pass over the rows (column_slab_sums: a row's values of each part loaded together, each
// part's sum in a register of its own, added in row order as a pass per part would add them: the same bits),
// and writes partial[slab * w + c] (w = parts * d: the x * y sums, then the x sums, then the x3 sums); the last block of a chunk to finish (a ticket from that chunk's atomic counter, after a
// memory fence) adds the chunk's slabs in the order above, its 8 groups of 32 threads a run each, so the
// result is the same on every run and the adding is spread over as many blocks as there are chunks;
// it sets the counter back to 0 for the next launch.
// from_mean: y is xhat computed again from a LayerNorm's input ys, mean and rstd (xhat_at), not read.
// column_sums_relu_into (the same body with relu = 1; parts = 1): ReLU's backward first, x = 0 where the ReLU's
// output ys is not > 0 (relu_backward's rule), written back in place, and those values summed (a feed-forward's
// first bias gradient); a kernel of its own, so that column_sums_into is compiled without the ReLU branch.
// plane > 0: part p sums x + p * plane instead (no y) into out1 + p * out_stride (the biases of stacked projections,
// [parts, n, d] gradients into buffers evenly spaced), the same sums as a launch per part. At most 3 parts.
// Why one pass: a thread's sum is a chain of loads, so the pass waits on memory; three passes (a LayerNorm's
// x * xhat, x and the sublayer's x3) waited three times as long and read x twice.
__device__ inline void column_slab_sums(T* x, const A* y, int parts, const T* x3, long long r0, long long r1,
                                        int groups, int group, int c, long long d, int from_mean, const T* ys,
                                        const A* mean, const A* rstd, long long plane, int relu, A* s) {
    A s0 = 0, s1 = 0, s2 = 0;
    // Each loop loads several rows (SUM_ROWS of one part, SUM_ROWS_PARTS of several), then adds them in row order:
    // the same sums as a row at a time, with that many rows' loads in flight. A loop that loaded a row and added it
    // had one in flight (ptxas for sm_90 puts the add before the next row's load) and waited out memory's latency
    // once a row: at 64 bytes a warp (a float16 column per lane), far too little to keep up with memory.
    if (relu) {            // dy = dy * (y > 0) in place, then its sum (each element this block's alone)
        for (long long r = r0 + group; r < r1; r += groups) {
            long long i = r * d + c;
            T v = x[i];   // loaded with ys[i], not after the test (a second wait on memory a row)
            if (!((A)ys[i] > (A)0)) x[i] = v = (T)(A)0;
            s0 += (A)v;
        }
    } else if (plane || parts == 1) {    // the planes x + p * plane (one part: x), no factor
        if (parts == 1) plane_sums<SUM_ROWS>(x, 1, plane, r0, r1, groups, group, c, d, s0, s1, s2);
        else plane_sums<SUM_ROWS_PARTS>(x, parts, plane, r0, r1, groups, group, c, d, s0, s1, s2);
    } else if (!from_mean) {
        for (long long r = r0 + group; r < r1; r += SUM_ROWS_PARTS * groups) {
            T v[SUM_ROWS_PARTS], v3[SUM_ROWS_PARTS];
            A w[SUM_ROWS_PARTS];
#pragma unroll
            for (int u = 0; u < SUM_ROWS_PARTS; u++)
                if (r + u * groups < r1) {
                    long long i = (r + u * groups) * d + c;
                    v[u] = x[i];
                    w[u] = y[i];
                    if (parts > 2) v3[u] = x3[i];
                }
#pragma unroll
            for (int u = 0; u < SUM_ROWS_PARTS; u++)
                if (r + u * groups < r1) {
                    A a = (A)v[u];
                    s0 += a * w[u];
                    s1 += a;
                    if (parts > 2) s2 += (A)v3[u];
                }
        }
    } else {               // y is xhat_at(1, ...): (ys - mean) rstd, computed again
        for (long long r = r0 + group; r < r1; r += SUM_ROWS_PARTS * groups) {
            T v[SUM_ROWS_PARTS], v3[SUM_ROWS_PARTS], xs[SUM_ROWS_PARTS];
            A mu[SUM_ROWS_PARTS], rs[SUM_ROWS_PARTS];
#pragma unroll
            for (int u = 0; u < SUM_ROWS_PARTS; u++)
                if (r + u * groups < r1) {
                    long long ru = r + u * groups, i = ru * d + c;
                    v[u] = x[i];
                    xs[u] = ys[i];
                    mu[u] = mean[ru];
                    rs[u] = rstd[ru];
                    if (parts > 2) v3[u] = x3[i];
                }
#pragma unroll
            for (int u = 0; u < SUM_ROWS_PARTS; u++)
                if (r + u * groups < r1) {
                    A a = (A)v[u];
                    s0 += a * (((A)xs[u] - mu[u]) * rs[u]);
                    s1 += a;
                    if (parts > 2) s2 += (A)v3[u];
                }
        }
    }
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
}

__device__ inline void column_sums_body(T* x, const A* y, int parts, T* x3, A* partial, unsigned int* counter,
                                        T* out1, T* out2, T* out3, long long n, int d, long long rows_per_slab,
                                        const T* ys, const A* mean, const A* rstd, int from_mean, long long plane,
                                        long long out_stride, int relu) {
    __shared__ A buf[1024];
    __shared__ int last;
    int chunks = (d + 31) / 32, w = parts * d;
    int lane = threadIdx.x % 32, group = threadIdx.x / 32, groups = blockDim.x / 32;
    int chunk = blockIdx.x % chunks;
    int c = chunk * 32 + lane;
    long long slab = blockIdx.x / chunks, slabs = gridDim.x / chunks;
    long long r0 = slab * rows_per_slab;
    long long r1 = r0 + rows_per_slab < n ? r0 + rows_per_slab : n;
    A s[3] = {0, 0, 0};   // parts 2, 3: the x * y sums, the x sums (, the x3 sums); planes: plane p's sums
    if (c < d) column_slab_sums(x, y, parts, x3, r0, r1, groups, group, c, d, from_mean, ys, mean, rstd, plane, relu, s);
    for (int part = 0; part < parts; part++) {
        buf[threadIdx.x] = part == 0 ? s[0] : part == 1 ? s[1] : s[2];
        __syncthreads();
        if (group == 0 && c < d) {
            A t = 0;
            for (int k = 0; k < groups; k++) t += buf[k * 32 + lane];
            partial[slab * w + part * d + c] = t;
        }
        __syncthreads();
    }
    // The loop's last barrier ordered the block's partials before thread 0's fence, which makes them visible before its
    // ticket (cooperative groups' grid sync: a barrier, then one thread's fence and atomic); the thread that draws the
    // last ticket fences again before the barrier that tells the block, and the partials are read at L2 (__ldcg)
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter + chunk, 1u) == (unsigned int)slabs - 1u;
        if (last) __threadfence();
    }
    __syncthreads();
    if (last) {                                    // every slab of this chunk is written
        for (int part = 0; part < parts; part++) {
            buf[threadIdx.x] = c < d ? slab_run(partial, w, part * d + c, slabs, group) : (A)0;   // group = run
            __syncthreads();
            if (group == 0 && c < d) {
                A t = 0;
                for (int g = 0; g < SLAB_RUNS; g++) t += buf[g * 32 + lane];
                T* out = plane ? out1 + part * out_stride : part == 0 ? out1 : part == 1 ? out2 : out3;
                out[c] = (T)((A)out[c] + t);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) counter[chunk] = 0u;
    }
}

// On sm_90 both kernels are held to 32 registers a thread (__launch_bounds__: blocks of 256 threads, SUMS_BLOCKS = 8
// of them on a multiprocessor): COLUMN_BLOCKS' ~1,024 blocks then fit an H100 at once. At the 34 registers ptxas
// takes otherwise in 16 bits only 6 blocks fit (registers are given out 8 at a time), and the last quarter of the
// grid runs as a second wave after the first, each block's row loop waiting on memory just as long. On sm_80 to
// sm_89 SUMS_BLOCKS is 6 (40 registers): at 32, sm_80's float32 and bfloat16 code and float64's (tests only) would
// spill; 6 also on the GPUs after sm_90 other than sm_100 and sm_103 (sm_101/sm_110 and sm_120 hold 1,536 threads
// a multiprocessor), and 4 before sm_80 (sm_75 holds 1,024).
extern "C" __global__ void __launch_bounds__(256, SUMS_BLOCKS)
column_sums_into(T* x, const A* y, int parts, T* x3, A* partial, unsigned int* counter, T* out1, T* out2, T* out3,
                 long long n, int d, long long rows_per_slab, const T* ys, const A* mean, const A* rstd, int from_mean,
                 long long plane, long long out_stride) {
    column_sums_body(x, y, parts, x3, partial, counter, out1, out2, out3, n, d, rows_per_slab, ys, mean, rstd,
                     from_mean, plane, out_stride, 0);
}

extern "C" __global__ void __launch_bounds__(256, SUMS_BLOCKS)
column_sums_relu_into(T* x, const A* y, int parts, T* x3, A* partial, unsigned int* counter, T* out1, T* out2, T* out3,
                      long long n, int d, long long rows_per_slab, const T* ys, const A* mean, const A* rstd,
                      int from_mean, long long plane, long long out_stride) {
    column_sums_body(x, y, parts, x3, partial, counter, out1, out2, out3, n, d, rows_per_slab, ys, mean, rstd,
                     from_mean, plane, out_stride, 1);
}

// A weight gradient's split-K parts added into it (gemm.accumulate_at_b, MINITF_SPLITK=1): for plane p < planes and
// element j = r * cols + c < m of an [m / cols, cols] output, out[out_off + p * out_stride + j] += the parts
// part[(p * parts + k) * m + j] for k < parts (each the product over one run of rows, written by a strided-batched
// GEMM), then the rows the runs left over: sum over k < rem of x[x_off + p * x_stride + k * ldx + r] *
// dy[dy_off + p * dy_stride + k * ldy + c] (x^T dy over those rows). Added in that order in A, rounded once.
extern "C" __global__ void add_partials(const A* part, T* out, const T* x, const T* dy, long long m, long long cols,
                                        long long parts, long long planes, long long out_off, long long out_stride,
                                        long long x_off, long long x_stride, long long ldx, long long dy_off,
                                        long long dy_stride, long long ldy, long long rem) {
    long long total = planes * m;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long p = i / m, j = i - p * m, r = j / cols, c = j - r * cols;
        T* o = out + out_off + p * out_stride + j;
        A acc = (A)*o;
        const A* q = part + p * parts * m + j;
        for (long long k = 0; k < parts; k++) acc += q[k * m];
        const T* xr = x + x_off + p * x_stride + r;
        const T* dr = dy + dy_off + p * dy_stride + c;
        for (long long k = 0; k < rem; k++) acc += (A)xr[k * ldx] * (A)dr[k * ldy];
        *o = (T)acc;
    }
}
"""


def sums_into(x, out):
    """Whether the column sums of x go into the gradient buffer `out` inside a kernel (column_sums(x, out=),
    relu_backward_sums): the 'grads' fusion, `out` of x's dtype and C-contiguous."""
    return fused(x, "grads") and out.dtype == x.dtype and out.flags.c_contiguous


def _slabs(n, d):
    """(slabs, rows per slab) of the column sums over n rows of d columns."""
    chunks = (d + 31) // 32
    slabs = max(1, min(COLUMN_BLOCKS // max(chunks, 1), -(-n // COLUMN_MIN_ROWS)))
    rows_per_slab = max(1, -(-n // slabs))
    return max(1, -(-n // rows_per_slab)), rows_per_slab


def column_sums(x, y=None, out=None):
    """x [..., d] (d: the width summed for, D, F, H*K or V_o) summed over every axis but the last (of
    x * y, y [..., d] in the accumulation dtype, when given) -> [d] in the accumulation dtype: the
    bias and LayerNorm parameter gradients. Two launches: partial sums over slabs of rows, then the
    slabs added in order, so the result is the same on every run. `out` ([d], x's dtype, C-contiguous; without y:
    column_sums_pair adds x * y sums): the sums of x are ADDED into it (a gradient buffer: no separate add) by ONE launch (column_sums_into: the last
    block of each 32-column chunk adds that chunk's slabs, in the same order as the second pass) and it
    is returned."""
    xp = backend.xp_of(x)
    x = xp.ascontiguousarray(x)
    a = accum_dtype(x.dtype)
    n, d = _rows(x)
    if n == 0:
        return xp.zeros(d, dtype=a) if out is None else out
    if out is not None and y is not None:
        raise ValueError("column_sums(out=) adds the sums of x only: column_sums_pair adds those of x * y")
    if out is not None:                # one plane: column_sums_into's single launch
        column_sums_planes(x.reshape(1, n, d), out, 0)
        return out
    chunks = (d + 31) // 32
    slabs, rows_per_slab = _slabs(n, d)
    partial = _partials(xp, a, slabs * d).reshape(slabs, d)    # every entry written by pass 1
    yy = partial if y is None else xp.ascontiguousarray(y, dtype=a)
    _launch("column_partial_sums", x.dtype, chunks * slabs, COLUMN_BLOCK,
            (x, yy, np.int32(y is not None), partial, np.int64(n), np.int32(d), np.int64(rows_per_slab)))
    out = xp.empty(d, dtype=a)
    _launch("column_sums_finish", x.dtype, -(-d // COLUMN_BLOCK), COLUMN_BLOCK, (partial, out, np.int32(slabs),
                                                                               np.int32(d)))
    return out


def _sums_into(kernel, x, n, d, parts, outs, y=None, x3=None, ys=None, mean=None, rstd=None, from_mean=0, plane=0,
               out_stride=0):
    """ONE launch of column_sums_into (or column_sums_relu_into) over the n rows of d of x: `parts` sums, added into
    outs (out1, out2, out3 of the kernel's comment; missing ones repeat the last), y the x * y factor, x3 the third
    part's rows, ys, mean, rstd and from_mean the LayerNorm's cache for xhat (or, for column_sums_relu_into, ys the
    ReLU's output), plane > 0 the stride of x's planes (their sums out_stride apart). What a call does not use is
    given as a placeholder the kernel does not read. The slab partials and ticket counters are the kept buffers."""
    if not 1 <= parts <= 3:
        raise ValueError(f"column sums in one launch: 1 to 3 parts (got {parts})")
    xp = backend.xp_of(x)
    chunks = (d + 31) // 32
    slabs, rows_per_slab = _slabs(n, d)
    partial = _partials(xp, accum_dtype(x.dtype), slabs * parts * d)     # every entry the launch reads it writes
    out1, out2, out3 = (tuple(outs) + (outs[-1],) * 2)[:3]
    _launch(kernel, x.dtype, chunks * slabs, COLUMN_BLOCK,
            (x, partial if y is None else y, np.int32(parts), x if x3 is None else x3, partial, _counter(xp, chunks),
             out1, out2, out3, np.int64(n), np.int32(d), np.int64(rows_per_slab), x if ys is None else ys,
             partial if mean is None else mean, partial if rstd is None else rstd, np.int32(from_mean),
             np.int64(plane), np.int64(out_stride)))


def column_sums_pair(x, y, out_xy, out_x, x3=None, out_x3=None):
    """out_xy += sum over rows of x * y, out_x += sum over rows of x (x [..., D] storage dtype, y
    [..., D] accumulation dtype, or a NormCache standing for its xhat; outs [D] in x's dtype), and with x3
    (x's shape and dtype) out_x3 += the sums of x3: a LayerNorm's two parameter gradients (and the bias
    gradient of the sublayer before it) in one launch, the same sums (and bits) as separate column_sums calls."""
    xp = backend.xp_of(x)
    x = xp.ascontiguousarray(x)
    n, d = _rows(x)
    if n == 0:
        return
    outs = (out_xy, out_x) if x3 is None else (out_xy, out_x, out_x3)
    x3 = None if x3 is None else xp.ascontiguousarray(x3)
    if type(y) is NormCache:
        ys, mean, rstd = y
        _sums_into("column_sums_into", x, n, d, len(outs), outs, x3=x3, ys=ys, mean=mean, rstd=rstd, from_mean=1)
    else:
        _sums_into("column_sums_into", x, n, d, len(outs), outs, y=xp.ascontiguousarray(y, dtype=accum_dtype(x.dtype)),
                   x3=x3)


def relu_backward_sums(dy, y, out):
    """dy = dy where y > 0, else 0, in place (relu_backward: y the ReLU's output), and out += the column sums of
    that dy (out [F], dy's dtype: the bias gradient of the Linear before the ReLU), in ONE launch: the same values
    and bits as relu_backward(dy, y) then column_sums(dy, out=out), one pass over dy fewer (column_sums_relu_into:
    column_sums_into's code with ReLU's rule first). dy, y [..., F] C-contiguous. Returns dy."""
    n, d = _rows(dy)
    if n > 0:
        _sums_into("column_sums_relu_into", dy, n, d, 1, (out,), ys=y)
    return dy


def column_sums_planes(x, out, out_stride):
    """out + p * out_stride += the sums over the rows of x[p], for every plane p of x [parts, rows, d]
    (C-contiguous): `out` [d] is the first plane's gradient (x's dtype) and the others lie `out_stride`
    elements after one another in the same buffer (the biases of stacked projections). ONE launch of
    column_sums_into, the same sums (and bits) as a column_sums(x[p], out=) call each."""
    x = backend.xp_of(x).ascontiguousarray(x)
    parts, n, d = x.shape
    if n > 0:
        _sums_into("column_sums_into", x, n, d, parts, (out,), plane=n * d, out_stride=out_stride)


def add_partials(part, parts, out, out_off, out_stride, planes, m, cols, x, x_off, x_stride, ldx, dy, dy_off,
                 dy_stride, ldy, rem):
    """The split-K parts of `planes` weight gradients added into them (gemm.accumulate_at_b), one launch: plane p's
    [m / cols, cols] gradient at out_off + p * out_stride elements into `out` gets the `parts` products in `part`
    (the accumulation dtype, [planes * parts, m]), then x^T dy over the `rem` rows the parts left over (x's from
    x_off + p * x_stride, dy's from dy_off + p * dy_stride, leading dimensions ldx and ldy)."""
    total = planes * m
    i64 = np.int64
    _launch("add_partials", out.dtype, -(-total // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
            (part, out, x, dy, i64(m), i64(cols), i64(parts), i64(planes), i64(out_off), i64(out_stride), i64(x_off),
             i64(x_stride), i64(ldx), i64(dy_off), i64(dy_stride), i64(ldy), i64(rem)))


_PARTIALS = {}   # (array module, dtype name, use) -> partial sums, one buffer for every call of a use


def _partials(xp, dtype, n, use="sums"):
    """A buffer of at least n values for the column sums' slab partials (use "sums"), or for the split-K parts of a
    weight gradient (use "split", gemm.accumulate_at_b), kept between calls (no allocation per call: one a gradient
    sum, 66 launches in a `base` step). One buffer is safe because the kernels run in the order they are launched, on
    one stream: a launch writes its partials only after the one before has read its own."""
    key = (id(xp), dtype_name(dtype), use)
    held = _PARTIALS.get(key)
    if held is None or held[1].size < n:
        held = _PARTIALS[key] = (xp, xp.empty(max(n, 2 * (0 if held is None else held[1].size)), dtype=dtype))
    return held[1][:n]


_COUNTERS = {}   # array module -> the uint32 ticket counters of column_sums_into, one a chunk (0 between launches)


def _counter(xp, chunks=1):
    """At least `chunks` ticket counters for column_sums_into (zeros; each launch leaves them at 0)."""
    held = _COUNTERS.get(id(xp))
    if held is None or held[1].size < chunks:
        held = _COUNTERS[id(xp)] = (xp, xp.zeros(max(chunks, 64), dtype=np.uint32))
    return held[1]


# ----------------------------------------------------------------------------- heads and ReLU
# The head layout's passes (a projection's rows into [B, H, L, K] with its bias, and back) and the
# feed-forward's bias + ReLU and ReLU's backward in place: a thread a value, or 16 bytes (*_vec).
HEADS = r"""
// out[b, h, l, k] = x[r, h * K + k] + bias[h * K + k] with r = inv[b * L + l] (has_inv; else r = b * L + l),
// 0 where r < 0 (a pad position): the rows of a projection x [rows, H*K], unpacked to the padded batch,
// split into heads and given their bias in one pass. One block per position b * L + l: its threads read
// the row's H*K values in order and write H runs of K neighbouring values. Several projections at once
// (parts > 1, blocks part * B * L + position): x [parts, rows, H*K] -> out [parts, B, H, L, K], part p's bias
// at bias + p * bias_stride (the projections' biases evenly spaced in one buffer).
extern "C" __global__ void unpack_heads(const T* x, const T* bias, int has_bias, const int* inv, int has_inv, T* out,
                                        int H, int L, int K, int parts, long long N, int BL, long long bias_stride) {
    int part = blockIdx.x / BL, pos = blockIdx.x - part * BL, hk = H * K;
    int b = pos / L, l = pos - b * L;
    int r = has_inv ? inv[pos] : pos;
    const T* xp = x + part * N * hk;
    const T* bp = bias + part * bias_stride;
    T* op = out + (long long)part * BL * hk;
    for (int c = threadIdx.x; c < hk; c += blockDim.x) {
        int h = c / K, k = c - h * K;
        A v = 0;
        if (r >= 0) {
            v = (A)xp[(long long)r * hk + c];
            if (has_bias) v += (A)bp[c];
        }
        op[(((long long)b * H + h) * L + l) * K + k] = (T)v;
    }
}

// out[r, h * K + k] = x[b, h, l, k] with b * L + l = index[r] (has_index; else r): the inverse of
// unpack_heads on the kept rows, heads merged. One block per row r of out [rows, H*K]; parts > 1: x
// [parts, B, H, L, K] -> out [parts, rows, H*K], blocks part * rows + r.
extern "C" __global__ void pack_heads(const T* x, const long long* index, int has_index, T* out, int H, int L, int K,
                                      int N, long long BL) {
    int part = blockIdx.x / N, r = blockIdx.x - part * N, hk = H * K;
    long long pos = has_index ? index[r] : r;
    long long b = pos / L, l = pos - b * L;
    const T* xp = x + part * BL * hk;
    T* op = out + ((long long)part * N + r) * hk;
    for (int c = threadIdx.x; c < hk; c += blockDim.x) {
        int h = c / K, k = c - h * K;
        op[c] = xp[((b * H + h) * L + l) * K + k];
    }
}

// x = max(x + bias[c], 0) in place over x [n / f, f] (a Linear's output and the ReLU after it);
// one thread per element.
extern "C" __global__ void bias_relu(T* x, const T* bias, long long n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        T y = (T)((A)x[i] + (A)bias[i % f]);
        A yv = (A)y;
        x[i] = (yv > (A)0 || yv != yv) ? y : (T)(A)0;   // NaN stays NaN, as in maximum(x, 0)
    }
}

// dy = y > 0 ? dy : 0 in place: the ReLU's gradient, read off its output y.
extern "C" __global__ void relu_backward(T* dy, const T* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && !((A)y[i] > (A)0)) dy[i] = (T)(A)0;
}

// The same passes 16 bytes a thread (VEC values: 8 float16 or bfloat16, 4 float32, 2 float64) where the arrays allow
// it (16-byte aligned, whole vectors; kernels.vec_ok): one wide load (and store) of each array per
// thread instead of VEC narrow ones (a bias is still read value by value), the same arithmetic on each value (the same bits). Switch: MINITF_FUSED_VEC=0 turns them off.

extern "C" __global__ void bias_relu_vec(T* x, const T* bias, long long nvec, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nvec) {
        Vec a = ((Vec*)x)[i];
        int c = (int)((i * VEC) % f);
        for (int j = 0; j < VEC; j++) {
            T y = (T)((A)a.v[j] + (A)bias[c + j]);
            A yv = (A)y;
            a.v[j] = (yv > (A)0 || yv != yv) ? y : (T)(A)0;
        }
        ((Vec*)x)[i] = a;
    }
}

extern "C" __global__ void relu_backward_vec(T* dy, const T* y, long long nvec) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nvec) {
        Vec d = ((Vec*)dy)[i];
        Vec yy = ((const Vec*)y)[i];
        for (int j = 0; j < VEC; j++)
            if (!((A)yy.v[j] > (A)0)) d.v[j] = (T)(A)0;
        ((Vec*)dy)[i] = d;
    }
}

// unpack_heads with one thread per VEC neighbouring values of a row (K a multiple of VEC, so they lie in
// one head): thread g is chunk g % (HK / VEC) of position (g / (HK / VEC)) % BL of part g / (BL HK / VEC).
extern "C" __global__ void unpack_heads_vec(const T* x, const T* bias, int has_bias, const int* inv, int has_inv,
                                            T* out, int H, int L, int K, int parts, long long N, int BL,
                                            long long bias_stride, long long total) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total) return;
    int hk = H * K, chunks = hk / VEC;
    int chunk = (int)(g % chunks);
    long long pp = g / chunks;
    int part = (int)(pp / BL), pos = (int)(pp - (long long)part * BL);
    int b = pos / L, l = pos - b * L;
    int r = has_inv ? inv[pos] : pos;
    int c0 = chunk * VEC, h = c0 / K, k0 = c0 - h * K;
    Vec v;
    if (r >= 0) {
        v = ((const Vec*)(x + (long long)part * N * hk + (long long)r * hk))[chunk];
        if (has_bias)
            for (int j = 0; j < VEC; j++) v.v[j] = (T)((A)v.v[j] + (A)bias[part * bias_stride + c0 + j]);
    } else {
        for (int j = 0; j < VEC; j++) v.v[j] = (T)(A)0;
    }
    *(Vec*)(out + (long long)part * BL * hk + (((long long)b * H + h) * L + l) * K + k0) = v;
}

// pack_heads with one thread per VEC neighbouring values of an output row.
extern "C" __global__ void pack_heads_vec(const T* x, const long long* index, int has_index, T* out, int H, int L,
                                          int K, int N, long long BL, long long total) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total) return;
    int hk = H * K, chunks = hk / VEC;
    int chunk = (int)(g % chunks);
    long long pr = g / chunks;
    int part = (int)(pr / N), r = (int)(pr - (long long)part * N);
    long long pos = has_index ? index[r] : r;
    long long b = pos / L, l = pos - b * L;
    int c0 = chunk * VEC, h = c0 / K, k0 = c0 - h * K;
    *(Vec*)(out + ((long long)part * N + r) * hk + c0) =
        *(const Vec*)(x + (long long)part * BL * hk + ((b * H + h) * L + l) * K + k0);
}
"""


def unpack_heads(x, bias, inverse, b, length, h, bias_stride=0):
    """x [rows, H*K] (the kept rows, or b * length of them) -> [b, h, length, K] with bias [H*K] added
    (None: nothing added), zeros at the positions `inverse` [b * length] (int32, -1 at a pad;
    None: every position kept, row r = position r) marks as dropped. One pass. x [parts, rows, H*K]
    (with a nonzero bias_stride): several projections at once -> [parts, b, h, length, K], projection p's bias `bias_stride` elements
    after projection p-1's in the same buffer."""
    xp = backend.xp_of(x)
    x = xp.ascontiguousarray(x)
    parts = x.shape[0] if x.ndim == 3 and bias_stride else 1
    hk = x.shape[-1]
    k = hk // h
    n = x.size // (hk * parts)
    out = xp.empty(((parts,) if parts > 1 else ()) + (b, h, length, k), dtype=x.dtype)
    if vec_ok(x, out, width=k):
        total = parts * b * length * (hk // (VEC_BYTES // x.itemsize))
        _launch("unpack_heads_vec", x.dtype, -(-total // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
                (x, x if bias is None else bias, np.int32(bias is not None),
                 inverse if inverse is not None else _placeholder(xp, np.int32), np.int32(inverse is not None), out,
                 np.int32(h), np.int32(length), np.int32(k), np.int32(parts), np.int64(n), np.int32(b * length),
                 np.int64(bias_stride), np.int64(total)))
        return out
    _launch("unpack_heads", x.dtype, parts * b * length, _row_block(hk),
            (x, x if bias is None else bias, np.int32(bias is not None),
             inverse if inverse is not None else _placeholder(xp, np.int32), np.int32(inverse is not None), out,
             np.int32(h), np.int32(length), np.int32(k), np.int32(parts), np.int64(n), np.int32(b * length),
             np.int64(bias_stride)))
    return out


def pack_heads(x, index):
    """x [B, H, L, K] -> [rows, H*K]: row r is position index[r] (int64 [rows], positions b * L + l;
    None: every position, B * L rows) with its heads side by side. One pass. x [parts, B, H, L, K]:
    several at once -> [parts, rows, H*K]."""
    xp = backend.xp_of(x)
    parts = x.shape[0] if x.ndim == 5 else 1
    bb, h, length, k = x.shape[-4:]
    rows = bb * length if index is None else index.shape[0]
    out = xp.empty(((parts,) if parts > 1 else ()) + (rows, h * k), dtype=x.dtype)
    if vec_ok(x, out, width=k):
        total = parts * rows * (h * k // (VEC_BYTES // x.itemsize))
        _launch("pack_heads_vec", x.dtype, -(-total // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
                (x, index if index is not None else _placeholder(xp, np.int64), np.int32(index is not None), out,
                 np.int32(h), np.int32(length), np.int32(k), np.int32(rows), np.int64(bb * length), np.int64(total)))
        return out
    _launch("pack_heads", x.dtype, parts * rows, _row_block(h * k),
            (x, index if index is not None else _placeholder(xp, np.int64), np.int32(index is not None), out,
             np.int32(h), np.int32(length), np.int32(k), np.int32(rows), np.int64(bb * length)))
    return out


def bias_relu(x, bias):
    """x = max(x + bias, 0) in place (x [..., F] C-contiguous, bias [F]); returns x."""
    n = x.size
    if vec_ok(x, width=x.shape[-1]):
        nvec = n // (VEC_BYTES // x.itemsize)
        _launch("bias_relu_vec", x.dtype, -(-nvec // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
                (x, bias, np.int64(nvec), np.int32(x.shape[-1])))
        return x
    _launch("bias_relu", x.dtype, -(-n // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
            (x, bias, np.int64(n), np.int32(x.shape[-1])))
    return x


def relu_backward(dy, y):
    """dy = dy where y > 0, else 0, in place (dy, y C-contiguous, one shape); returns dy."""
    n = dy.size
    if vec_ok(dy, y, width=dy.shape[-1]):
        nvec = n // (VEC_BYTES // dy.itemsize)
        _launch("relu_backward_vec", dy.dtype, -(-nvec // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK, (dy, y, np.int64(nvec)))
        return dy
    _launch("relu_backward", dy.dtype, -(-n // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK, (dy, y, np.int64(n)))
    return dy


# ----------------------------------------------------------------------------- attention on packed rows
# The whole attention of a sentence and head on packed rows, one kernel forward and one backward, never
# writing the [B, H, T, S] weights (MINITF_FUSED_ATTN=1); on tensor cores in 16 bits, and in float32 as TF32
# (paper 3.2.1-3.2.2).
ATTENTION = r"""
// Attention over packed rows, one sentence's rows after another (packing.Spans: sentence b's query rows
// qstart[b] .. qstart[b] + qlen[b] - 1 of q, its key rows kstart[b] .. of k and v): the scaled dot-product
// attention of every head without the [B, H, T, S] scores, the padded head layout or the pack/unpack passes
// around them. q, k, v [rows, H*K] are the projections' outputs before their biases (bq, bk, bv, added here as
// unpack_heads adds them: rounded to T); head h reads columns h*K .. h*K + K - 1 and writes the same columns of
// its output. A key is seen where it is one of the sentence's (the padding bias) and, with `causal`, not after
// the query (the decoder's mask). ATT_G threads hold a row (each ATT_KPT of its K <= ATT_KMAX values, in runs of
// ATT_W: att_col, so that the row's threads read 16 neighbouring bytes each from a staged row, and a row's dot
// product is their partial sums added by two warp shuffles); a block takes ATT_ROWS rows of one sentence and head,
// and the keys (or queries) come through shared memory ATT_TILE rows at a time. A kernel's blocks of one kind are
// (b * H + h) * chunks + chunk, chunk the block's ATT_ROWS rows; attention_rows_backward_mma's launch takes each
// sentence and head's blocks together, its kchunks key blocks then its qchunks query blocks (att_backward_block), so
// that the sentence's rows are still in L2 for the second kind and the slower key blocks start first. Every thread
// of a block runs the same loops and shuffles (rows past the sentence's end too), as the warp shuffle needs.
// The backward's block `block` of a launch: (kind 1: a key block, 0: a query block; its index among its kind's).
__device__ inline int att_backward_block(int block, int qchunks, int kchunks, int* kind) {
    int per = qchunks + kchunks, bh = block / per, w = block - bh * per;
    *kind = w < kchunks;
    return *kind ? bh * kchunks + w : bh * qchunks + (w - kchunks);
}
#define ATT_G 4
#define ATT_KMAX 64
#define ATT_KPT (ATT_KMAX / ATT_G)
#define ATT_ROWS 16
#define ATT_TILE 32
#define ATT_W ((int)(16 / sizeof(A)))
struct alignas(16) AttVec { A v[16 / sizeof(A)]; };

// The column of a head that value i of thread g's share is: runs of ATT_W, the row's ATT_G threads side by side.
__device__ inline int att_col(int g, int i) { return (i / ATT_W) * (ATT_G * ATT_W) + g * ATT_W + i % ATT_W; }

// The sum of v over a row's ATT_G neighbouring threads; every one of them gets the same bits.
__device__ inline A att_group_sum(A v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// The keys any row of a block from `first` on sees: all lk of its sentence, or with `causal` those up to the block's
// last row (the forward and the backward's query blocks take the same ones).
__device__ inline int att_keys_seen(int causal, int lk, int first) {
    return causal && first + ATT_ROWS < lk ? first + ATT_ROWS : lk;
}

// Value c of row r of a projection, its bias added and the sum rounded to T (as unpack_heads writes the heads).
__device__ inline A att_value(const T* x, const T* bias, int has_bias, long long r, int hk, int col) {
    return has_bias ? (A)(T)((A)x[r * hk + col] + (A)bias[col]) : (A)x[r * hk + col];
}

// This block's sentence b, head h and first row `first` of its side (blocks (b * H + h) * chunks + chunk; the side's
// sentences start at start[] and are len[] rows long), and this thread's share g of a row's values, its row of the
// sentence, whether that row exists (active; else it works on the sentence's first row and writes nothing), the
// row's place r among the packed rows, and whether the whole block lies past the sentence's rows (past).
struct AttPlace { int b, h, g, first, row, active, past; long long r; };

__device__ inline AttPlace att_place(int block, int chunks, int H, const int* start, const int* len) {
    AttPlace p;
    int chunk = block % chunks, bh = block / chunks;
    p.h = bh % H;
    p.b = bh / H;
    p.g = threadIdx.x % ATT_G;
    p.first = chunk * ATT_ROWS;
    p.row = p.first + (int)threadIdx.x / ATT_G;
    p.active = p.row < len[p.b];
    p.past = p.first >= len[p.b];
    p.r = (long long)start[p.b] + (p.active ? p.row : 0);
    return p;
}

// This thread's share of head h of row r (its bias added as att_value adds it; 0 past K).
__device__ inline void att_share(A* mine, const T* x, const T* bias, int has_bias, long long r, int hk, int h, int K,
                                 int g) {
#pragma unroll
    for (int i = 0; i < ATT_KPT; ++i) {
        int c = att_col(g, i);
        mine[i] = c < K ? att_value(x, bias, has_bias, r, hk, h * K + c) : (A)0;
    }
}

// Writes this thread's share of head h of row r: mine * f, rounded to T.
__device__ inline void att_write(T* x, const A* mine, A f, long long r, int hk, int h, int K, int g) {
#pragma unroll
    for (int i = 0; i < ATT_KPT; ++i) {
        int c = att_col(g, i);
        if (c < K) x[r * hk + h * K + c] = (T)(mine[i] * f);
    }
}

// Stages rows j0 .. j0 + n - 1 (n <= ATT_TILE) of two arrays' head h (rows from `start`) in shared memory as
// att_value reads them: sa[j * ATT_KMAX + c] (bias_a added where has_a, the sum rounded to T) and sb likewise (bias_b,
// has_b), a thread a column (no division, the biases read once). No barrier: the caller's.
__device__ inline void att_stage_pair(const T* a, const T* bias_a, int has_a, const T* b, const T* bias_b, int has_b,
                                      long long start, int j0, int n, int hk, int h, int K, A* sa, A* sb) {
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        A ba = has_a ? (A)bias_a[h * K + c] : (A)0, bb = has_b ? (A)bias_b[h * K + c] : (A)0;
        for (int j = 0; j < n; ++j) {
            long long at = (start + j0 + j) * hk + h * K + c;
            sa[j * ATT_KMAX + c] = has_a ? (A)(T)((A)a[at] + ba) : (A)a[at];
            sb[j * ATT_KMAX + c] = has_b ? (A)(T)((A)b[at] + bb) : (A)b[at];
        }
    }
}

// att_stage_pair of two arrays that both take their bias where has_bias (keys and values), between two barriers.
__device__ inline void att_stage(const T* a, const T* bias_a, const T* b, const T* bias_b, int has_bias,
                                 long long start, int j0, int n, int hk, int h, int K, A* sa, A* sb) {
    __syncthreads();                            // the previous tile's readers are done
    att_stage_pair(a, bias_a, has_bias, b, bias_b, has_bias, start, j0, n, hk, h, K, sa, sb);
    __syncthreads();
}

// The dot product of a row's values `mine` (this thread's share) with row j of a staged tile, over the row's threads.
__device__ inline A att_dot(const A* mine, const A* tile, int j, int g, int K) {
    const AttVec* t = (const AttVec*)(tile + j * ATT_KMAX);
    A d = 0;
#pragma unroll
    for (int u = 0; u < ATT_KPT / ATT_W; ++u) {
        AttVec w = t[u * ATT_G + g];            // att_col(g, u * ATT_W) .. + ATT_W - 1, one 16-byte load
#pragma unroll
        for (int e = 0; e < ATT_W; ++e)
            if (att_col(g, u * ATT_W + e) < K) d += mine[u * ATT_W + e] * w.v[e];
    }
    return att_group_sum(d);
}

// mine += f * (row j of a staged tile), this thread's share.
__device__ inline void att_axpy(A* mine, A f, const A* tile, int j, int g) {
    const AttVec* t = (const AttVec*)(tile + j * ATT_KMAX);
#pragma unroll
    for (int u = 0; u < ATT_KPT / ATT_W; ++u) {
        AttVec w = t[u * ATT_G + g];
#pragma unroll
        for (int e = 0; e < ATT_W; ++e) mine[u * ATT_W + e] += f * w.v[e];
    }
}

// out = softmax(scale q k^T + mask) v per sentence and head, and lse[h * nq + r] = the log of the softmax's
// denominator (its maximum included) of query row r, for the backward: an online softmax over the keys
// (running maximum m and sum l, the output's sum rescaled when m grows).
extern "C" __global__ void attention_rows_forward(const T* q, const T* k, const T* v, const T* bq, const T* bk,
                                                  const T* bv, int has_bias, const int* qstart, const int* qlen,
                                                  const int* kstart, const int* klen, T* out, A* lse, int H, int K,
                                                  int chunks, int causal, A scale, long long nq) {
    __shared__ AttVec tiles[2 * ATT_TILE * ATT_KMAX / ATT_W];   // the staged keys and values
    A *sk = (A*)tiles, *sv = sk + ATT_TILE * ATT_KMAX;
    AttPlace at = att_place(blockIdx.x, chunks, H, qstart, qlen);
    if (at.past) return;
    int b = at.b, h = at.h, g = at.g, first = at.first, row = at.row, active = at.active, lk = klen[b], hk = H * K;
    long long qr = at.r;
    A qv[ATT_KPT], acc[ATT_KPT];                 // this thread's share of the row's q and of its output's sum
    att_share(qv, q, bq, has_bias, qr, hk, h, K, g);
#pragma unroll
    for (int i = 0; i < ATT_KPT; ++i) acc[i] = 0;
    int nk = att_keys_seen(causal, lk, first);
    A m = NEG_BIG, l = 0;
    for (int j0 = 0; j0 < nk; j0 += ATT_TILE) {
        int n = nk - j0 < ATT_TILE ? nk - j0 : ATT_TILE;
        att_stage(k, bk, v, bv, has_bias, kstart[b], j0, n, hk, h, K, sk, sv);
        for (int j = 0; j < n; ++j) {
            A s = att_dot(qv, sk, j, g, K) * scale;
            if (active && (!causal || j0 + j <= row)) {
                if (s > m) {                    // a new maximum: the sums so far rescaled (0 at the first key)
                    A corr = a_exp(m - s);
                    l *= corr;
#pragma unroll
                    for (int i = 0; i < ATT_KPT; ++i) acc[i] *= corr;
                    m = s;
                }
                A p = a_exp(s - m);
                l += p;
                att_axpy(acc, p, sv, j, g);
            }
        }
    }
    if (!active) return;
    att_write(out, acc, (A)1 / l, qr, hk, h, K, g);
    if (g == 0) lse[(long long)h * nq + qr] = m + a_log(l);
}

// delta = dout . out of head h of row r, added in column order by one thread (the same bits wherever it is
// computed: a query row's threads each, a key block's staging thread).
__device__ inline A att_delta(const T* dout, const T* out, long long r, int hk, int h, int K) {
    A dd = 0;
    for (int c = 0; c < K; ++c) dd += (A)dout[r * hk + h * K + c] * (A)out[r * hk + h * K + c];
    return dd;
}

// The backward's query blocks, per query row: delta = sum(dout * out) and dq = scale * sum_j ds_j k_j with
// p_j = exp(scale q k_j - lse) (the forward's weights again), dp_j = dout v_j, ds_j = p_j (dp_j - delta):
// softmax_backward's ds, since sum_j p_j dp_j = dout (sum_j p_j v_j) = delta. sk, sv: the block's tiles.
__device__ void att_backward_q(int block, const T* q, const T* k, const T* v, const T* bq, const T* bk, const T* bv,
                               int has_bias, const int* qstart, const int* qlen, const int* kstart, const int* klen,
                               const T* out, const T* dout, const A* lse, T* dq, int H, int K, int chunks,
                               int causal, A scale, long long nq, A* sk, A* sv) {
    AttPlace at = att_place(block, chunks, H, qstart, qlen);
    if (at.past) return;
    int b = at.b, h = at.h, g = at.g, first = at.first, row = at.row, active = at.active, lk = klen[b], hk = H * K;
    long long qr = at.r;
    A qv[ATT_KPT], dov[ATT_KPT], dqv[ATT_KPT];   // this thread's share of the row's q, dout and dq
    att_share(qv, q, bq, has_bias, qr, hk, h, K, g);
    att_share(dov, dout, dout, 0, qr, hk, h, K, g);
#pragma unroll
    for (int i = 0; i < ATT_KPT; ++i) dqv[i] = 0;
    A dd = att_delta(dout, out, qr, hk, h, K);
    A ls = lse[(long long)h * nq + qr];
    int nk = att_keys_seen(causal, lk, first);
    for (int j0 = 0; j0 < nk; j0 += ATT_TILE) {
        int n = nk - j0 < ATT_TILE ? nk - j0 : ATT_TILE;
        att_stage(k, bk, v, bv, has_bias, kstart[b], j0, n, hk, h, K, sk, sv);
        for (int j = 0; j < n; ++j) {
            A s = att_dot(qv, sk, j, g, K) * scale;
            A dp = att_dot(dov, sv, j, g, K);
            if (active && (!causal || j0 + j <= row)) att_axpy(dqv, a_exp(s - ls) * (dp - dd), sk, j, g);
        }
    }
    if (active) att_write(dq, dqv, scale, qr, hk, h, K, g);
}

// The backward's key blocks, per key row j: dv_j = sum_i p_ij dout_i and dk_j = scale * sum_i ds_ij q_i over the
// queries i that see key j, the queries staged ATT_TILE at a time with their output gradients, lse and delta
// (computed here as the query blocks compute it: the same bits). sq, sdo, sls, sdd: the block's shared arrays.
__device__ void att_backward_kv(int block, const T* q, const T* k, const T* v, const T* bq, const T* bk, const T* bv,
                                int has_bias, const int* qstart, const int* qlen, const int* kstart, const int* klen,
                                const T* out, const T* dout, const A* lse, T* dk, T* dv, int H, int K, int chunks,
                                int causal, A scale, long long nq, A* sq, A* sdo, A* sls, A* sdd) {
    AttPlace at = att_place(block, chunks, H, kstart, klen);
    if (at.past) return;
    int b = at.b, h = at.h, g = at.g, first = at.first, key = at.row, active = at.active, lq = qlen[b], hk = H * K;
    long long kr = at.r, q0 = qstart[b];
    A kv[ATT_KPT], vv[ATT_KPT], dkv[ATT_KPT], dvv[ATT_KPT];
    att_share(kv, k, bk, has_bias, kr, hk, h, K, g);
    att_share(vv, v, bv, has_bias, kr, hk, h, K, g);
#pragma unroll
    for (int i = 0; i < ATT_KPT; ++i) {
        dkv[i] = 0;
        dvv[i] = 0;
    }
    int i_first = causal ? first : 0;            // the first query any key here is seen by
    for (int i0 = i_first; i0 < lq; i0 += ATT_TILE) {
        int n = lq - i0 < ATT_TILE ? lq - i0 : ATT_TILE;
        // stage the tile's queries (their bias added), their output gradients, lse and delta
        __syncthreads();
        att_stage_pair(q, bq, has_bias, dout, dout, 0, q0, i0, n, hk, h, K, sq, sdo);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            sls[i] = lse[(long long)h * nq + q0 + i0 + i];
            sdd[i] = att_delta(dout, out, q0 + i0 + i, hk, h, K);
        }
        __syncthreads();
        for (int i = 0; i < n; ++i) {
            A s = att_dot(kv, sq, i, g, K) * scale;
            A dp = att_dot(vv, sdo, i, g, K);
            if (active && (!causal || key <= i0 + i)) {
                A p = a_exp(s - sls[i]);
                att_axpy(dvv, p, sdo, i, g);
                att_axpy(dkv, p * (dp - sdd[i]), sq, i, g);
            }
        }
    }
    if (!active) return;
    att_write(dk, dkv, scale, kr, hk, h, K, g);
    att_write(dv, dvv, (A)1, kr, hk, h, K, g);
}

// The backward of attention_rows_forward in one launch: the first count * H * qchunks blocks take the query rows
// (dq), the other count * H * kchunks the key rows (dk, dv); neither needs the other's results. (Taking each
// sentence and head's blocks together, as the tensor-core backward does, took this kernel from 128 registers to
// 130-157: fewer blocks on a multiprocessor.)
extern "C" __global__ void attention_rows_backward(const T* q, const T* k, const T* v, const T* bq, const T* bk,
                                                   const T* bv, int has_bias, const int* qstart, const int* qlen,
                                                   const int* kstart, const int* klen, const T* out, const T* dout,
                                                   const A* lse, T* dq, T* dk, T* dv, int H, int K, int qchunks,
                                                   int kchunks, int count, int causal, A scale, long long nq) {
    __shared__ AttVec tiles[2 * ATT_TILE * ATT_KMAX / ATT_W];   // keys and values, or queries and their dout
    __shared__ A rows[2 * ATT_TILE];                             // the staged queries' lse and delta
    A *t0 = (A*)tiles, *t1 = t0 + ATT_TILE * ATT_KMAX;
    int qblocks = count * H * qchunks;
    if ((int)blockIdx.x < qblocks)
        att_backward_q(blockIdx.x, q, k, v, bq, bk, bv, has_bias, qstart, qlen, kstart, klen, out, dout, lse, dq, H, K,
                       qchunks, causal, scale, nq, t0, t1);
    else
        att_backward_kv(blockIdx.x - qblocks, q, k, v, bq, bk, bv, has_bias, qstart, qlen, kstart, klen, out, dout, lse,
                        dk, dv, H, K, kchunks, causal, scale, nq, t0, t1, rows, rows + ATT_TILE);
}

// The same attention on tensor cores (float16 and bfloat16 storage; float32 as TF32, below; K a multiple of 16, sm_80
// and newer): a block is W warps (mma_place), each taking ATT_ROWS = 16 rows of one sentence and head, and every
// product is mma.sync m16n8k16 (16-bit operands, float32 sums), its fragments as
// the PTX ISA lays them out ("Matrix Fragments for mma.m16n8k16 with floating point type"; lane = 4 gid + tig): A
// (16 x 16) a[0] holds row gid, columns 2 tig and 2 tig + 1, a[1] the same of row gid + 8, a[2] and a[3] those 8
// columns on; B (16 x 8) b[0] holds rows 2 tig and 2 tig + 1 of column gid, b[1] those 8 rows on; C (16 x 8, float)
// c[0], c[1] row gid, columns 2 tig, 2 tig + 1, c[2], c[3] row gid + 8. A product's C tiles side by side are the next
// product's A fragments (mma_tile_by_rows).
// Staged rows are ATTC_LD values apart (144 bytes, 36 words): the 8 rows of 16 bytes an ldmatrix phase reads fall in
// 32 banks (words 36 r .. 36 r + 3), no conflicts.
// In float32 storage (ATT_MMA_TF32; kernels.attention_tensor_cores launches them only where float32 products run on
// TF32, as the GEMMs do with CUPY_TF32) the same kernels make every product mma.sync m16n8k8 with TF32 operands (a value
// rounded to 10 mantissa bits by cvt.rna.tf32.f32) and float32 sums ("Matrix Fragments for mma.m16n8k8" of .tf32): A (16
// x 8) a[0] row gid, column tig, a[1] row gid + 8, a[2] and a[3] those 4 columns on; B (8 x 8) b[0] row tig of column
// gid, b[1] 4 rows on; C as above. A C tile (8 columns: c[0], c[1] columns 2 tig, 2 tig + 1) is the A fragment of the
// next product with its k index permuted: A column tig stands for C column 2 tig and column tig + 4 for 2 tig + 1
// (a[0..3] = c[0], c[2], c[1], c[3]), and B's rows are read in that order (mma_tile_by_rows): no shuffle. Fragments of
// B come from the staged float32 rows by 4-byte loads (ldmatrix moves 16-bit values), 68 values apart: the 32 lanes'
// words of a load fall in 32 banks.
// A masked key's weight is 0 and a masked query's gradient term 0, but the products take whole tiles, so a staged
// row (a key, or a query or its output gradient) whose values are not finite makes NaN the rows of the blocks that
// multiply its tile (0 * inf), where the CUDA-core kernels skip it; it is a row of the same sentence, and the update
// is not finite either way.
#if ATT_MMA_TF32
#define ATTC_LD (ATT_KMAX + 4)
#define ATTC_K 8                       // the values of a k-step: m16n8k8
#else
#define ATTC_LD (ATT_KMAX + 8)
#define ATTC_K 16                      // m16n8k16
#endif
#define ATTC_STEPS (ATT_KMAX / ATTC_K) // a row's k-steps
#define ATTC_COLS (ATT_KMAX / 8)       // a row's C tiles of 8 values
#define ATTC_TILES (ATT_TILE / 8)      // a staged tile's C tiles of 8 rows
// The tensor-core code exists where there are tensor-core products of T (ATT_MMA: float16, bfloat16, float32 as TF32)
// on an sm_80 or newer.
#if ATT_MMA && (defined(MINITF_EMULATE) || __CUDA_ARCH__ >= 800)
#define ATT_MMA_HERE 1
#else
#define ATT_MMA_HERE 0
#endif
#if ATT_MMA_HERE
typedef unsigned int mma_u32;

#if !ATT_MMA_TF32
// Two values as one register of a fragment: lo in the low 16 bits (rounded to T).
__device__ inline mma_u32 mma_pack(A lo, A hi) {
    T l = (T)lo, h = (T)hi;
    return (mma_u32)l.bits | ((mma_u32)h.bits << 16);
}

// Four 8 x 8 matrices of staged T values into one register each, by the warp: lanes 8 i .. 8 i + 7 give the addresses of
// matrix i's 8 rows (16 bytes each, 16-byte aligned), and lane 4 gid + tig receives matrix i's row gid, columns 2 tig and
// 2 tig + 1 (mma_ldsm_x4: the B fragment of rows that are B's columns) or, transposed, rows 2 tig and 2 tig + 1 of column
// gid (mma_ldsm_x4_trans: the B fragment of rows that are B's rows); the lower index in the low 16 bits (ldmatrix
// .m8n8.x4.b16, PTX ISA "Warp-level matrix load instruction: ldmatrix"; a generic address into shared memory).
#ifdef MINITF_EMULATE
#define mma_ldsm_x4(d, p) emu_ldmatrix_x4<0>(d, p)
#define mma_ldsm_x4_trans(d, p) emu_ldmatrix_x4<1>(d, p)
#else
__device__ inline void mma_ldsm_x4(mma_u32* d, const T* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(p) : "memory");
}
__device__ inline void mma_ldsm_x4_trans(mma_u32* d, const T* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(p) : "memory");
}
#endif
#endif

// 16 bytes from global src to shared dst without waiting for them (cp.async.cg.shared.global, PTX ISA "Data
// movement: cp.async"): `bytes` 16 copies them, 0 writes 16 zero bytes (src is not read); mma_copy_wait waits for
// every copy this thread has made. Both addresses 16-byte aligned.
#ifdef MINITF_EMULATE
__device__ inline void mma_copy16(T* dst, const T* src, int bytes) { emu_cp_async16(dst, src, bytes); }
__device__ inline void mma_copy_wait() { emu_cp_async_wait_all(); }
#else
__device__ inline void mma_copy16(T* dst, const T* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ inline void mma_copy_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#endif

#if ATT_MMA_TF32
#ifdef MINITF_EMULATE
#define mma_tf32(x) emu_tf32(x)
#define mma_1688(c, a, b) emu_mma_1688_tf32(c, a, b)
#else
// x as a TF32 operand: rounded to 10 mantissa bits, to nearest, ties away from zero.
__device__ inline mma_u32 mma_tf32(A x) {
    mma_u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// c += a b: one warp's 16 x 8 x 8 product on the tensor cores, TF32 operands.
__device__ inline void mma_1688(float* c, const mma_u32* a, const mma_u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
#else
#ifdef MINITF_EMULATE
#define mma_16816(c, a, b) emu_mma_16816<ATT_MMA_BF16>(c, a, b)
#else
// c += a b: one warp's 16 x 8 x 16 product on the tensor cores.
__device__ inline void mma_16816(float* c, const mma_u32* a, const mma_u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ATT_MMA_AB "." ATT_MMA_AB ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
#endif

__device__ inline A mma_quad_max(A v) {          // the maximum over a row's 4 lanes (a quad)
    v = a_max(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return a_max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// delta = dout . out of head h of a row by the whole warp: lane l adds columns 2 l and 2 l + 1, then five butterfly
// shuffles give every lane the same bits (the query blocks and the key blocks both compute it so: the same value).
// MMA_DELTAS rows at a time, rows r0 .. r0 + MMA_DELTAS - 1 into d[]: those from r0 + m on (m the rows left, which may
// be more than MMA_DELTAS or none) give 0. Every row's loads are made before the first row's shuffles, so the warp
// waits on memory once for them all, not once a row. Every lane runs every shuffle (a shuffle of the whole warp).
#define MMA_DELTAS 8
__device__ inline void mma_deltas(A* d, const T* dout, const T* out, long long r0, int m, int hk, int h, int K) {
    int c = 2 * (threadIdx.x & 31);
#pragma unroll
    for (int i = 0; i < MMA_DELTAS; ++i) {   // each row's two products as soon as its values arrive: one value a row
        d[i] = 0;                             // kept, the loads of the rows issued together
        if (i < m && c < K) {
            long long at = (r0 + i) * hk + h * K + c;
            d[i] = (A)dout[at] * (A)out[at] + (A)dout[at + 1] * (A)out[at + 1];
        }
    }
#pragma unroll
    for (int i = 0; i < MMA_DELTAS; ++i)
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) d[i] += __shfl_xor_sync(0xffffffffu, d[i], s);
}

#if !ATT_MMA_TF32
// The A fragments of the 16 rows r0 .. r0 + 15 of head h of x (rows at or past n read as 0), its bias added and the
// sum rounded to T as att_value does: f[s] holds the head's values 16 s .. 16 s + 15.
__device__ inline void mma_rows(mma_u32 (*f)[4], const T* x, const T* bias, int has_bias, long long r0, int n, int hk,
                                int h, int K) {
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int s = 0; s < ATTC_STEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int row = gid + 8 * (i & 1), col = h * K + 16 * s + 2 * tig + 8 * (i >> 1);
            A lo = 0, hi = 0;
            if (16 * s < K && row < n) {
                lo = att_value(x, bias, has_bias, r0 + row, hk, col);
                hi = att_value(x, bias, has_bias, r0 + row, hk, col + 1);
            }
            f[s][i] = mma_pack(lo, hi);
        }
}
#else
// mma_rows in TF32: f[s] holds the head's values 8 s .. 8 s + 7 of rows gid and gid + 8 (columns tig and tig + 4).
__device__ inline void mma_rows(mma_u32 (*f)[4], const T* x, const T* bias, int has_bias, long long r0, int n, int hk,
                                int h, int K) {
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int s = 0; s < ATTC_STEPS; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int row = gid + 8 * (i & 1), col = h * K + 8 * s + tig + 4 * (i >> 1);
            A val = 0;
            if (8 * s < K && row < n) val = att_value(x, bias, has_bias, r0 + row, hk, col);
            f[s][i] = mma_tf32(val);
        }
}
#endif

// Stages rows j0 .. j0 + n - 1 (rows from `start`) of head h of x in shared memory as T (the bias added where has_bias,
// as att_value adds it: the sum rounded to T): sx[j * ATTC_LD + c]; rows n .. ATT_TILE - 1 are 0, so that a product
// over them adds 0 (never a NaN of memory no one wrote). 16 bytes (a Vec of VEC values: 8 in 16 bits, 4 in float32) a
// copy: thread t of the block's n_t takes the vector c0 = VEC (t % (K / VEC)) of rows t / (K / VEC), t / (K / VEC) +
// n_t / (K / VEC), ...
// (x's rows and sx 16-byte aligned: kernels.attention_rows checks x, and a staged row is 144 bytes, 272 in float32).
// Every copy is issued before any is waited for (mma_copy16: one wait on memory a tile, not one a vector), then the
// lane adds the bias to the vectors it copied. No barrier: the caller's.
__device__ inline void mma_stage(const T* x, const T* bias, int has_bias, long long start, int j0, int n, int hk, int h,
                                 int K, T* sx) {
    int per_row = K / VEC, step = blockDim.x / per_row, lanes = step * per_row, lane = threadIdx.x;
    if (lane >= lanes) return;                  // K = 48 in 16 bits, one warp: 6 vectors a row, 5 rows a pass, 30, 31 idle
    int c0 = VEC * (lane % per_row);
    A b[VEC];                                   // this lane's VEC columns of the bias, read once
#pragma unroll
    for (int e = 0; e < VEC; ++e) b[e] = has_bias ? (A)bias[h * K + c0 + e] : (A)0;
    const T* col = x + (start + j0) * hk + h * K + c0;
    for (int j = lane / per_row; j < ATT_TILE; j += step)   // rows at or past n: 16 zero bytes, nothing read
        mma_copy16(sx + j * ATTC_LD + c0, col + (long long)(j < n ? j : 0) * hk, j < n ? 16 : 0);
    mma_copy_wait();
    if (has_bias)
        for (int j = lane / per_row; j < n && j < ATT_TILE; j += step) {
            Vec v = *(const Vec*)(sx + j * ATTC_LD + c0);
#pragma unroll
            for (int e = 0; e < VEC; ++e) v.v[e] = (T)((A)v.v[e] + b[e]);
            *(Vec*)(sx + j * ATTC_LD + c0) = v;
        }
}

#if !ATT_MMA_TF32
// c = rows . tile^T: the 16 rows' fragments f times the ATT_TILE staged rows, c[nt] the staged rows 8 nt .. 8 nt + 7.
// B = tile^T, B's column n a staged row: one mma_ldsm_x4 gives the fragments of two 8-row tiles (nt, nt + 1) for a
// k-step of 16 values: matrices (rows 8 nt.., values 16 s..), (8 nt.., 16 s + 8..), (8 nt + 8.., 16 s..), (8 nt + 8..,
// 16 s + 8..); lane l addresses row (l & 7) of matrix l / 8.
__device__ inline void mma_rows_by_tile(float (*c)[4], const mma_u32 (*f)[4], const T* tile, int K) {
    int lane = threadIdx.x & 31;
    const T* mine = tile + ((lane & 16) ? 8 : 0) * ATTC_LD + (lane & 7) * ATTC_LD + ((lane & 8) ? 8 : 0);
#pragma unroll
    for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0;
#pragma unroll
    for (int nt = 0; nt < ATTC_TILES; nt += 2)
#pragma unroll
        for (int s = 0; s < ATTC_STEPS; ++s)
            if (16 * s < K) {
                mma_u32 b[4];
                mma_ldsm_x4(b, mine + 8 * nt * ATTC_LD + 16 * s);
                mma_16816(c[nt], f[s], b);
                mma_16816(c[nt + 1], f[s], b + 2);
            }
}

// acc += w . tile: the 16 x ATT_TILE weights w (C tiles, rounded to T here) times the staged rows (ATT_TILE x K).
// B = tile, B's row k a staged row: one mma_ldsm_x4_trans gives the fragments of two 8-value column tiles (nt, nt + 1)
// for a k-step of 16 rows: matrices (rows 16 kt.., values 8 nt..), (16 kt + 8.., 8 nt..), (16 kt.., 8 nt + 8..),
// (16 kt + 8.., 8 nt + 8..).
__device__ inline void mma_tile_by_rows(float (*acc)[4], const float (*w)[4], const T* tile, int K) {
    int lane = threadIdx.x & 31;
    const T* mine = tile + ((lane & 8) ? 8 : 0) * ATTC_LD + (lane & 7) * ATTC_LD + ((lane & 16) ? 8 : 0);
#pragma unroll
    for (int kt = 0; kt < ATT_TILE / 16; ++kt) {
        mma_u32 a[4] = {mma_pack(w[2 * kt][0], w[2 * kt][1]), mma_pack(w[2 * kt][2], w[2 * kt][3]),
                        mma_pack(w[2 * kt + 1][0], w[2 * kt + 1][1]), mma_pack(w[2 * kt + 1][2], w[2 * kt + 1][3])};
#pragma unroll
        for (int nt = 0; nt < ATTC_COLS; nt += 2)
            if (8 * nt < K) {
                mma_u32 b[4];
                mma_ldsm_x4_trans(b, mine + 16 * kt * ATTC_LD + 8 * nt);
                mma_16816(acc[nt], a, b);
                mma_16816(acc[nt + 1], a, b + 2);
            }
    }
}
#else
// mma_rows_by_tile in TF32: B's column gid is staged row 8 nt + gid, b[0] its value 8 s + tig, b[1] 8 s + tig + 4.
__device__ inline void mma_rows_by_tile(float (*c)[4], const mma_u32 (*f)[4], const T* tile, int K) {
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
    const T* mine = tile + gid * ATTC_LD + tig;
#pragma unroll
    for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0;
#pragma unroll
    for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
        for (int s = 0; s < ATTC_STEPS; ++s)
            if (8 * s < K) {
                const T* p = mine + 8 * nt * ATTC_LD + 8 * s;
                mma_u32 b[2] = {mma_tf32((A)p[0]), mma_tf32((A)p[4])};
                mma_1688(c[nt], f[s], b);
            }
}

// mma_tile_by_rows in TF32: k-step kt is C tile kt of w (staged rows 8 kt .. 8 kt + 7), its A fragment (c[0], c[2],
// c[1], c[3]) with column tig for staged row 8 kt + 2 tig and column tig + 4 for 8 kt + 2 tig + 1; so b[0] is value
// 8 nt + gid of staged row 8 kt + 2 tig and b[1] of row 8 kt + 2 tig + 1.
__device__ inline void mma_tile_by_rows(float (*acc)[4], const float (*w)[4], const T* tile, int K) {
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
    const T* mine = tile + 2 * tig * ATTC_LD + gid;
#pragma unroll
    for (int kt = 0; kt < ATTC_TILES; ++kt) {
        mma_u32 a[4] = {mma_tf32(w[kt][0]), mma_tf32(w[kt][2]), mma_tf32(w[kt][1]), mma_tf32(w[kt][3])};
#pragma unroll
        for (int nt = 0; nt < ATTC_COLS; ++nt)
            if (8 * nt < K) {
                const T* p = mine + 8 * kt * ATTC_LD + 8 * nt;
                mma_u32 b[2] = {mma_tf32((A)p[0]), mma_tf32((A)p[ATTC_LD])};
                mma_1688(acc[nt], a, b);
            }
    }
}
#endif

// Writes rows r0 + gid and r0 + gid + 8 (those below n) of head h of x from C tiles: acc * f[0] and acc * f[1].
__device__ inline void mma_write(T* x, const float (*acc)[4], const A* f, long long r0, int n, int hk, int h, int K) {
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        int row = gid + 8 * u;
        if (row >= n) continue;
#pragma unroll
        for (int nt = 0; nt < ATTC_COLS; ++nt)
            if (8 * nt < K) {
                long long at = (r0 + row) * hk + h * K + 8 * nt + 2 * tig;
                x[at] = (T)(acc[nt][2 * u] * f[u]);
                x[at + 1] = (T)(acc[nt][2 * u + 1] * f[u]);
            }
    }
}

__device__ inline void mma_zero(float (*acc)[4]) {
#pragma unroll
    for (int nt = 0; nt < ATTC_COLS; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0;
}

// Where a warp of a tensor-core block works: a block of W = blockDim.x / 32 warps takes W consecutive chunks of ATT_ROWS
// rows of one sentence and head (ceil(chunks / W) blocks a sentence and head, sentence by sentence and head by head),
// warp w the block's chunk w, from row `first`; the block stages each tile once for all its warps. `last` is the
// first row of the block's last chunk (the keys a causal block sees: att_keys_seen), `past` whether the whole block
// lies past the sentence's rows. A warp past them works on no rows (its products read and write nothing: rows < 0)
// but runs the loop the others run, products and shuffles too, so that every warp reaches the block's barriers in it.
struct MmaPlace { int b, h, first, last, past; };

__device__ inline MmaPlace mma_place(int block, int chunks, int H, const int* len) {
    int warps = blockDim.x >> 5, groups = (chunks + warps - 1) / warps;
    int group = block % groups, bh = block / groups, chunk0 = group * warps;
    MmaPlace p;
    p.h = bh % H;
    p.b = bh / H;
    p.first = (chunk0 + (int)(threadIdx.x >> 5)) * ATT_ROWS;
    p.last = (chunk0 + warps - 1) * ATT_ROWS;
    p.past = chunk0 * ATT_ROWS >= len[p.b];
    return p;
}

// attention_rows_forward on tensor cores: per tile of ATT_TILE keys, s = scale q k^T (mma_rows_by_tile), the
// tile's row maxima, the sums so far rescaled, p = exp(s - m) (0 where the key is not seen), acc += p v.
__device__ void att_mma_forward(const T* q, const T* k, const T* v, const T* bq, const T* bk, const T* bv, int has_bias,
                                const int* qstart, const int* qlen, const int* kstart, const int* klen, T* out, A* lse,
                                int H, int K, int chunks, int causal, A scale, long long nq, T* sk, T* sv) {
    MmaPlace at = mma_place(blockIdx.x, chunks, H, qlen);
    if (at.past) return;
    int b = at.b, h = at.h, first = at.first, lk = klen[b], hk = H * K, rows = qlen[b] - at.first;
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
    long long r0 = (long long)qstart[b] + first;
    mma_u32 qf[ATTC_STEPS][4];
    mma_rows(qf, q, bq, has_bias, r0, rows, hk, h, K);
    float acc[ATTC_COLS][4], s[ATTC_TILES][4];
    mma_zero(acc);
    A m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0, 0};  // rows gid and gid + 8: the running maximum, this lane's part of the sum
    int nk = att_keys_seen(causal, lk, at.last);   // the block's: an earlier warp's later keys are all masked
    for (int j0 = 0; j0 < nk; j0 += ATT_TILE) {
        int n = nk - j0 < ATT_TILE ? nk - j0 : ATT_TILE;
        __syncthreads();                        // the previous tile's readers are done
        mma_stage(k, bk, has_bias, kstart[b], j0, n, hk, h, K, sk);
        mma_stage(v, bv, has_bias, kstart[b], j0, n, hk, h, K, sv);
        __syncthreads();
        mma_rows_by_tile(s, qf, sk, K);
        A top[2] = {NEG_BIG, NEG_BIG};
#pragma unroll
        for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int key = 8 * nt + 2 * tig + (i & 1), row = first + gid + 8 * (i >> 1);
                s[nt][i] = key < n && (!causal || j0 + key <= row) ? s[nt][i] * scale : NEG_BIG;
                top[i >> 1] = a_max(top[i >> 1], s[nt][i]);
            }
#pragma unroll
        for (int u = 0; u < 2; ++u) {           // a new maximum: the sums so far rescaled
            A mu = a_max(m[u], mma_quad_max(top[u])), corr = a_exp(m[u] - mu);
            l[u] *= corr;
#pragma unroll
            for (int nt = 0; nt < ATTC_COLS; ++nt) {
                acc[nt][2 * u] *= corr;
                acc[nt][2 * u + 1] *= corr;
            }
            m[u] = mu;
        }
#pragma unroll
        for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                A p = s[nt][i] == NEG_BIG ? (A)0 : a_exp(s[nt][i] - m[i >> 1]);
                s[nt][i] = p;
                l[i >> 1] += p;
            }
        mma_tile_by_rows(acc, s, sv, K);
    }
    A f[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        l[u] = att_group_sum(l[u]);
        f[u] = (A)1 / l[u];
        int row = gid + 8 * u;
        if (tig == 0 && row < rows) lse[(long long)h * nq + r0 + row] = m[u] + a_log(l[u]);
    }
    mma_write(out, acc, f, r0, rows, hk, h, K);
}

// The backward's query blocks on tensor cores: per key tile, s = scale q k^T and dp = dout v^T (mma_rows_by_tile),
// ds = p (dp - delta) with p = exp(s - lse), dq += (scale ds) k (scale ds rounded to T as an operand: the headroom of
// the gradient itself, not 1 / scale times less).
__device__ void att_mma_backward_q(int block, const T* q, const T* k, const T* v, const T* bq, const T* bk, const T* bv,
                                   int has_bias, const int* qstart, const int* qlen, const int* kstart, const int* klen,
                                   const T* out, const T* dout, const A* lse, T* dq, int H, int K, int chunks,
                                   int causal, A scale, long long nq, T* sk, T* sv) {
    MmaPlace at = mma_place(block, chunks, H, qlen);
    if (at.past) return;
    int b = at.b, h = at.h, first = at.first, lk = klen[b], hk = H * K, rows = qlen[b] - at.first;
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
    long long r0 = (long long)qstart[b] + first;
    mma_u32 qf[ATTC_STEPS][4], df[ATTC_STEPS][4];
    mma_rows(qf, q, bq, has_bias, r0, rows, hk, h, K);
    mma_rows(df, dout, dout, 0, r0, rows, hk, h, K);
    A dd[2] = {0, 0}, ls[2];
    for (int row0 = 0; row0 < 16; row0 += MMA_DELTAS) {   // each row's delta by the warp, kept by the row's lanes (0
        A d[MMA_DELTAS];                                   // past the rows: every warp shuffles alike)
        mma_deltas(d, dout, out, r0 + row0, rows - row0, hk, h, K);
#pragma unroll
        for (int i = 0; i < MMA_DELTAS; ++i) {
            if (row0 + i == gid) dd[0] = d[i];
            if (row0 + i == gid + 8) dd[1] = d[i];
        }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        int row = gid + 8 * u;
        ls[u] = row < rows ? lse[(long long)h * nq + r0 + row] : (A)0;
    }
    float acc[ATTC_COLS][4], s[ATTC_TILES][4], dp[ATTC_TILES][4];
    mma_zero(acc);
    int nk = att_keys_seen(causal, lk, at.last);
    for (int j0 = 0; j0 < nk; j0 += ATT_TILE) {
        int n = nk - j0 < ATT_TILE ? nk - j0 : ATT_TILE;
        __syncthreads();
        mma_stage(k, bk, has_bias, kstart[b], j0, n, hk, h, K, sk);
        mma_stage(v, bv, has_bias, kstart[b], j0, n, hk, h, K, sv);
        __syncthreads();
        mma_rows_by_tile(s, qf, sk, K);
        mma_rows_by_tile(dp, df, sv, K);
#pragma unroll
        for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int key = 8 * nt + 2 * tig + (i & 1), u = i >> 1, row = first + gid + 8 * u;
                A p = key < n && (!causal || j0 + key <= row) ? a_exp(s[nt][i] * scale - ls[u]) : (A)0;
                s[nt][i] = scale * (p * (dp[nt][i] - dd[u]));
            }
        mma_tile_by_rows(acc, s, sk, K);
    }
    A one[2] = {1, 1};
    mma_write(dq, acc, one, r0, rows, hk, h, K);
}

// The backward's key blocks on tensor cores: per tile of queries (staged with their output gradients, lse and delta,
// computed by mma_delta as the query blocks compute it: the same bits), s = scale k q^T and dp = v dout^T,
// p = exp(s - lse), dv += p dout, dk += (scale p (dp - delta)) q.
__device__ void att_mma_backward_kv(int block, const T* q, const T* k, const T* v, const T* bq, const T* bk,
                                    const T* bv, int has_bias, const int* qstart, const int* qlen, const int* kstart,
                                    const int* klen, const T* out, const T* dout, const A* lse, T* dk, T* dv, int H,
                                    int K, int chunks, int causal, A scale, long long nq, T* sq, T* sdo, A* sls,
                                    A* sdd) {
    MmaPlace at = mma_place(block, chunks, H, klen);
    if (at.past) return;
    int b = at.b, h = at.h, first = at.first, lq = qlen[b], hk = H * K, rows = klen[b] - at.first;
    int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    long long r0 = (long long)kstart[b] + first, q0 = qstart[b];
    mma_u32 kf[ATTC_STEPS][4], vf[ATTC_STEPS][4];
    mma_rows(kf, k, bk, has_bias, r0, rows, hk, h, K);
    mma_rows(vf, v, bv, has_bias, r0, rows, hk, h, K);
    float dka[ATTC_COLS][4], dva[ATTC_COLS][4], s[ATTC_TILES][4], dp[ATTC_TILES][4];
    mma_zero(dka);
    mma_zero(dva);
    int block_first = first - warp * ATT_ROWS;                      // the block's first key row
    for (int i0 = causal ? block_first : 0; i0 < lq; i0 += ATT_TILE) {   // causal: no query before it sees its keys
        int n = lq - i0 < ATT_TILE ? lq - i0 : ATT_TILE;
        __syncthreads();
        // each query's delta by a warp, as the query blocks do: warp w takes the tile's rows MMA_DELTAS (w + u warps)
        // on, every warp the same number of rounds u (rows at or past n, or past the tile: 0)
        for (int i = warp * MMA_DELTAS; i < warp * MMA_DELTAS + ATT_TILE; i += warps * MMA_DELTAS) {
            A d[MMA_DELTAS];
            mma_deltas(d, dout, out, q0 + i0 + i, n - i, hk, h, K);   // rows at or past n (all of i >= ATT_TILE): 0
#pragma unroll
            for (int j = 0; j < MMA_DELTAS; ++j)
                if ((threadIdx.x & 31) == 0 && i < ATT_TILE) sdd[i + j] = d[j];
        }
        for (int i = threadIdx.x; i < ATT_TILE; i += blockDim.x)
            sls[i] = i < n ? lse[(long long)h * nq + q0 + i0 + i] : (A)0;
        mma_stage(q, bq, has_bias, q0, i0, n, hk, h, K, sq);
        mma_stage(dout, dout, 0, q0, i0, n, hk, h, K, sdo);
        __syncthreads();
        mma_rows_by_tile(s, kf, sq, K);
        mma_rows_by_tile(dp, vf, sdo, K);
#pragma unroll
        for (int nt = 0; nt < ATTC_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int query = 8 * nt + 2 * tig + (i & 1), key = first + gid + 8 * (i >> 1);
                A p = query < n && (!causal || key <= i0 + query) ? a_exp(s[nt][i] * scale - sls[query]) : (A)0;
                s[nt][i] = p;
                dp[nt][i] = scale * (p * (dp[nt][i] - sdd[query]));
            }
        mma_tile_by_rows(dva, s, sdo, K);
        mma_tile_by_rows(dka, dp, sq, K);
    }
    A one[2] = {1, 1};
    mma_write(dk, dka, one, r0, rows, hk, h, K);
    mma_write(dv, dva, one, r0, rows, hk, h, K);
}
#endif

// The tensor-core kernels, with attention_rows_forward's and attention_rows_backward's arguments; blocks of W warps
// (mma_place), a grid of ceil(chunks / W) blocks a sentence and head (a kind) where the CUDA-core kernels take chunks.
// Their bodies are empty where there are no tensor-core products of T (float64) or none before sm_80:
// kernels.attention_rows launches them only where they are not (and in float32 only where products run on TF32).
extern "C" __global__ void attention_rows_forward_mma(const T* q, const T* k, const T* v, const T* bq, const T* bk,
                                                      const T* bv, int has_bias, const int* qstart, const int* qlen,
                                                      const int* kstart, const int* klen, T* out, A* lse, int H, int K,
                                                      int chunks, int causal, A scale, long long nq) {
#if ATT_MMA_HERE
    __shared__ Vec words[2 * ATT_TILE * ATTC_LD / VEC];   // the staged keys and values (T values, 16-byte aligned)
    T* tiles = (T*)words;
    att_mma_forward(q, k, v, bq, bk, bv, has_bias, qstart, qlen, kstart, klen, out, lse, H, K, chunks, causal, scale,
                    nq, tiles, tiles + ATT_TILE * ATTC_LD);
#endif
}

extern "C" __global__ void attention_rows_backward_mma(const T* q, const T* k, const T* v, const T* bq, const T* bk,
                                                       const T* bv, int has_bias, const int* qstart, const int* qlen,
                                                       const int* kstart, const int* klen, const T* out, const T* dout,
                                                       const A* lse, T* dq, T* dk, T* dv, int H, int K, int qchunks,
                                                       int kchunks, int count, int causal, A scale, long long nq) {
#if ATT_MMA_HERE
    __shared__ Vec words[2 * ATT_TILE * ATTC_LD / VEC];   // keys and values, or queries and their dout (T values)
    T* tiles = (T*)words;
    __shared__ A rows[2 * ATT_TILE];              // the staged queries' lse and delta
    T *t0 = tiles, *t1 = tiles + ATT_TILE * ATTC_LD;
    int warps = blockDim.x >> 5, kind;            // the blocks of each kind a sentence and head: mma_place's groups
    int block = att_backward_block(blockIdx.x, (qchunks + warps - 1) / warps, (kchunks + warps - 1) / warps, &kind);
    if (!kind)
        att_mma_backward_q(block, q, k, v, bq, bk, bv, has_bias, qstart, qlen, kstart, klen, out, dout, lse, dq,
                           H, K, qchunks, causal, scale, nq, t0, t1);
    else
        att_mma_backward_kv(block, q, k, v, bq, bk, bv, has_bias, qstart, qlen, kstart, klen, out, dout,
                            lse, dk, dv, H, K, kchunks, causal, scale, nq, t0, t1, rows, rows + ATT_TILE);
#endif
}
"""


ATT_G, ATT_KMAX, ATT_ROWS = 4, 64, 16   # the attention_rows kernels' threads a row, most K, rows a block
ATT_BLOCK = ATT_G * ATT_ROWS


def attention_rows_ok(x, d_k):
    """Whether attention runs as the attention_rows kernels (on packed rows, no [B, H, T, S] scores):
    MINITF_FUSED_ATTN=1 (off by default: slower or no faster on an H200), the fused path, the attention's route
    through cuBLAS (MINITF_CUBLAS not 0: the layer reaches these kernels only on it, gemm.enabled) and d_k <= ATT_KMAX. The caller
    also needs both sides' packing.Spans and no attention dropout. (With MINITF_CUBLAS=0 the model had left out the
    decoder's causal bias for kernels the layer then did not run: a NaN loss.)"""
    return switched_on("MINITF_FUSED_ATTN") and not switched_off("MINITF_CUBLAS") and enabled(x) and d_k <= ATT_KMAX


MMA_WARPS = 3        # the tensor-core kernels: at most this many warps a block (one a chunk of ATT_ROWS rows): a
# sentence of up to 48 rows (the report's batch: 26-44) in one block. A multiprocessor holds whole blocks, so the
# registers (sm_90) leave it these warps with blocks of 1 / 3 / 4 warps: float16 forward 16 / 15 / 16, bfloat16
# forward 15 / 15 / 12, float32 forward 12-13 (shared memory) / 15 / 16, every backward 12 / 12 / 12 but float32's
# 9 / 9 / 8
MMA_KERNELS = ("attention_rows_forward_mma", "attention_rows_backward_mma")   # empty in float64
_ARCH = {}           # device id -> compute capability (e.g. 90), looked up once


def _arch(x):
    """The compute capability (major * 10 + minor) of the current device, where x's kernels launch; arrays the CPU
    emulator runs (NumPy's) count as 80."""
    if not backend.is_gpu(backend.xp_of(x)):
        return 80
    dev = backend.cupy.cuda.Device()
    arch = _ARCH.get(dev.id)
    if arch is None:
        arch = _ARCH[dev.id] = backend.gpu_arch()
    return arch


def tf32():
    """Whether float32 products run on TF32 tensor cores: the environment sets CUPY_TF32 to a positive number (as
    for CuPy's own matmul; gemm.compute_type, the attention's tensor-core kernels)."""
    return int(os.environ.get("CUPY_TF32", "0") or 0) > 0


def attention_tensor_cores(x, d_k):
    """Whether attention_rows and its backward run on tensor cores (attention_rows_forward_mma and
    attention_rows_backward_mma: mma.sync with float32 sums): float16 or bfloat16 arrays (16-bit operands), or
    float32 ones where float32 products run on TF32 (`tf32`: TF32 operands), d_k a multiple of 16 (and <=
    ATT_KMAX), a device of compute capability 8.0 or newer, unless the environment sets MINITF_FUSED_ATTN_MMA=0
    (then the CUDA-core kernels run, for comparisons)."""
    name = dtype_name(x.dtype)
    return ((name in ("float16", "bfloat16") or name == "float32" and tf32()) and d_k % 16 == 0
            and d_k <= ATT_KMAX and not switched_off("MINITF_FUSED_ATTN_MMA") and _arch(x) >= 80)


def _attention_kernel(name, q, h, chunks, *arrays):
    """(kernel, threads a block, chunks a block) for attention_rows' `name`: its tensor-core form (name + "_mma")
    where attention_tensor_cores says so and every array of `arrays` starts on a 16-byte boundary, a block of
    min(MMA_WARPS, chunks) warps, a chunk of ATT_ROWS rows each (chunks: the most a sentence and head has of a kind:
    the block stages each tile once for them all); else name itself, a block a chunk."""
    if attention_tensor_cores(q, q.shape[1] // h) and _aligned(*arrays):
        warps = max(1, min(MMA_WARPS, chunks))
        return name + "_mma", 32 * warps, warps
    return name, ATT_BLOCK, 1


def _attention_args(q, k, v, biases, spans_q, spans_kv):
    xp = backend.xp_of(q)
    has_bias = biases is not None
    bq, bk, bv = biases if has_bias else (q, q, q)
    return (q, k, v, _as(bq, q.dtype), _as(bk, q.dtype), _as(bv, q.dtype), np.int32(has_bias), spans_q.start,
            spans_q.length, spans_kv.start, spans_kv.length), xp


def attention_rows(q, k, v, biases, spans_q, spans_kv, h, causal, scale):
    """(out, lse): softmax(scale (q + bq)(k + bk)^T + mask)(v + bv) per sentence and head on packed rows,
    the mask that of the padding (a sentence's keys are its own rows) and, with `causal`, of later
    positions. q [rows_q, H*K] (the query side's kept rows: N_t in the decoder, N_s in the encoder), k and v
    [rows_kv, H*K] (the key side's; in a self-attention the same rows) C-contiguous (the projections'
    outputs; biases (bq, bk, bv) each [H*K], or None); spans_q, spans_kv: packing.Spans of the two sides. On tensor
    cores where attention_tensor_cores says so and q, k, v start on 16-byte boundaries (else on CUDA cores).
    out [rows_q, H*K] (heads side by side, as pack_heads writes them), lse [H, rows_q] in the accumulation
    dtype (what the backward needs besides q, k, v and out). One launch."""
    args, xp = _attention_args(q, k, v, biases, spans_q, spans_kv)
    nq, hk = q.shape
    out = xp.empty_like(q)
    lse = xp.empty((h, nq), dtype=accum_dtype(q.dtype))
    chunks = -(-spans_q.most // ATT_ROWS)
    kernel, block, per = _attention_kernel("attention_rows_forward", q, h, chunks, q, k, v)
    _launch(kernel, q.dtype, spans_q.count * h * -(-chunks // per), block,
            args + (out, lse, np.int32(h), np.int32(hk // h), np.int32(chunks), np.int32(bool(causal)),
                    accum_dtype(q.dtype)(scale), np.int64(nq)))
    return out, lse


def attention_rows_backward(dout, out, lse, q, k, v, biases, spans_q, spans_kv, h, causal, scale, dq, dk, dv):
    """The backward of attention_rows: dq [rows_q, H*K], dk and dv [rows_kv, H*K] (C-contiguous arrays, written)
    from dout = dL/dout and the forward's out and lse. One launch: blocks over the query rows (dq, from each
    row's sum(dout * out)) and blocks over the key rows (dk, dv, the same sums computed again as they stage
    the queries)."""
    args, xp = _attention_args(q, k, v, biases, spans_q, spans_kv)
    nq, hk = q.shape
    qchunks, kchunks = -(-spans_q.most // ATT_ROWS), -(-spans_kv.most // ATT_ROWS)
    kernel, block, per = _attention_kernel("attention_rows_backward", q, h, max(qchunks, kchunks), q, k, v, dout)
    _launch(kernel, q.dtype, spans_q.count * h * (-(-qchunks // per) + -(-kchunks // per)), block,
            args + (out, dout, lse, dq, dk, dv, np.int32(h), np.int32(hk // h), np.int32(qchunks), np.int32(kchunks),
                    np.int32(spans_q.count), np.int32(bool(causal)), accum_dtype(q.dtype)(scale), np.int64(nq)))
    return dq, dk, dv


# ----------------------------------------------------------------------------- Adam and the update's outcome
# One Adam(W) kernel over the flat buffers, and the update's outcome (finite gradients, the loss scale)
# decided on the device (paper 5.3).
ADAM = r"""
// One Adam(W) update of element i of the flat buffers, optim.Adam._update's passes in one:
// g = grad * inv_scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p *= decay (1 - lr * lambda);
// p -= (m / (sqrt(v) * rbc2 + eps)) * step (rbc2 = 1 / sqrt(1 - b2^t), step = lr / (1 - b1^t));
// copy = p (has_copy: the 16-bit, float16 or bfloat16, compute copy of the float32 master weights).
// has_ctl: the update's outcome from update_check instead: nothing is written unless ctl[3] (the loss
// and every gradient finite), and inv_scale is ctl[2].
extern "C" __global__ void adam_update(const T* grad, A* m, A* v, A* p, T* copy, int has_copy, long long n,
                                       const A* ctl, int has_ctl, A inv_scale, A b1, A one_minus_b1, A b2,
                                       A one_minus_b2, A decay, A rbc2, A eps, A step) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    A ok = has_ctl ? ctl[3] : (A)1;
    if (has_ctl) inv_scale = ctl[2];
    if (i < n) {
        // every load before the first store and the outcome's test (the compiler keeps a load behind a store to
        // memory it cannot tell apart, and behind the test): one wait on memory, not three
        A gi = (A)grad[i], m0 = m[i], v0 = v[i], p0 = p[i];
        if (ok == (A)0) return;
        A g = gi * inv_scale;
        A mi = m0 * b1 + g * one_minus_b1;
        A vi = v0 * b2 + (g * g) * one_minus_b2;
        m[i] = mi;
        v[i] = vi;
        A pi = p0 * decay;
        pi -= (mi / (a_sqrt(vi) * rbc2 + eps)) * step;
        p[i] = pi;
        if (has_copy) copy[i] = (T)pi;
    }
}

// An update's outcome, decided on the device (the host reads it an update later: no sync), in ONE
// launch. Each block scans its share of the gradient grad [n] for a value that is not finite and
// counts itself in counter[1]; the last block to finish (a ticket from counter[0] after a memory
// fence, as column_sums_into) reads the update's loss and NLL sums (loss_sum[0], nll_sum[0]) and writes ctl:
//   ctl[0] the loss scale, ctl[1] the good updates since it last changed (both: optim.LossScaler's
//   rules, has_scaler; else they stay 1 and 0), ctl[2] = 1 / the scale this update's backward used,
//   ctl[3] ok = the loss and every gradient finite (adam_update steps only then), ctl[4], ctl[5] the
//   loss and NLL sums, ctl[6] grads finite, ctl[7] loss finite;
// then it sets both counters back to 0 for the next launch.
extern "C" __global__ void update_check(const T* grad, long long n, const A* loss_sum, const A* nll_sum, A* ctl,
                                        unsigned int* counter, int has_scaler, A growth_interval, A min_scale) {
    __shared__ int bad;
    __shared__ int last;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    int mine = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        if (!a_finite((A)grad[i])) mine = 1;
    if (mine) bad = 1;                             // every writer writes 1
    __syncthreads();
    if (threadIdx.x == 0) {
        if (bad) atomicAdd(counter + 1, 1u);
        __threadfence();                           // this block's count is visible before its ticket
        last = atomicAdd(counter, 1u) == gridDim.x - 1u;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {                // every block has counted
        __threadfence();
        A loss = loss_sum[0], scale = ctl[0], good = ctl[1];
        int grads_ok = atomicAdd(counter + 1, 0u) == 0u, loss_ok = a_finite(loss);
        ctl[2] = (A)1 / scale;
        ctl[3] = (A)(grads_ok && loss_ok);
        ctl[4] = loss;
        ctl[5] = nll_sum[0];
        ctl[6] = (A)grads_ok;
        ctl[7] = (A)loss_ok;
        if (has_scaler && loss_ok) {               // a non-finite loss leaves the scale as it is
            if (!grads_ok) {                       // an overflow: halve the scale (not below min_scale)
                scale = scale * (A)0.5 < min_scale ? min_scale : scale * (A)0.5;
                good = 0;
            } else if (good + 1 == growth_interval) {   // growth_interval good updates in a row: double it
                scale = scale * 2;
                good = 0;
            } else {
                good = good + 1;
            }
            ctl[0] = scale;
            ctl[1] = good;
        }
        counter[0] = 0u;
        counter[1] = 0u;
    }
}
"""


def adam_update(grad, m, v, p, copy, coef, ctl=None):
    """One fused Adam(W) update of the flat buffers: grad (the model's dtype), m, v, p (the
    accumulation dtype: the master weights), and copy (the 16-bit compute copy of p, float16 or bfloat16, or None).
    coef = (inv_scale, b1, b2, decay, rbc2, eps, step) as optim.Adam computes them. ctl: update_check's
    outcome on the device (then the update is made only if it says ok, with its inv_scale)."""
    inv_scale, b1, b2, decay, rbc2, eps, step = coef
    a = accum_dtype(grad.dtype)
    n = grad.size
    _launch("adam_update", grad.dtype, -(-n // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
            (grad, m, v, p, grad if copy is None else copy, np.int32(copy is not None), np.int64(n),
             m if ctl is None else ctl, np.int32(ctl is not None), a(inv_scale),
             a(b1), a(1.0 - b1), a(b2), a(1.0 - b2), a(decay), a(rbc2), a(eps), a(step)))


CHECK_BLOCKS = 1024   # update_check's blocks (a grid-stride scan of the gradient)


def update_check(grad, loss_sum, nll_sum, ctl, counter, scaler=None):
    """The update's outcome on the device in one launch (the kernel's comment says what ctl [8]
    then holds): grad the flat gradient (the model's dtype), loss_sum and nll_sum the update's sums
    (device scalars in the accumulation dtype), ctl ([8], the accumulation dtype) and counter (uint32 [2],
    zeros; the launch leaves it at 0), both kept between updates; scaler: the optim.LossScaler whose growth_interval
    and min_scale apply (None: no loss scaling)."""
    a = accum_dtype(grad.dtype)
    n = grad.size
    grid = max(1, min(CHECK_BLOCKS, -(-n // ELEMENTWISE_BLOCK)))
    _launch("update_check", grad.dtype, grid, ELEMENTWISE_BLOCK,
            (grad, np.int64(n), loss_sum, nll_sum, ctl, counter, np.int32(scaler is not None),
             a(scaler.growth_interval if scaler else 1), a(scaler.min_scale if scaler else 1.0)))


# ----------------------------------------------------------------------------- the embedding
# The embedding of the kept rows (times sqrt(D), plus the positional encoding, dropout) and its gradient
# summed per id in a fixed order (paper 3.4, 3.5).
EMBEDDING = r"""
// The embedding of the kept rows, one thread per element of out [n / d, d]: row r at position
// pos = rowpos[r] (has_rows; else r) of the padded [B, L] batch, l = pos % L:
// out = (weight[ids[pos]] * scale + pe[l]) * mask, mask = dropout_keep(key, pos, d, c, thresh, dscale) as
// dropout_add draws it (has_drop; else no dropout). The mask is not stored: embedding_backward draws it again.
extern "C" __global__ void embed_rows(const T* weight, const long long* ids, const long long* rowpos, int has_rows,
                                      const T* pe, T* out, int has_drop, unsigned long long key, int thresh,
                                      A dscale, long long n, int d, int L, A scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long r = i / d;
        int c = (int)(i - r * d);
        long long pos = has_rows ? rowpos[r] : r;
        long long l = pos % L;
        T e = (T)((A)weight[ids[pos] * d + c] * scale);
        T y = (T)((A)e + (A)pe[l * d + c]);
        if (has_drop) y = (T)((A)y * dropout_keep(key, (unsigned long long)pos, d, c, thresh, dscale));
        out[i] = y;
    }
}

// The embedding's gradient from the kept rows' gradients dx [rows, d] (times the dropout mask: read from mask,
// has_mask 1, or drawn again from its key as embed_rows drew it, has_mask 2: rowpos, has_rows, key, thresh, dscale):
// grad[row] += scale * the sum of (dx * mask)[r] over the rows r holding that row's id, in a fixed order
// (deterministic: no atomics). plan (int64, built on the host by kernels.embedding_plan):
// starts [u + 1], then the u distinct ids, then the rows sorted by id (stably). One block per id. The id's rows
// (and their positions, for a drawn mask) are staged EMB_CHUNK at a time in shared memory by the whole block, so a
// thread's loop over them reads dx without first waiting for the row's number (a frequent id, "</s>" or ",", has
// hundreds of rows in a batch); each column's rows are added in the same order as before.
#define EMB_CHUNK 256
extern "C" __global__ void embedding_backward(const T* dx, const T* mask, int has_mask, const long long* plan, int u,
                                              T* grad, int d, A scale, const long long* rowpos, int has_rows,
                                              unsigned long long key, int thresh, A dscale) {
    __shared__ long long rows_s[EMB_CHUNK];
    __shared__ unsigned long long pos_s[EMB_CHUNK];
    const long long* starts = plan;
    const long long* uniq = plan + u + 1;
    const long long* order = plan + 2 * (long long)u + 1;
    long long s0 = starts[blockIdx.x], s1 = starts[blockIdx.x + 1];
    long long row = uniq[blockIdx.x];
    for (int c0 = 0; c0 < d; c0 += blockDim.x) {      // every thread runs every loop (the barriers)
        int c = c0 + (int)threadIdx.x;
        A acc = 0;
        for (long long j0 = s0; j0 < s1; j0 += EMB_CHUNK) {
            int n = s1 - j0 < EMB_CHUNK ? (int)(s1 - j0) : EMB_CHUNK;
            __syncthreads();                           // the last chunk's rows are read
            for (int k = threadIdx.x; k < n; k += blockDim.x) {
                long long r = order[j0 + k];
                rows_s[k] = r;
                pos_s[k] = has_mask == 2 ? (unsigned long long)(has_rows ? rowpos[r] : r) : 0ULL;
            }
            __syncthreads();
            if (c < d)
                for (int k = 0; k < n; k++) {
                    long long r = rows_s[k], i = r * d + c;
                    acc += has_mask ? (A)(T)((A)dx[i] * mask_at(has_mask, mask, r * d, pos_s[k], key, d, c, thresh,
                                                                dscale))
                                    : (A)dx[i];
                }
        }
        if (c < d) grad[row * d + c] = (T)((A)grad[row * d + c] + acc * scale);
    }
}
"""


def embedding_plan(ids, keep_index, xp):
    """The host-built plan of embedding_backward: ids [B, L] host ints, keep_index the kept
    positions (packing.Rows.host_index, or None for all): int64 [u + 1 + u + rows] on xp's device
    (one host->device copy), and u, the number of distinct ids."""
    flat = np.asarray(ids).reshape(-1)
    kept = flat if keep_index is None else flat[keep_index]
    small = kept.size and 0 <= kept.min() and kept.max() < 1 << 16   # the same order by a radix sort, ~15x faster
    # for 23,000 ids on the 2-core CPU (docs/benchmarks.md)
    order = np.argsort(kept.astype(np.uint16) if small else kept, kind="stable")
    sorted_ids = kept[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_ids[1:] != sorted_ids[:-1]])) if len(kept) else \
        np.zeros(0, dtype=np.int64)
    u = len(starts)
    plan = np.concatenate([starts, [len(kept)], sorted_ids[starts], order]).astype(np.int64)
    return backend.to_device(plan, xp), u


def embed_rows(weight, ids, rows, length, pe, scale, key, p):
    """(out [rows, D], mask): the rows of (weight[ids] * scale + pe[position]) * mask at the kept positions
    (rows: packing.Rows, or None for every position of ids [B, L]); key/p: the dropout site's hash key and
    rate (key None: no dropout, mask None). The mask is a KeyedMask (no [rows, D] array: embedding_backward
    draws it again)."""
    xp = backend.xp_of(weight)
    b = ids.shape[0]
    n_rows = b * length if rows is None else len(rows.host_index)
    d = weight.shape[1]
    out = xp.empty((n_rows, d), dtype=weight.dtype)
    a = accum_dtype(weight.dtype)
    n = n_rows * d
    _launch("embed_rows", weight.dtype, -(-n // ELEMENTWISE_BLOCK), ELEMENTWISE_BLOCK,
            (weight, xp.ascontiguousarray(ids, dtype=np.int64),
             _placeholder(xp, np.int64) if rows is None else rows.index, np.int32(rows is not None), pe, out,
             np.int32(key is not None), np.uint64(key or 0),
             np.int32(0 if key is None else keep_threshold(p)), a(0.0 if key is None else 1.0 / (1.0 - p)),
             np.int64(n), np.int32(d), np.int32(length), a(scale)))
    return out, (None if key is None else KeyedMask(key, None if rows is None else rows.index, p))


def embedding_backward(dx, mask, plan, grad, scale):
    """grad [V, D] += scale * (the rows of dx [rows, D] (* mask) summed per id), plan = embedding_plan();
    mask: an array shaped as dx, a KeyedMask (drawn again here, embed_rows' bits), or None."""
    plan_array, u = plan
    d = grad.shape[1]
    a = accum_dtype(dx.dtype)
    mode, *drawn = _drawn_mask_args(backend.xp_of(dx), mask, a)
    _launch("embedding_backward", dx.dtype, u, _row_block(d),
            (dx, dx if mode != 1 else mask, mode, plan_array, np.int32(u), grad, np.int32(d), a(scale), *drawn))


# ----------------------------------------------------------------------------- the whole source
# The sections' CUDA in the order NVRTC reads it (each uses only what the prelude and the sections before it
# define); source(dtype) puts the dtype's typedefs and the prelude first.
KERNELS = SOFTMAX + LAYERNORM + LOSS + SUMS + HEADS + ATTENTION + ADAM + EMBEDDING


def declared_signatures(code):
    """{kernel name: [the C type of each parameter]} of the extern "C" __global__ kernels in CUDA source `code`,
    as their declarations give them ("const" left out: what a launch passes), e.g. "T*", "long long", "A"."""
    found = {}
    for name, params in re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                                   r'(\w+)\s*\(([^)]*)\)', code):
        words = [[w for w in p.replace("*", " * ").split() if w != "const"] for p in params.split(",")]
        found[name] = [" ".join(w[:-1]).replace(" *", "*") for w in words]
    return found


# kernels launched only under a switch that is off by default -> that switch (bench/gpu_ab.py times a copy of this
# file from before such a kernel existed under the defaults)
OPT_IN_KERNELS = {"add_partials": "MINITF_SPLITK"}

# kernel name -> the C types of its arguments, read from the kernels' declarations (the CPU emulator builds its
# launchers from them; tests/test_nvrtc.py holds them to the compiled PTX)
SIGNATURES = declared_signatures(KERNELS)
