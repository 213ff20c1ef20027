"""Matrix products on the GPU as single cuBLAS calls, addressed in place.

CuPy's `a @ b` on 4-d arrays copies every non-contiguous operand to contiguous memory, and for
float16 converts both operands to float32 and back around a float32 batched GEMM (CuPy 14,
`cupy/_core/_routines_linalg.pyx`). `matmul` below calls cuBLAS directly instead:

    c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i]      for i < batch

on row-major matrices described by where they lie (`Mat`: array, first element, rows,
columns, leading dimension, batch stride), with op = transpose or not as a cuBLAS flag, so
a transpose costs nothing, a scale goes into alpha, and beta = 1 accumulates into a gradient
buffer without a separate add. float16 and bfloat16 run on tensor cores with float32
accumulation (CUBLAS_COMPUTE_32F); float32 uses TF32 tensor cores when CUPY_TF32 is a positive number and the
GPU has them, compute capability 8.0 or newer (as CuPy's 2-d matmul does; its batched matmul runs full float32
whatever CUPY_TF32 says: docs/performance.md), else full float32; float64 stays float64.

cuBLAS is column-major: a row-major matrix of r rows and q columns with leading dimension ld
is the column-major q x r matrix with the same ld. So the row-major c = op(a) op(b) is asked of
cuBLAS as the column-major c^T = op(b)^T op(a)^T: the operands swap places, each keeps its own
transpose flag, m is c's column count and n its row count.

`enabled(x)`: CuPy arrays on the fused path (kernels.enabled) unless the environment sets
MINITF_CUBLAS=0 (then CuPy's own matmul runs, for comparisons). tests/strict_cupy.py
models these cuBLAS calls on NumPy (column-major semantics, leading dimensions, strides,
pointer offsets, alpha and beta, transpose flags, compute type) and refuses misuse.
"""
import os
from typing import NamedTuple

import numpy as np

from . import backend, kernels
from .errors import ConfigError

# cuBLAS's and CUDA's enumerations (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
CUDA_TYPE = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
GEMM_DEFAULT = -1


class Mat(NamedTuple):
    """A batch of row-major matrices inside `array`: matrix i's element (r, c) is element
    offset + i * stride + r * ld + c of the array's memory (in elements)."""
    array: object
    rows: int
    cols: int
    ld: int
    stride: int = 0
    offset: int = 0


def enabled(x):
    """Whether products on x go through `matmul` (CuPy arrays on the fused path)."""
    return backend.is_gpu(backend.xp_of(x)) and not kernels.switched_off("MINITF_CUBLAS") and kernels.enabled(x)


def _dtype_name(dtype):
    name = kernels.dtype_name(dtype)
    if name not in CUDA_TYPE:
        raise TypeError(f"gemm: no cuBLAS type for {name}")
    return name


def compute_type(dtype_name):
    """The cuBLAS compute type and the dtype of alpha/beta for a storage dtype. TF32 only on a GPU that has it
    (compute capability 8.0 or newer): before that, float32 products run in full float32, as CuPy's own matmul
    does there whatever CUPY_TF32 says (cupy/_core/_routines_linalg.pyx, set_compute_type)."""
    if dtype_name == "float64":
        return COMPUTE_64F, np.float64
    if dtype_name == "float32" and kernels.tf32() and backend.gpu_arch() >= 80:
        return COMPUTE_32F_FAST_TF32, np.float32
    return COMPUTE_32F, np.float32


# Looked up once, not on every product (the `--fp16` step makes ~340 of them, and their Python
# costs the host as much as cuBLAS's own calls): dtype -> (cuBLAS data type, compute type, the
# dtype of alpha and beta), with CUPY_TF32 read on a dtype's first product (CuPy too reads it
# once, at its first product of a dtype: cupy/_core/_routines_linalg.pyx, get_compute_type);
# (value, dtype) -> alpha or beta as a host scalar whose address cuBLAS reads (kept alive here).
_TYPES = {}
_SCALARS = {}


def choose_tf32(on=None):
    """Sets whether float32 products run on TF32 (CUPY_TF32, read by CuPy's own matmul at the process's first float32
    product, so this must come before it; by kernels.tf32 on every call; by `matmul` here at a dtype's first product,
    looked up again now): on=True or False sets it; None (training's default on a GPU) sets TF32 unless the
    environment already says (an empty value says nothing). Returns whether TF32 is on; a value that is not a whole
    number is a ConfigError, where CuPy would fail at its first float32 product."""
    told = os.environ.get("CUPY_TF32", "").strip()
    if on is not None or not told:
        os.environ["CUPY_TF32"] = "1" if on is None or on else "0"
    _TYPES.clear()
    try:
        return kernels.tf32()    # int() of the value, as CuPy reads it
    except ValueError:
        raise ConfigError(f"CUPY_TF32={told!r} in the environment: expected a whole number (1: float32 products on "
                          f"TF32 tensor cores, 0: in full float32), as CuPy reads it") from None


def _types(dtype):
    types = _TYPES.get(dtype)
    if types is None:
        name = _dtype_name(dtype)
        types = _TYPES[dtype] = (CUDA_TYPE[name],) + compute_type(name)
    return types


def _scalar(value, dtype):
    """(host scalar, its address): the array must live until the cuBLAS call has read it."""
    key = (value, dtype)
    s = _SCALARS.get(key)
    if s is None:
        a = np.array(value, dtype=dtype)
        s = (a, a.ctypes.data)
        if len(_SCALARS) < 256:            # alphas and betas are a handful of constants
            _SCALARS[key] = s
    return s


def _where(x):
    """(array, rows, cols, ld, batch stride, device address of the first element) of a Mat, or of a
    C-contiguous [..., rows, cols] array taken whole (batch = the product of the leading axes): one call
    per operand on the hot path."""
    if type(x) is Mat:
        arr = x.array
        return arr, x.rows, x.cols, x.ld, x.stride, arr.data.ptr + x.offset * arr.itemsize
    if not x.flags.c_contiguous:
        raise ValueError(f"gemm.matmul needs C-contiguous arrays (got strides {x.strides} for shape {x.shape})")
    shape = x.shape
    r, c = shape[-2], shape[-1]
    return x, r, c, c, r * c, x.data.ptr


def matmul(a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, batch=1):
    """c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i] for i < batch: ONE cuBLAS call.
    a, b, c: Mat (or C-contiguous [..., rows, cols] arrays, taken whole) of one dtype; c is written in
    place (with beta = 0 its old contents are never read) and returned."""
    a_arr, a_rows, a_cols, a_ld, a_stride, a_ptr = _where(a)
    b_arr, b_rows, b_cols, b_ld, b_stride, b_ptr = _where(b)
    c_arr, c_rows, c_cols, c_ld, c_stride, c_ptr = _where(c)
    rows, inner = (a_cols, a_rows) if trans_a else (a_rows, a_cols)       # op(a) [rows, inner]
    inner_b, cols = (b_cols, b_rows) if trans_b else (b_rows, b_cols)     # op(b) [inner, cols]
    if inner != inner_b or c_rows != rows or c_cols != cols:
        raise ValueError(f"gemm.matmul: op(a) {rows}x{inner} @ op(b) {inner_b}x{cols} -> c {c_rows}x{c_cols}")
    dt = c_arr.dtype
    if a_arr.dtype != dt or b_arr.dtype != dt:
        raise TypeError(f"gemm.matmul: one dtype for a, b, c (got {a_arr.dtype}, {b_arr.dtype}, {dt})")
    dtype, ctype, scalar = _types(dt)
    cuda = backend.cupy.cuda
    handle = cuda.device.get_cublas_handle()
    alpha_h, beta_h = _scalar(alpha, scalar), _scalar(beta, scalar)   # (host scalar, address): pointer mode host
    # row-major c = op(a) op(b)  <=>  column-major c^T = op(b)^T op(a)^T: b first, a second
    op_a, op_b = (OP_T if trans_a else OP_N), (OP_T if trans_b else OP_N)
    if batch == 1:
        cuda.cublas.gemmEx(handle, op_b, op_a, cols, rows, inner, alpha_h[1], b_ptr, dtype, b_ld, a_ptr, dtype, a_ld,
                           beta_h[1], c_ptr, dtype, c_ld, ctype, GEMM_DEFAULT)
    else:
        cuda.cublas.gemmStridedBatchedEx(handle, op_b, op_a, cols, rows, inner, alpha_h[1], b_ptr, dtype, b_ld,
                                         b_stride, a_ptr, dtype, a_ld, a_stride, beta_h[1], c_ptr, dtype, c_ld,
                                         c_stride, batch, ctype, GEMM_DEFAULT)
    return c_arr


def host_matmul(a, b):
    """a @ b by the array module, where `matmul` does not take them. Where the module has no product of the dtype's own,
    float32 copies are multiplied and the result rounded once to the dtype:
    - NumPy's float16: NumPy's own float16 product also adds in float32 (the same values, up to the order of the sums)
      but in a loop of its own, without BLAS: a `--fp16` step of a small model took 40 s on the CPU that way against
      0.17 s in float32 (the GPU's tensor cores likewise add float16 products in float32);
    - CuPy's bfloat16 over more than two axes: CuPy 14's matmul has no bfloat16 path there (it raises TypeError:
      cupy/_core/_routines_linalg.pyx takes bfloat16 for an integer type), as CuPy itself makes float16's."""
    if a.dtype == b.dtype and (a.dtype == np.float16 and type(a) is np.ndarray and type(b) is np.ndarray
                               or a.ndim > 2 and kernels.dtype_name(a.dtype) == "bfloat16"
                               and backend.is_gpu(backend.xp_of(a))):
        xp = backend.xp_of(a)
        return xp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
    return a @ b


def fits(*arrays):
    """Whether products of these arrays go through `matmul`: the fused path, one dtype, C-contiguous."""
    if not enabled(arrays[0]):
        return False
    dt = arrays[0].dtype
    for a in arrays:
        if a.dtype != dt or not a.flags.c_contiguous:
            return False
    return True


def product(a, b, trans_b=False):
    """a @ b (a @ b^T with trans_b) of 2-d arrays, a new array: ONE cuBLAS call where `fits`
    (CuPy's `@` costs the host more for the same GEMM), else the array module's matmul."""
    if not fits(a, b):
        return host_matmul(a, b.T if trans_b else b)
    out = backend.cupy.empty((a.shape[0], b.shape[0] if trans_b else b.shape[1]), dtype=a.dtype)
    return matmul(a, b, out, trans_b=trans_b)


def accumulate_xt_dy(dw, x2, dy2):
    """dw += x2^T @ dy2 (a Linear's weight gradient) as one GEMM with beta = 1 where `fits`: no
    product array, no separate add; else the array module's product and add. dw [I, O], x2 [rows, I],
    dy2 [rows, O]."""
    if fits(dw, x2, dy2):
        accumulate_at_b(x2, dy2, dw)
    else:
        dw += host_matmul(x2.T, dy2)
    return dw


# Split-K for the weight gradients (MINITF_SPLITK=1). dW = x^T dy over the batch's ~20,000 rows has a small output:
# 512 x 512 in `base` is 16 tiles of 128 x 128, 48 for the stacked q|k|v, against an H200's 132 multiprocessors, and
# on an H200 those products ran at 105-137 TFLOP/s, a quarter to a third of a square product's 394 (docs/benchmarks.md;
# cuBLAS spreads them wider than 16 multiprocessors, or they would run near 60). Split into `parts` runs of rows,
# each a product of its own in one strided-batched GEMM, more and smaller products may fill the GPU better; the
# switch stays off until a GPU has timed it. add_partials then adds the parts into dW.
SPLIT_TILE = 128       # the output tile the count of parts assumes
SPLIT_FILL = 128       # output tiles times parts aimed at (about an H100's or H200's multiprocessors)
SPLIT_MAX = 8          # parts at most
SPLIT_ROWS = 1024      # rows a part at least
SPLIT_DTYPES = ("float32", "float64")   # 16-bit products would need float32 parts from cuBLAS: not built


def split_parts(rows, out_rows, out_cols, dtype):
    """How many runs of rows a weight gradient's product over `rows` rows, of an out_rows x out_cols output, is split
    into: 1 (one GEMM) unless MINITF_SPLITK=1 and the dtype is float32 or float64; then the most that keep the
    output's 128 x 128 tiles times the parts at or below SPLIT_FILL, at most SPLIT_MAX, each at least SPLIT_ROWS
    rows."""
    if not kernels.switched_on("MINITF_SPLITK") or kernels.dtype_name(dtype) not in SPLIT_DTYPES:
        return 1
    tiles = -(-out_rows // SPLIT_TILE) * -(-out_cols // SPLIT_TILE)
    return max(1, min(SPLIT_MAX, SPLIT_FILL // tiles, rows // SPLIT_ROWS))


def _mat(x):
    """x as a Mat: itself, or a C-contiguous [..., rows, cols] array taken whole."""
    if type(x) is Mat:
        return x
    if not x.flags.c_contiguous:
        raise ValueError(f"gemm: a Mat of an array needs it C-contiguous (got strides {x.strides} for shape {x.shape})")
    r, c = x.shape[-2], x.shape[-1]
    return Mat(x, r, c, c, r * c)


def accumulate_at_b(a, b, c, batch=1):
    """c[i] += a[i]^T @ b[i] for i < batch (weight gradients: a [rows, I] the layer's input, shared with stride 0 by
    stacked projections, b [rows, O] the output's gradient, c [I, O] the gradient buffer, each a Mat or a C-contiguous
    array): ONE GEMM with beta = 1, or with split-K (split_parts) one strided-batched GEMM a plane over `parts` runs of
    rows into a kept buffer, and one add_partials launch adding them, and x^T dy over the rows left over, into c."""
    if not kernels.switched_on("MINITF_SPLITK"):   # the default: no Mats made on the hot path
        return matmul(a, b, c, trans_a=True, beta=1.0, batch=batch)
    a, b, c = _mat(a), _mat(b), _mat(c)
    rows, n_in, n_out = a.rows, a.cols, b.cols
    parts = split_parts(rows, n_in, n_out, c.array.dtype)
    if parts == 1 or c.ld != n_out:
        return matmul(a, b, c, trans_a=True, beta=1.0, batch=batch)
    if b.rows != rows or c.rows != n_in or c.cols != n_out:
        raise ValueError(f"gemm.accumulate_at_b: a^T {n_in}x{rows} @ b {b.rows}x{n_out} -> c {c.rows}x{c.cols}")
    run, m = rows // parts, n_in * n_out
    # the parts in c's dtype: split_parts splits float32 and float64 alone, their own accumulation dtypes
    part = kernels._partials(backend.xp_of(c.array), c.array.dtype, batch * parts * m, use="split")
    for i in range(batch):   # plane i's parts: rows [k * run, (k + 1) * run) of a and b, k < parts
        matmul(Mat(a.array, run, n_in, a.ld, run * a.ld, a.offset + i * a.stride),
               Mat(b.array, run, n_out, b.ld, run * b.ld, b.offset + i * b.stride),
               Mat(part, n_in, n_out, n_out, m, i * parts * m), trans_a=True, batch=parts)
    done = parts * run
    kernels.add_partials(part, parts, c.array, c.offset, c.stride, batch, m, n_out, a.array,
                         a.offset + done * a.ld, a.stride, a.ld, b.array, b.offset + done * b.ld, b.stride, b.ld,
                         rows - done)
    return c.array
