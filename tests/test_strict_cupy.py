"""tests/strict_cupy.py itself: it refuses what CuPy refuses (so that minitf's GPU path passing on
it means something), counts the transfers, and checks kernel arguments as CuPy passes them."""
import os
import re

import numpy as np
import pytest

import strict_cupy as cp
from minitf import kernels

from cuda_emulator import compiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_implicit_conversion_and_no_mixing_with_numpy():
    a = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    for mix in (lambda: a + np.ones(3), lambda: np.ones(3) * a, lambda: np.exp(a) - np.ones((2, 3)),
                lambda: a + np.array(1.0), lambda: cp.maximum(a, np.zeros(3)), lambda: cp.concatenate([a, np.ones((2, 3))]),
                lambda: np.concatenate([np.ones((2, 3)), a]), lambda: cp.ascontiguousarray(np.ones(3))):
        with pytest.raises(TypeError):
            mix()
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):   # CuPy's basic-index assignment
        a[0] = np.ones(3)
    with pytest.raises(TypeError, match="no implementation found"):    # NumPy functions CuPy lacks
        np.unique(a)
    # what CuPy accepts: NumPy/Python scalars, a 0-d NumPy array in a comparison, host index arrays
    assert (a * np.float32(2) + 1).dtype == np.float32 and (np.float32(2) * a).dtype == np.float32
    assert isinstance(a > np.array(1.0), cp.ndarray) and isinstance(np.exp(a), cp.ndarray)
    assert a[np.array([1, 0])].shape == (2, 3)


def test_reductions_and_integer_indexing_give_0d_device_arrays():
    a = cp.asarray(np.arange(6.0).reshape(2, 3))
    for r in (a.sum(), a.max(), a.mean(), a.argmax(), a.any(), cp.isfinite(a).all(), a[1, 2], a[0][1]):
        assert isinstance(r, cp.ndarray) and r.shape == (), r
    a[1, 2][...] = 40.0                          # CuPy's integer index is a view
    assert float(a.max()) == 40.0


def test_only_cupys_names_and_keywords():
    a = cp.zeros((2, 3), dtype=cp.float32)
    with pytest.raises(AttributeError, match="'unique'"):
        cp.unique
    with pytest.raises(AttributeError, match="'cumsum'"):
        a.cumsum()
    with pytest.raises(AttributeError, match="'at'"):
        cp.multiply.at
    for bad in (lambda: a.sum(where=a > 0), lambda: a.astype(cp.float16, casting="unsafe"),
                lambda: cp.exp(a, where=a > 0), lambda: cp.take_along_axis(a, cp.zeros((2, 3), dtype=cp.int64)),
                lambda: cp.argpartition(a, 1, kind="introselect"), lambda: cp.argsort(a, axis=0, order=None),
                lambda: cp.zeros_like(a, subok=True)):
        with pytest.raises(TypeError):
            bad()
    assert a.astype(cp.float32, copy=False) is a and a.sum(dtype=cp.float64, keepdims=True).shape == (1, 1)
    assert np.isnan(cp.empty(3).get()).all()     # CuPy's empty is not zeroed: NaN here, never silently 0
    # argpartition sorts fully and argsort is stable, as CuPy's
    x = cp.asarray(np.array([[3.0, 1.0, 2.0, 1.0]]))
    assert cp.argpartition(x, 1, axis=1).tolist() == [[1, 3, 2, 0]] == cp.argsort(x, axis=1).tolist()
    assert x.argsort(axis=1, kind="stable").tolist() == [[1, 3, 2, 0]] == cp.argsort(x, axis=1, kind=None).tolist()
    for bad in (lambda: cp.argsort(x, kind="quicksort"), lambda: x.argsort(kind="mergesort")):   # _check_kind_sort
        with pytest.raises(ValueError, match="kind can only be None or 'stable'"):
            bad()
    # ufunc.at only where CuPy has the atomics (_routines_indexing.pyx, _scatter_op_single)
    flags = cp.zeros(3, dtype=cp.int32)
    cp.bitwise_or.at(flags, cp.asarray(np.array([0, 2, 2])), 5)
    assert flags.tolist() == [5, 0, 5]
    for dt, op in ((np.int16, cp.bitwise_or), (np.uint8, cp.bitwise_xor), (np.float32, cp.subtract)):
        with pytest.raises(TypeError, match="does not support"):
            op.at(cp.zeros(3, dtype=dt), cp.asarray(np.array([0, 2])), 1)


def test_transfers_are_counted_with_their_call_site():
    a = cp.asarray(np.arange(4.0))
    with cp.count_transfers() as t:
        len(a), a.shape, a.sum() + 1                       # none
        float(a.sum())
        int(a.argmax())
        if a[0] > 1:
            pass
        a.tolist(), a.get(), cp.asnumpy(a), a[:1].item()
        cp.flatnonzero(a > 1)                              # CuPy reads the count back
        a[a > 1]                                           # ... as it does for a boolean mask
        cp.asarray(np.ones(2))                             # host -> device
    kinds = [d.split(" at ")[0] for d in t.d2h]
    assert kinds == ["float()", "int()", "bool() / `if array`", ".tolist()", ".get()", "asnumpy()", ".item()",
                     "implicit sync (flatnonzero: data-dependent shape)",
                     "implicit sync (boolean-mask index: data-dependent shape)"], kinds
    assert all("test_strict_cupy.py" in d for d in t.d2h) and len(t.h2d) == 1
    with cp.record_dtypes() as dtypes:
        (a.astype(cp.float32) * 2).sum()
    assert set(dtypes) == {"float32"}


def test_the_peak_of_live_device_bytes_counts_new_memory_and_what_was_freed():
    """record_peak_bytes: the live bytes at the start, then the most reached; a view takes no
    memory, a freed array's bytes no longer count, so reusing them raises no peak; a result NumPy
    gives as a view of a buffer of its own (an index array on a later axis) takes new memory."""
    keep = cp.zeros(100, dtype=np.float32)                       # 400 bytes, live before the block
    cols, col = cp.asarray(np.array([0, 2])), cp.asarray(np.array([1]))   # index arrays, live before too
    with cp.record_peak_bytes() as rec:
        start = rec[0]
        a = cp.empty((10, 10), dtype=np.float64)                # +800
        _ = a.reshape(100)                                      # a view: +0
        del a, _
        b = cp.empty(100, dtype=np.float64)                     # +800 again, after a was freed
        c = cp.zeros(50, dtype=np.float32)                      # +200
        d = c.reshape(5, 10)[:, cols]                           # [5, 2] float32, new: +40
    assert start >= keep.nbytes + 24 and rec[1] - start == 800 + 200 + 40, (start, rec)
    with cp.record_allocations() as sites, cp.record_dtypes() as dtypes:
        e = d[:, col]                                           # new memory
        v = c.reshape(50)                                       # a view of a live array: none
        f = cp.ndarray((3,), dtype=np.float16)                  # the constructor: new memory
    assert sum(sites.values()) == 2 and set(dtypes) == {"float32", "float16"}
    del b, c, d, e, v, f


@pytest.mark.skipif(compiler() is None, reason="needs g++ >= 12 to emulate the CUDA kernels")
def test_kernel_arguments_are_checked_as_cupy_passes_them():
    """cuda/function.pyx: a Python int goes to a kernel as int64 and a float as float64, NumPy
    scalars with their dtype; grid and block are tuples. The C types come from the source."""
    mod = cp.RawModule(code=kernels.source(np.float32), options=("-std=c++14",))
    fn = mod.get_function("layernorm_forward")      # (const T* x, const A* g, const A* b, T* y, A* xhat, A* rstd, int d, A eps)
    x = cp.asarray(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))
    g, b, y, xhat = cp.ones(8, cp.float32), cp.zeros(8, cp.float32), cp.empty_like(x), cp.empty_like(x)
    rstd = cp.empty((3, 1), cp.float32)
    good = [x, g, b, y, xhat, rstd, np.int32(8), np.float32(1e-6)]
    for i, wrong, match in ((6, 8, "int64"), (7, 1e-6, "float64"), (7, np.float64(1e-6), "float64"),
                            (1, cp.ones(8, cp.float64), "points to float32"), (0, np.ones((3, 8), np.float32), "must be a cupy.ndarray")):
        args = list(good)
        args[i] = wrong
        with pytest.raises(TypeError, match=match):
            fn((3,), (8,), tuple(args))
    with pytest.raises(TypeError, match="tuples"):
        fn(3, 8, tuple(good))
    with pytest.raises(TypeError, match="options"):
        cp.RawModule(code=kernels.source(np.float32), options=["-std=c++14"])
    fn((3,), (8,), tuple(good))
    want = (x.get() - x.get().mean(-1, keepdims=True)) / np.sqrt(x.get().var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y.get(), want, rtol=1e-5, atol=1e-5)
    sums = mod.get_function("column_sums_into")     # compiled with __launch_bounds__(256, SUMS_BLOCKS): no more threads
    with pytest.raises(ValueError, match=r"512 threads per block, more than its __launch_bounds__ \(256\)"):
        sums((1,), (512,), tuple(range(18)))


def test_minitf_reaches_cupy_only_through_backend_cupy():
    """One monkeypatch of backend.cupy (or MINITF_CUPY_MODULE) moves all of minitf: no other module
    imports cupy, or binds backend's cupy to a name of its own at import time."""
    for folder, _, files in os.walk(os.path.join(ROOT, "minitf")):
        for name in files:
            if name.endswith(".py") and name != "backend.py":
                text = open(os.path.join(folder, name)).read()
                assert not re.search(r"^\s*(import cupy|from cupy)", text, re.M), name
                assert not re.search(r"from \.+backend import [^\n]*\bcupy\b", text), name


def test_triu_of_bfloat16_comes_back_float32_as_cupys_does(monkeypatch):
    """CuPy 14's triu goes through `where`, which has no bfloat16 loop: a bfloat16 array comes back float32. The
    stand-in does the same, so minitf's causal mask (made on the host, moved in one copy) is held to its dtype."""
    from minitf import backend
    from minitf.masks import causal_bias
    monkeypatch.setattr(backend, "cupy", cp)
    bf16 = np.dtype("bfloat16")
    assert cp.triu(cp.ones((3, 3), dtype=bf16), k=1).dtype == np.float32
    assert cp.triu(cp.ones((3, 3), dtype=np.float16), k=1).dtype == np.float16
    bias = causal_bias(4, cp, bf16)
    assert isinstance(bias, cp.ndarray) and bias.dtype == bf16
    host = cp.asnumpy(bias).astype(np.float32)
    assert np.array_equal(host == 0, np.tril(np.ones((4, 4), bool))) and (host[np.triu_indices(4, 1)] < -1e8).all()


def test_16_bit_sums_add_in_float32_and_every_sum_like_a_tree_as_cupys():
    """CuPy 14's sum and mean of a bfloat16 or float16 array add in float32 and round once (NumPy with ml_dtypes adds
    bfloat16 in bfloat16, where 10,000 ones sum to 256; NumPy adds a float16 array's rows in float16), and CuPy's
    reductions add like a tree (a block's threads, then the blocks) where NumPy adds a leading axis one row at a time:
    the stand-in does the same, so minitf's unfused bias gradients are as exact on it as on a GPU (at the GPU tests'
    real sizes, 3,000 rows, the fused column sums are held to the unfused ones within 2e-3 in float16, 1e-6 in
    float32)."""
    bf16 = np.dtype("bfloat16")
    x = cp.ones((10000, 4), dtype=bf16)
    assert x.sum(axis=0).dtype == bf16 and (cp.asnumpy(x.sum(axis=0)).astype(np.float32) == 9984).all()  # 10,000 in bf16
    assert float(cp.asnumpy(x.mean()).astype(np.float32)) == 1.0
    out = cp.zeros(4, dtype=bf16)
    assert x.sum(axis=0, out=out) is out and (cp.asnumpy(out).astype(np.float32) == 9984).all()
    with pytest.raises(ValueError, match="Out shape is mismatched"):   # not broadcast into it
        x.sum(axis=0, out=cp.zeros((2, 4), dtype=bf16))
    assert x.sum(dtype=np.float32).dtype == np.float32 and float(cp.asnumpy(x.sum(dtype=np.float32))) == 40000
    assert float(cp.asnumpy(x.sum(axis=0, dtype=bf16)).astype(np.float32)[0]) == 9984     # _sum_keep_dtype: float sums
    assert cp.asnumpy(cp.ones((3, 2), dtype=np.float16).sum(axis=1, keepdims=True)).shape == (3, 1)
    # float16: 4,000 ones are 4,000 when added in float32 (2,048 in float16, where 2,048 + 1 rounds back to 2,048)
    h = cp.ones((4000, 3), dtype=np.float16)
    assert h.sum(axis=0).dtype == np.float16 and (cp.asnumpy(h.sum(axis=0)) == 4000).all()
    assert (cp.asnumpy(h.sum(axis=(0, 1), keepdims=True)) == np.float16(12000)).all() and h.sum().shape == ()
    # every float sum like a tree: 3,000 rows' column sums in float32 within 3e-7 of float64's (row by row: ~1e-6)
    host = np.random.default_rng(0).standard_normal((3000, 512)).astype(np.float32)
    exact = host.astype(np.float64).sum(axis=0)
    for got in (cp.asnumpy(cp.asarray(host).sum(axis=0)), cp.asnumpy(cp.asarray(host).mean(axis=0)) * 3000):
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 3e-7
    # axes refused as NumPy and CuPy refuse them: out of range, repeated, any axis of a 0-d array
    for bad, error in (((2,), np.exceptions.AxisError), ((-3,), np.exceptions.AxisError), (((1, 5),), np.exceptions.AxisError),
                       (((0, 0),), ValueError), (((0, -2),), ValueError)):
        with pytest.raises(error):
            cp.ones((3, 4), dtype=np.float32).sum(*bad)
    with pytest.raises(np.exceptions.AxisError):
        cp.ones((), dtype=np.float16).mean(axis=0)


@pytest.mark.parametrize("takes_a_float", [False, True], ids=["ml_dtypes<0.7", "ml_dtypes>=0.7"])
def test_bfloat16_with_a_python_float_matmul_and_argpartition_as_cupys(monkeypatch, takes_a_float):
    """What CuPy 14 does that NumPy with ml_dtypes does not, modelled: a bfloat16 array times a Python float runs
    float32's loop and returns float32 where numpy.result_type(0.0, bfloat16) is float64 (ml_dtypes before 0.7),
    and stays bfloat16 where it is bfloat16 (0.7 on): both modelled, whichever is installed; times a Python int, or
    another bfloat16 array, it stays bfloat16; a bfloat16 matmul of more than two axes raises TypeError;
    argpartition reads its indices back twice (cupy.unravel_index), two synchronisations."""
    bf16 = np.dtype("bfloat16")
    assert cp.BFLOAT16_TAKES_A_PYTHON_FLOAT == (np.result_type(0.0, bf16) == bf16)
    monkeypatch.setattr(cp, "BFLOAT16_TAKES_A_PYTHON_FLOAT", takes_a_float)
    x = cp.ones((2, 3), dtype=bf16)
    assert (x * 2.0).dtype == (bf16 if takes_a_float else np.float32)
    assert (x * 2).dtype == bf16 and (x * x).dtype == bf16 and (2.0 * x + x).dtype == (x * 2.0).dtype
    y = cp.empty_like(x)
    assert cp.multiply(x, 2.0, out=y) is y and y.dtype == bf16
    assert (x @ cp.ones((3, 2), dtype=bf16)).dtype == bf16
    with pytest.raises(TypeError, match="data type 'E' not understood"):
        cp.ones((2, 2, 3), dtype=bf16) @ cp.ones((2, 3, 2), dtype=bf16)
    with cp.count_transfers() as t:
        cp.argpartition(cp.asarray(np.array([[3.0, 1.0, 2.0]])), 1, axis=1)
    assert len(t.d2h) == 2
