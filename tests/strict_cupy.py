"""A strict stand-in for CuPy, on NumPy: runs minitf's GPU path (`--device gpu`) on machines
without a GPU, refusing what CuPy refuses. Test-only; nothing in minitf imports it.

Use it in a process:  PYTHONPATH=<repo>/tests MINITF_CUPY_MODULE=strict_cupy python train_wmt.py --device gpu ...
or in a test:         monkeypatch.setattr(minitf.backend, "cupy", strict_cupy)

What it checks, each rule taken from CuPy's source (cupy/_core/core.pyx, _kernel.pyx,
_scalar.pyx, _routines_indexing.pyx, cuda/function.pyx, _core/raw.pyx):
- `ndarray` WRAPS a NumPy array (it is no subclass, so np.asarray cannot see through it).
  `__array__` raises CuPy's TypeError; NumPy ufuncs and functions on it dispatch here
  (`__array_ufunc__`, `__array_function__`) and refuse NumPy array operands, as CuPy's
  kernels do ("Unsupported type <class 'numpy.ndarray'>"); NumPy and Python scalars are fine.
  Indexing with host index arrays and advanced-index assignment of host values are implicit
  host->device copies that CuPy accepts: allowed, and counted. Basic-index assignment of a
  host array raises CuPy's ValueError.
- ONLY the names in ALLOWED and UFUNCS (module functions), CONSTANTS (module attributes) and METHODS (ndarray
  methods), plus
  `random.default_rng` (NumPy's PCG64, not CuPy's XORWOW) and `get_default_memory_pool`, each with the
  parameters of CuPy's signature: a call CuPy's signature would reject raises TypeError, an
  unknown name AttributeError naming it. CuPy's behaviours that differ from NumPy's are
  reproduced where minitf could notice: reductions and integer indexing give 0-d arrays
  (never NumPy scalars), argsort is stable, argpartition sorts fully, `empty` is not zeroed
  (NaN / 0x5A bytes here, so code reading it fails loudly), astype refuses casting=.
- device->host transfers are counted with their call site (float(), int(), bool() and `if
  x:`, .item(), .tolist(), .get(), asnumpy, repr/str/format), and so are CuPy's hidden ones:
  data-dependent shapes (nonzero, flatnonzero, boolean-mask indexing) read a count back.
  Host->device copies (asarray of host data, host index arrays) are counted apart.
  `count_transfers()` collects them; `record_dtypes()` collects the dtypes of the arrays
  created; `record_allocations()` the device arrays that take new memory (not views), by call site;
  `record_peak_bytes()` the most bytes the live device arrays reach (the pool's peak); LAUNCHES counts every kernel CuPy would launch, by name (one per elementwise or
  reduction call, advanced index, assignment, copy or conversion; CuPy matmul's copies and
  GEMM; the RawKernels; cuBLAS calls; NCCL calls), and `launches()` snapshots it; STRICT_CUPY_REPORT=path writes the transfers and the dtypes for the whole process at its exit (JSON, with
  LAUNCHES: the kernels and NCCL calls run).
- RawModule(code=, options=).get_function(name)(grid, block, args) runs the kernel through
  tests/cuda_emulator.py after checking each argument as CuPy's launcher converts it (a
  Python int becomes int64, a float float64, NumPy scalars keep their dtype) against the
  kernel's C signature, parsed from the code (T and A from its typedefs).
- cuda.cublas.gemmEx / gemmStridedBatchedEx (and cuda.device.get_cublas_handle()): computed
  with NumPy from the raw pointers as cuBLAS reads them (column-major, leading dimensions,
  batch strides, pointer offsets into live buffers, transpose flags, alpha and beta read from
  host memory in the compute type's precision, C not read when beta is 0), refusing what
  cuBLAS refuses or leaves undefined: a leading dimension below the row count, a pointer into
  no buffer or misaligned, a read past the buffer's end, a declared type unlike the memory's,
  type combinations the compute type does not take, c overlapping a or b (cuBLAS's C, A, B).
- cuda: runtime.getDeviceCount() (1, or STRICT_CUPY_DEVICES), getDeviceProperties,
  Device(i).use(), Device().id, get_current_stream(), and cuda.nccl: NCCL's all-reduce over
  MPI (mpi4py COMM_WORLD) on the arrays whose `.data.ptr` was taken.
- Asynchronous device->host copies: `asnumpy(a, out=, blocking=False)` into page-locked memory
  (cuda.alloc_pinned_memory; any other `out` is refused: the copy would not be asynchronous)
  is counted apart (`d2h_async`, no sync). Its values land in `out` only when a cuda.Event
  recorded after it is synchronized (or the stream is, or a synchronous copy waits for the
  stream); until then `out` holds NaN (floats) or 0x5A bytes, so code that reads it too early
  fails loudly.

What it cannot catch: timing, streams and asynchrony beyond those copies (every operation here
is done when it returns); cuBLAS/cuDNN numerics (TF32, the order of reductions: results are NumPy's);
NVRTC specifics (tests/test_nvrtc.py compiles the kernels with NVRTC as CuPy does, no GPU needed, and
tests/test_kernels.py with nvcc where it is installed;
here the C++ compiler, $CXX or g++, compiles them); memory limits; real multi-GPU behaviour (devices are numbers, an
array does not know its device); CuPy's wrap-around of out-of-bounds indices (NumPy raises).
"""
import atexit
import contextlib
import inspect
import json
import os
import re
import sys
import threading
import types
import weakref

import numpy

__version__ = "14.0.0+strict"   # the CuPy API checked: CuPy's main branch, 2026

_HERE = os.path.abspath(__file__)
_SKIP_FRAMES = (_HERE, os.sep + "numpy" + os.sep, os.path.join("minitf", "backend.py"))


# ============================================================================ transfers, dtypes
class Transfers:
    """What one count_transfers() block saw: d2h, d2h_async and h2d (lists of 'what at site'), and
    `events`, every transfer and mark() in order as (kind, what, site)."""

    def __init__(self):
        self.d2h, self.h2d, self.d2h_async, self.events = [], [], [], []

    def segments(self, start, stop=None):
        """The d2h transfers from each mark `start` up to the next `start` or `stop` mark: a list
        per segment (a segment still open at the end of the events is left out)."""
        out, current = [], None
        for kind, what, site in self.events:
            if kind == "mark" and what in (start, stop):
                if current is not None:
                    out.append(current)
                current = [] if what == start else None
            elif kind == "d2h" and current is not None:
                current.append(f"{what} at {site}")
        return out


_RECORDERS = []         # active Transfers
_DTYPE_RECORDERS = []   # active {dtype name: first site}
_ALLOC_RECORDERS = []   # active {call site: new device arrays made there}
_PEAK_RECORDERS = []    # active [live device bytes at the start, the most they reached]
TOTALS = {"d2h": 0, "h2d": 0, "d2h_async": 0}
LAUNCHES = {}           # kernel name -> launches, and "nccl.allReduce" -> calls


def _launched(name, n=1):
    """Counts n kernel launches of `name` (CuPy's kernel names: cupy_add, cupy_copy, ...)."""
    if n:
        LAUNCHES[name] = LAUNCHES.get(name, 0) + n


def launches():
    """The launches counted so far, by name (a copy): diff two of them around a block of code."""
    return dict(LAUNCHES)


def launches_between(before, after):
    """{name: launches} made between two `launches()` snapshots, and their total."""
    diff = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    return diff, sum(diff.values())


def _site():
    """The caller outside this module, NumPy and minitf/backend.py, with its caller."""
    f, parts = sys._getframe(1), []
    while f is not None and len(parts) < 2:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP_FRAMES):
            parts.append(f"{os.path.relpath(name) if not name.startswith('<') else name}:{f.f_lineno} "
                         f"{f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(parts)


def _transfer(kind, what):
    TOTALS[kind] += 1
    if kind == "d2h":
        _land_copies()   # a synchronous copy waits for the stream: the queued copies have landed
    if _RECORDERS:
        site = _site()
        for rec in list(_RECORDERS):
            getattr(rec, kind).append(f"{what} at {site}")
            rec.events.append((kind, what, site))


@contextlib.contextmanager
def _recording(registry, rec):
    registry.append(rec)
    try:
        yield rec
    finally:
        registry.remove(rec)


def count_transfers():
    """Collects the transfers made inside the block: `with count_transfers() as t: ...; len(t.d2h)`."""
    return _recording(_RECORDERS, Transfers())


def mark(label):
    """Puts a marker into every active count_transfers() (Transfers.segments splits on them)."""
    for rec in list(_RECORDERS):
        rec.events.append(("mark", label, None))


def record_dtypes():
    """Collects {dtype name: site of the first array of that dtype} of the arrays created inside."""
    return _recording(_DTYPE_RECORDERS, {})


def record_allocations():
    """Collects {call site: count} of the device arrays created inside that take memory of their own
    (what CuPy takes from its memory pool; views of live device arrays, reshapes that copy nothing and
    `out=` results take none)."""
    return _recording(_ALLOC_RECORDERS, {})


def record_peak_bytes():
    """[bytes of the live device arrays when the block starts, the most they reach inside it], sampled
    at each new array that takes memory of its own (as record_allocations counts them): the peak of the
    memory pool's used bytes (CuPy's pool also keeps freed blocks for reuse, which this does not count)."""
    live = _POOL.used_bytes()
    return _recording(_PEAK_RECORDERS, [live, live])


def _sample_peak():
    used = _POOL.used_bytes()
    for rec in _PEAK_RECORDERS:
        rec[1] = max(rec[1], used)


def _report_at_exit(path):
    transfers = Transfers()
    dtypes = {}
    _RECORDERS.append(transfers)
    _DTYPE_RECORDERS.append(dtypes)

    def write():
        counts = {}
        for kind in ("d2h", "h2d"):
            counts[kind] = {}
            for entry in getattr(transfers, kind):
                counts[kind][entry] = counts[kind].get(entry, 0) + 1
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump({"d2h": counts["d2h"], "h2d": counts["h2d"], "dtypes": dtypes, "launches": LAUNCHES}, f, indent=1)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    atexit.register(write)


if os.environ.get("STRICT_CUPY_REPORT"):
    _report_at_exit(os.environ["STRICT_CUPY_REPORT"] + (f".{os.environ['PMI_RANK']}" if "PMI_RANK" in os.environ
                                                         else ""))


# ============================================================================ the array
_CUPY_DTYPES = {numpy.dtype(c) for c in "?bhilqBHILQefdFD"}   # _scalar.pyx _typenames_base
try:   # CuPy 14 takes bfloat16 arrays where ml_dtypes is installed (cupy/_util.pyx _bf16_type)
    import ml_dtypes
    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
    _CUPY_DTYPES.add(BFLOAT16)
    BFLOAT16_TAKES_A_PYTHON_FLOAT = numpy.result_type(0.0, BFLOAT16) == BFLOAT16   # ml_dtypes 0.7 on
except ImportError:
    BFLOAT16, BFLOAT16_TAKES_A_PYTHON_FLOAT = None, False
_PTRS = weakref.WeakValueDictionary()   # data pointer -> the NumPy array behind it (cuda.nccl)
_LIVE = weakref.WeakValueDictionary()   # id -> the NumPy buffer of a live device array (memory pool)
_BUFFERS = weakref.WeakValueDictionary()  # start address -> the NumPy buffer owning it (`.data` was taken)


def _new(a):
    """A device array around the NumPy array `a` (which nothing on the host may hold)."""
    if a.dtype not in _CUPY_DTYPES:
        raise ValueError(f"Unsupported dtype {a.dtype}")
    obj = ndarray.__new__(ndarray)
    obj._a = a
    _note_new(a)
    return obj


def _note_new(a):
    """Registers the buffer behind a new device array's NumPy array `a` with the memory pool, the
    peak and the allocation recorders when it is new memory, and a's dtype with the dtype recorders."""
    owner = a                      # the buffer behind `a`: itself, or what NumPy made it a view of
    while isinstance(owner.base, numpy.ndarray):
        owner = owner.base
    if id(owner) not in _LIVE:     # new memory (not a view of a live device array)
        _LIVE[id(owner)] = owner
        if _PEAK_RECORDERS:
            _sample_peak()
        if _ALLOC_RECORDERS:
            site = _site()
            for rec in _ALLOC_RECORDERS:
                rec[site] = rec.get(site, 0) + 1
    if _DTYPE_RECORDERS:
        name = a.dtype.name
        site = None
        for rec in _DTYPE_RECORDERS:
            if name not in rec:
                rec[name] = site = site or _site()


def _wrap(r, out=None):
    """NumPy results -> device arrays: arrays wrapped, NumPy scalars as 0-d arrays (CuPy's
    reductions and integer indexing never give scalars), tuples element-wise."""
    if out is not None:
        return out
    if isinstance(r, numpy.ndarray):
        return _new(r)
    if isinstance(r, numpy.generic):
        return _new(numpy.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    if isinstance(r, list):
        return [_wrap(x) for x in r]
    return r


def _refuse_host(where):
    raise TypeError(f"{where}: Unsupported type <class 'numpy.ndarray'>: a NumPy array cannot be mixed with "
                    f"cupy arrays (CuPy refuses the implicit host-to-device copy); move it with cupy.asarray")


def _dev(x, where):
    """Arguments of a device function: device arrays unwrapped (also inside lists and tuples);
    NumPy arrays refused."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, numpy.ndarray):
        _refuse_host(where)
    if isinstance(x, (list, tuple)):
        return type(x)(_dev(v, where) for v in x)
    return x


def _operand(x, where):
    """A ufunc operand: a device array, or a Python/NumPy scalar (cupy/_core/_kernel.pyx
    _preprocess_arg -> _scalar.CScalar, which refuses anything else)."""
    if isinstance(x, ndarray):
        return x._a
    if type(x) in (int, float, bool, complex) or (isinstance(x, numpy.generic) and x.dtype in _CUPY_DTYPES):
        return x
    if isinstance(x, numpy.ndarray):
        _refuse_host(where)
    raise TypeError(f"{where}: Unsupported type {type(x)}")


def _index(idx):
    """An index for a device array: device index arrays unwrapped; host arrays and lists are
    copied to the device by CuPy (_routines_indexing.pyx _prepare_slice_list): counted.
    Boolean masks make the result's shape data-dependent: CuPy reads the count back."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    out = []
    for s in parts:
        if isinstance(s, ndarray):
            s = s._a
        elif isinstance(s, (numpy.ndarray, list)):
            _transfer("h2d", "implicit (host index array)")
            s = numpy.array(s)
        if isinstance(s, numpy.ndarray) and s.dtype == numpy.bool_ and s.ndim:
            _transfer("d2h", "implicit sync (boolean-mask index: data-dependent shape)")
        out.append(s)
    return tuple(out) if isinstance(idx, tuple) else out[0]


class _Flags:
    def __init__(self, a):
        self.c_contiguous, self.f_contiguous = a.flags.c_contiguous, a.flags.f_contiguous
        self.owndata = a.base is None

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[key]


class _MemoryPointer:
    """`array.data`: `.ptr` is the address of the array's first element. The buffer that owns
    the memory is remembered, so a raw pointer into it (cuBLAS's, with an offset) can be resolved."""

    def __init__(self, a):
        self.ptr = int(a.__array_interface__["data"][0])
        self.device_id = _CURRENT_DEVICE.id
        _PTRS[self.ptr] = a
        root = a
        while isinstance(root.base, numpy.ndarray):
            root = root.base
        _BUFFERS[int(root.__array_interface__["data"][0])] = root


def _binary(op, reflected=False):
    def method(self, other):
        if isinstance(other, numpy.ndarray) and other.ndim == 0 and op in _COMPARISONS:
            other = other.item()   # core.pyx __richcmp__: the numpy<1.13 workaround
        return _UFUNCS[op](other, self) if reflected else _UFUNCS[op](self, other)
    return method


def _inplace(op):
    def method(self, other):
        _UFUNCS[op](self, other, out=self)
        return self
    return method


def _to_host(self, what):
    _transfer("d2h", what)
    return self._a.copy()


# ============================================================================ asynchronous copies
class PinnedMemoryPointer(bytearray):
    """cuda.alloc_pinned_memory(size): page-locked host memory (numpy.frombuffer reads it)."""


_QUEUED = []   # [(seq, out, values)] asynchronous device->host copies not yet landed
_SEQ = [0]


def _is_pinned(out):
    base = out
    while base is not None and not isinstance(base, PinnedMemoryPointer):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base is not None


def _queue_copy(a, out):
    if not isinstance(out, numpy.ndarray) or out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(f"strict_cupy: asnumpy(out=) needs a NumPy array of shape {a.shape} and dtype {a.dtype}")
    if not _is_pinned(out):
        raise ValueError("strict_cupy: asnumpy(blocking=False) into pageable memory: the copy would not be "
                         "asynchronous; copy into cuda.alloc_pinned_memory")
    _transfer("d2h_async", "asnumpy(blocking=False)")
    _SEQ[0] += 1
    _QUEUED.append((_SEQ[0], out, a._a.copy()))
    if out.dtype.kind == "f":
        out[...] = numpy.nan
    else:
        out.view(numpy.uint8)[...] = 0x5A


def _land_copies(upto=None):
    """The queued copies up to sequence number `upto` (all: None) land in their `out`."""
    keep = []
    for seq, out, values in _QUEUED:
        if upto is None or seq <= upto:
            out[...] = values
        else:
            keep.append((seq, out, values))
    _QUEUED[:] = keep


class _Event:
    """cuda.Event: record() marks the copies queued so far; synchronize() lands them."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._seq = None

    def record(self, stream=None):
        self._seq = _SEQ[0]

    def synchronize(self):
        if self._seq is not None:
            _land_copies(self._seq)

    @property
    def done(self):
        return self._seq is None or not any(seq <= self._seq for seq, _, _ in _QUEUED)


class ndarray:
    """A device array (a wrapped NumPy array). Only CuPy's attributes and METHODS exist."""
    __slots__ = ("_a", "__weakref__")
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise TypeError("strict_cupy: ndarray(memptr=, strides=) are not emulated")
        self._a = _empty_like_cupy(numpy.empty(shape, dtype=dtype, order=order))
        _note_new(self._a)

    # --- attributes (core.pyx)
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    T = property(lambda self: _new(self._a.T))
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _MemoryPointer(self._a))

    def __getattr__(self, name):
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (strict_cupy: not among the CuPy "
                             f"methods checked for minitf, METHODS)")

    # --- no implicit conversion to NumPy (core.pyx __array__)
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """core.pyx: NumPy ufuncs on device arrays run CuPy's ufunc of the same name (whose
        argument check refuses NumPy arrays); a 0-d NumPy operand of a comparison becomes its item."""
        mine = _UFUNCS.get(ufunc.__name__)
        if mine is None or method not in ("__call__", "at", "reduceat"):
            return NotImplemented
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            kwargs["out"] = out[0]
        if ufunc.__name__ in _COMPARISONS:
            inputs = tuple(x.item() if isinstance(x, numpy.ndarray) and x.ndim == 0 else x for x in inputs)
        return (mine if method == "__call__" else getattr(mine, method))(*inputs, **kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        """core.pyx: numpy.f(device arrays) runs cupy.f, when CuPy has it (here: when ALLOWED has it)."""
        mine = _FUNCTIONS.get(func.__name__) if func.__module__ == "numpy" else None
        if mine is None:
            return NotImplemented
        return mine(*args, **kwargs)

    # --- device -> host (each counted)
    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            raise TypeError("strict_cupy: get(out=) is not emulated")
        return _to_host(self, ".get()")

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return _to_host(self, ".item()").item()

    def tolist(self):
        return _to_host(self, ".tolist()").tolist()

    def tobytes(self, order="C"):
        return _to_host(self, ".tobytes()").tobytes(order)

    def __float__(self):
        return float(_to_host(self, "float()"))

    def __int__(self):
        return int(_to_host(self, "int()"))

    def __complex__(self):
        return complex(_to_host(self, "complex()"))

    def __bool__(self):   # core.pyx __nonzero__: `if x:` reads the value back
        if self.size == 0:
            import warnings
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but in future this will "
                          "result in an error. Use `array.size > 0` to check that an array is not empty.",
                          DeprecationWarning, stacklevel=2)
            return False
        if self.size > 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. Use a.any() or "
                             "a.all()")
        return bool(_to_host(self, "bool() / `if array`"))

    def __repr__(self):
        return repr(_to_host(self, "repr()"))

    def __str__(self):
        return str(_to_host(self, "str()"))

    def __format__(self, spec):
        return format(_to_host(self, "format()"), spec)

    def __reduce__(self):
        return _FUNCTIONS["array"], (_to_host(self, "pickle"),)

    # (no __index__: CuPy has none, so a device array cannot be a Python index or a range bound)

    # --- containers
    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, idx):
        idx = _index(idx)
        r = self._a[idx]
        if any(isinstance(p, numpy.ndarray) for p in (idx if isinstance(idx, tuple) else (idx,))):
            _launched("cupy_take")   # advanced indexing: a gather kernel
        if isinstance(r, numpy.generic):   # integer indexing: CuPy gives a 0-d VIEW
            r = self._a[(idx if isinstance(idx, tuple) else (idx,)) + (Ellipsis,)]
        return _new(r)

    def __setitem__(self, idx, value):
        parts = idx if isinstance(idx, tuple) else (idx,)
        advanced = any(isinstance(s, (ndarray, numpy.ndarray, list)) for s in parts)
        if isinstance(value, ndarray):
            value = value._a
        elif isinstance(value, (numpy.ndarray, list)):
            if advanced:   # _scatter_op_single: core.array(value), an implicit copy
                _transfer("h2d", "implicit (host value assigned to an advanced index)")
            elif numpy.ndim(value) != 0:   # _scatter_op 'update' -> fill(): refused
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = numpy.array(value)
        else:
            _operand(value, "cupy.ndarray.__setitem__")
        _launched("cupy_scatter_update" if advanced else "cupy_copy (setitem)")
        self._a[_index(idx)] = value

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # --- arithmetic (core.pyx: each a CuPy ufunc)
    __add__, __radd__, __iadd__ = _binary("add"), _binary("add", True), _inplace("add")
    __sub__, __rsub__, __isub__ = _binary("subtract"), _binary("subtract", True), _inplace("subtract")
    __mul__, __rmul__, __imul__ = _binary("multiply"), _binary("multiply", True), _inplace("multiply")
    __truediv__, __rtruediv__, __itruediv__ = _binary("true_divide"), _binary("true_divide", True), _inplace(
        "true_divide")
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary("floor_divide"), _binary("floor_divide", True), _inplace(
        "floor_divide")
    __mod__, __rmod__ = _binary("remainder"), _binary("remainder", True)
    __pow__, __rpow__ = _binary("power"), _binary("power", True)
    __matmul__, __rmatmul__ = _binary("matmul"), _binary("matmul", True)
    __and__, __rand__, __iand__ = _binary("bitwise_and"), _binary("bitwise_and", True), _inplace("bitwise_and")
    __or__, __ror__, __ior__ = _binary("bitwise_or"), _binary("bitwise_or", True), _inplace("bitwise_or")
    __xor__, __rxor__, __ixor__ = _binary("bitwise_xor"), _binary("bitwise_xor", True), _inplace("bitwise_xor")
    __lshift__, __ilshift__ = _binary("left_shift"), _inplace("left_shift")
    __rshift__, __irshift__ = _binary("right_shift"), _inplace("right_shift")
    __lt__, __le__, __gt__, __ge__ = _binary("less"), _binary("less_equal"), _binary("greater"), _binary(
        "greater_equal")
    __eq__, __ne__ = _binary("equal"), _binary("not_equal")

    def __neg__(self):
        return _UFUNCS["negative"](self)

    def __pos__(self):
        return self.copy()

    def __abs__(self):
        return _UFUNCS["absolute"](self)

    def __invert__(self):
        return _UFUNCS["invert"](self)


def _empty_like_cupy(a):
    """CuPy's empty arrays hold whatever the memory pool had: here NaN (floats) or 0x5A bytes,
    so that code reading them before writing fails loudly instead of seeing NumPy's zeros."""
    if a.dtype.kind in "fc":
        a.fill(numpy.nan)
    else:
        a.view(numpy.uint8).fill(0x5A)
    return a


# ============================================================================ the allowed names
# CuPy's signatures (from its source) of everything minitf, its tests and bench use. A
# parameter written `name!` must be a cupy.ndarray there (Cython-typed in CuPy); every other
# array parameter refuses NumPy arrays too (CuPy's kernels do). `# CuPy:` notes where CuPy
# differs from NumPy.
ALLOWED = {
    # creation (cupy/_creation/basic.py, from_data.py, ranges.py, matrix.py)
    "asarray": "a, dtype=None, order=None, *, copy=None, blocking=False",    # host data: a counted h2d copy
    "array": "obj, dtype=None, copy=True, order='K', subok=False, ndmin=0, *, blocking=False",
    "ascontiguousarray": "a!, dtype=None",               # CuPy: a cupy.ndarray only (_core.ascontiguousarray)
    "asnumpy": "a, stream=None, order='C', out=None, *, blocking=True",
    "get_array_module": "*args",
    "empty": "shape, dtype=float, order='C'",           # CuPy: not zeroed (here NaN / 0x5A bytes)
    "empty_like": "prototype!, dtype=None, order='K', subok=None, shape=None",
    "zeros": "shape, dtype=float, order='C'",
    "zeros_like": "a!, dtype=None, order='K', subok=None, shape=None",
    "ones": "shape, dtype=float, order='C'",
    "full": "shape, fill_value, dtype=None, order='C'",
    "arange": "start, stop=None, step=1, dtype=None",
    "triu": "m, k=0",                                   # host data: a counted h2d copy (cupy.asarray)
    # manipulation, indexing, sorting (cupy/_manipulation, _indexing, _sorting)
    "concatenate": "tup, axis=0, out=None, *, dtype=None, casting='same_kind'",   # CuPy: cupy arrays only
    "stack": "tup, axis=0, out=None, *, dtype=None, casting='same_kind'",
    "broadcast_to": "array!, shape",
    "repeat": "a!, repeats, axis=None",
    "take_along_axis": "a!, indices!, axis",              # CuPy: axis has no default (NumPy 2.3+: -1)
    "argsort": "a!, axis=-1, kind=None",                 # CuPy: always stable (kind None or 'stable')
    "argpartition": "a!, kth, axis=-1",                  # CuPy: sorts fully (stable); no kind=, order=
    "flatnonzero": "a!",                                 # CuPy: reads the count back (a sync)
    "einsum": "*operands, dtype=None, optimize=False",   # CuPy: **kwargs, only dtype and optimize accepted
}

# ufuncs (cupy/_core/_kernel.pyx ufunc.__call__: *args, out=None, dtype=None, casting='same_kind'; no where=)
# name -> whether CuPy's ufunc has .at (scatter_op) and .reduceat (add only)
UFUNCS = {
    "add": ("at", "reduceat"), "subtract": ("at",), "multiply": (), "divide": (), "true_divide": (),
    "floor_divide": (), "remainder": (), "power": (), "negative": (), "absolute": (), "maximum": (), "minimum": (),
    "exp": (), "log": (), "sqrt": (), "tanh": (), "floor": (), "isfinite": (), "isnan": (),
    "greater": (), "greater_equal": (), "less": (), "less_equal": (), "equal": (), "not_equal": (),
    "logical_and": (), "logical_or": (), "logical_not": (), "invert": (),
    "bitwise_and": ("at",), "bitwise_or": ("at",), "bitwise_xor": ("at",), "left_shift": (), "right_shift": (),
    "matmul": (),        # CuPy: a _GUFunc (cupy/_core/_gufuncs.py), called like a ufunc here
}
_COMPARISONS = {"greater", "greater_equal", "less", "less_equal", "equal", "not_equal"}

# ndarray methods (cupy/_core/core.pyx)
METHODS = {
    "reshape": "*shape, order='C'",
    "transpose": "*axes",
    "swapaxes": "axis1, axis2",
    "ravel": "order='C'",
    "squeeze": "axis=None",
    "astype": "dtype, order='K', casting=None, subok=None, copy=True",   # CuPy: casting/subok must stay None
    "copy": "order='C'",
    "fill": "value",
    "sum": "axis=None, dtype=None, out=None, keepdims=False",
    "mean": "axis=None, dtype=None, out=None, keepdims=False",
    "max": "axis=None, out=None, keepdims=False",
    "min": "axis=None, out=None, keepdims=False",
    "argmax": "axis=None, out=None, dtype=None, keepdims=False",
    "all": "axis=None, out=None, keepdims=False",
    "any": "axis=None, out=None, keepdims=False",
    "argsort": "axis=-1, kind=None",                     # CuPy: stable
    "argpartition": "kth, axis=-1",                      # CuPy: a full stable sort
    "nonzero": "",                                       # CuPy: reads the count back (a sync)
    "view": "dtype=None, type=None",
}

# attributes besides functions: dtypes and constants (cupy/__init__.py re-exports NumPy's)
CONSTANTS = {
    "float16": numpy.float16, "float32": numpy.float32, "float64": numpy.float64, "int32": numpy.int32,
    "int64": numpy.int64, "uint8": numpy.uint8, "uint16": numpy.uint16, "bool_": numpy.bool_, "inf": numpy.inf,
    "newaxis": None, "ndarray": ndarray,
}


def _signature(text, name):
    """(inspect.Signature, names that must be device arrays) of a signature text."""
    must = [p.strip().rstrip("!").split("=")[0].strip() for p in text.split(",") if p.strip().endswith("!")]
    ns = {}
    exec(f"def {name}({text.replace('!', '')}): pass", ns)
    return inspect.signature(ns[name]), must


def _checked(qualname, text, impl):
    """impl(*args, **kwargs) after checking the call against CuPy's signature `text`."""
    name = qualname.rsplit(".", 1)[-1]
    sig, must = _signature(text, name)

    def fn(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{qualname}{sig}: {e} (strict_cupy: CuPy's signature)") from None
        for p in must:
            if not isinstance(bound.arguments.get(p), ndarray):
                raise TypeError(f"{qualname}: argument '{p}' must be a cupy.ndarray, got "
                                f"{type(bound.arguments.get(p)).__name__}")
        result = impl(*args, **kwargs)
        if qualname.startswith("cupy.ndarray."):
            _count_method(name, args[0], args[1:], kwargs, result)
        elif qualname.startswith("cupy."):
            _count_function(name, args, kwargs, result)
        return result
    fn.__name__, fn.__qualname__, fn.__doc__ = name, qualname, f"CuPy's {qualname}{sig}"
    return fn


def _generic(name):
    """A device function computed by NumPy's function of the same name."""
    np_fn = getattr(numpy, name)
    where = f"cupy.{name}"

    def impl(*args, **kwargs):
        out = kwargs.get("out")
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"{where}: out must be a cupy.ndarray")
        r = np_fn(*_dev(args, where), **{k: _dev(v, where) for k, v in kwargs.items()})
        return _wrap(r, out)
    return impl


# --- the functions that are not plain NumPy calls
def _asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        if dtype is None or numpy.dtype(dtype) == a.dtype:
            return a.copy() if copy else a
        return _new(a._a.astype(dtype))
    if isinstance(a, numpy.ndarray) or isinstance(a, (list, tuple)) and _holds_host_array(a):
        _transfer("h2d", "asarray(host array)")
    elif _holds_device_array(a):
        raise TypeError("cupy.asarray: a list of cupy arrays is not emulated (use cupy.stack)")
    else:
        _transfer("h2d", "asarray(host value)")
    return _new(numpy.array(a, dtype=dtype, order=order or "K"))   # always a copy: device memory is its own


def _holds_host_array(x):
    return isinstance(x, numpy.ndarray) or isinstance(x, (list, tuple)) and any(_holds_host_array(v) for v in x)


def _holds_device_array(x):
    return isinstance(x, ndarray) or isinstance(x, (list, tuple)) and any(_holds_device_array(v) for v in x)


def _array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    return _asarray(obj, dtype=dtype, order=None if order == "K" else order, copy=copy)


def _ascontiguousarray(a, dtype=None):
    if a._a.flags.c_contiguous and (dtype is None or numpy.dtype(dtype) == a.dtype):
        return a
    return _new(numpy.ascontiguousarray(a._a, dtype=dtype))


def _asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if out is not None and isinstance(a, ndarray) and not blocking:
        _queue_copy(a, out)
        return out
    if out is not None:
        raise TypeError("strict_cupy: asnumpy(out=) is emulated only with blocking=False")
    if isinstance(a, ndarray):
        return numpy.array(_to_host(a, "asnumpy()"), order=order)
    return numpy.array(a, order=order)


def _get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else numpy


def _creation(np_fn, empty=False):
    def impl(shape, dtype=float, order="C"):
        a = np_fn(shape, dtype=dtype, order=order)
        return _new(_empty_like_cupy(a) if empty else a)
    return impl


def _like(np_fn, empty=False):
    def impl(a, dtype=None, order="K", subok=None, shape=None):
        if subok is not None:
            raise TypeError("subok is not supported yet")
        r = np_fn(a._a, dtype=dtype, order=order, shape=shape)
        return _new(_empty_like_cupy(r) if empty else r)
    return impl


def _full(shape, fill_value, dtype=None, order="C"):
    if isinstance(fill_value, ndarray):
        fill_value = fill_value._a
    elif isinstance(fill_value, numpy.ndarray) and fill_value.ndim:
        raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
    return _new(numpy.full(shape, fill_value, dtype=dtype, order=order))


def _arange(start, stop=None, step=1, dtype=None):
    for v in (start, stop, step):
        if isinstance(v, (ndarray, numpy.ndarray)):
            raise TypeError("cupy.arange: start, stop and step must be scalars")
    return _new(numpy.arange(start, stop, step, dtype=dtype))


def _sequence(np_fn, where):
    def impl(tup, axis=0, out=None, *, dtype=None, casting="same_kind"):
        if any(not isinstance(a, ndarray) for a in tup):
            raise TypeError("Only cupy arrays can be concatenated")   # _routines_manipulation.pyx
        r = np_fn([a._a for a in tup], axis=axis, out=None if out is None else out._a, dtype=dtype, casting=casting)
        return _wrap(r, out)
    return impl


def _triu(m, k=0):
    """CuPy 14's triu is cupy.where(mask, zero, m) (cupy/_creation/matrix.py), and where has no bfloat16 loop: it
    takes the first loop a bfloat16 array casts to safely, float32's (cupy/_sorting/search.py), so a bfloat16 m
    comes back float32."""
    a = (m if isinstance(m, ndarray) else _asarray(m))._a
    out = numpy.triu(a, k=k)
    return _new(out.astype(numpy.float32) if a.dtype.name == "bfloat16" else out)


def _argsort(a, axis=-1, kind=None):
    if kind is not None and kind != "stable":   # cupy/_core/core.pyx, _check_kind_sort
        raise ValueError("kind can only be None or 'stable'")
    return _new(numpy.argsort(a._a, axis=axis, kind="stable"))


def _argpartition(a, kth, axis=-1):
    # cupy/_sorting/search.py -> _ndarray_argpartition ends in cupy.unravel_index, which reads on the host
    # whether any index is negative and whether any is positive (cupy/_indexing/generate.py)
    _transfer("d2h", "implicit sync (argpartition: unravel_index checks its indices)")
    _transfer("d2h", "implicit sync (argpartition: unravel_index checks its indices)")
    return _new(numpy.argsort(a._a, axis=axis, kind="stable"))


def _flatnonzero(a):
    _transfer("d2h", "implicit sync (flatnonzero: data-dependent shape)")
    return _new(numpy.flatnonzero(a._a))


def _take_along_axis(a, indices, axis):
    if indices.dtype.kind not in "iu":
        raise IndexError("`indices` must be an integer array")
    # cupy/_indexing/indexing.py: an arange for each other axis, then one advanced-index gather (counted as the call)
    _launched("cupy_arange (take_along_axis)", a.ndim - 1)
    return _new(numpy.take_along_axis(a._a, indices._a, axis=axis))


def _einsum(*operands, dtype=None, optimize=False):
    ops = [operands[0]] + [_dev(x, "cupy.einsum") for x in operands[1:]]
    if any(not isinstance(x, numpy.ndarray) for x in ops[1:]):
        raise TypeError("cupy.einsum: the operands must be cupy arrays")
    return _wrap(numpy.einsum(*ops, dtype=dtype, optimize=optimize))


_IMPLS = {
    "asarray": _asarray, "array": _array, "ascontiguousarray": _ascontiguousarray, "asnumpy": _asnumpy,
    "get_array_module": _get_array_module, "empty": _creation(numpy.empty, empty=True),
    "zeros": _creation(numpy.zeros), "ones": _creation(numpy.ones), "empty_like": _like(numpy.empty_like, True),
    "zeros_like": _like(numpy.zeros_like), "full": _full, "arange": _arange,
    "concatenate": _sequence(numpy.concatenate, "concatenate"), "stack": _sequence(numpy.stack, "stack"),
    "argsort": _argsort, "argpartition": _argpartition, "flatnonzero": _flatnonzero,
    "take_along_axis": _take_along_axis, "einsum": _einsum, "triu": _triu,
}


# --- launches: what CuPy runs on the GPU for each call (one elementwise or reduction kernel
# per call, unless noted): a model of CuPy 14's source, counted in LAUNCHES by kernel name
def _count_ufunc(name, ins):
    if name != "matmul":
        _launched(f"cupy_{name}")
        return
    # cupy/_core/_routines_linalg.pyx: 2-D operands that are neither C- nor F-contiguous are
    # copied; N-D ones not C-contiguous are copied; float16 N-D products convert both operands
    # to float32 and the result back; then one cuBLAS GEMM
    arrays = [x for x in ins if isinstance(x, numpy.ndarray)]
    nd = max(x.ndim for x in arrays)
    for x in arrays:
        if (x.ndim <= 2 and not (x.flags.c_contiguous or x.flags.f_contiguous)) or (
                x.ndim > 2 and not x.flags.c_contiguous):
            _launched("cupy_copy")
    if nd > 2 and arrays[0].dtype == numpy.float16:
        _launched("cupy_copy (float16 <-> float32)", 3)
    _launched("cublas gemm (cupy.matmul)")


# kernels a module function runs (default 1); None: decided by the call (see _count_function)
_FUNCTION_LAUNCHES = {"empty": 0, "empty_like": 0, "get_array_module": 0, "asnumpy": 0, "broadcast_to": 0,
                      "triu": 0, "asarray": None, "array": None, "ascontiguousarray": None, "flatnonzero": 2}


def _count_function(name, args, kwargs, result):
    n = _FUNCTION_LAUNCHES.get(name, 1)
    if n is None:   # asarray / array / ascontiguousarray of a device array: a copy kernel if one was made
        src = args[0] if args else kwargs.get("a", kwargs.get("obj"))
        n = int(isinstance(src, ndarray) and isinstance(result, ndarray) and result._a is not src._a
                and not numpy.shares_memory(result._a, src._a))
    _launched(f"cupy.{name}", n)


# --- ufuncs
def _weak_scalars(r, ins):
    """CuPy's result dtype where ml_dtypes' NumPy loops differ: bfloat16 @ bfloat16 stays bfloat16 in CuPy
    (ml_dtypes gives float32). A bfloat16 array with a Python float: CuPy takes a loop's type for a Python scalar
    only where numpy.result_type(scalar, that type) is it (cupy/_core/_kernel.pyx, _guess_routine_from_in_types;
    bfloat16's loop comes before float32's, cupy/_util.pyx bf16_loop). numpy.result_type(0.0, bfloat16) is
    float64 with ml_dtypes before 0.7, so `x * 2.0` runs float32's loop and returns float32; it is bfloat16 from
    ml_dtypes 0.7 on, so `x * 2.0` stays bfloat16. The rule is asked of the ml_dtypes installed
    (BFLOAT16_TAKES_A_PYTHON_FLOAT), not of NumPy's own loops."""
    if BFLOAT16 is None or not isinstance(r, numpy.ndarray) or r.dtype not in (numpy.float32, BFLOAT16):
        return r
    arrays = [x for x in ins if isinstance(x, (numpy.ndarray, numpy.generic))]
    if not arrays or any(x.dtype != BFLOAT16 for x in arrays):
        return r
    floats = any(isinstance(x, float) for x in ins)
    want = BFLOAT16 if not floats or BFLOAT16_TAKES_A_PYTHON_FLOAT else numpy.dtype(numpy.float32)
    return r if r.dtype == want else r.astype(want)


class ufunc:
    """CuPy's ufunc: operands are device arrays or scalars; out=, dtype=, casting= only."""

    def __init__(self, name, methods):
        self.__name__, self._np, self._methods = name, getattr(numpy, name), methods
        self.nin, self.nout = self._np.nin, self._np.nout

    def __repr__(self):
        return f"<ufunc 'cupy_{self.__name__}'>"

    def __call__(self, *args, out=None, dtype=None, casting="same_kind", **kwargs):
        where = f"cupy.{self.__name__}"
        if kwargs:
            raise TypeError("Wrong arguments %s" % kwargs)
        if not self.nin <= len(args) <= self.nin + self.nout:
            raise TypeError(f"Wrong number of arguments for 'cupy_{self.__name__}'. It must be either {self.nin} or "
                            f"{self.nin + self.nout} (with outputs), but given {len(args)}.")
        if len(args) > self.nin:
            if out is not None:
                raise ValueError("Cannot specify 'out' as both a positional and keyword argument")
            out = args[self.nin]
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"{where}: Output arguments must be cupy.ndarray")
        ins = [_operand(x, where) for x in args[:self.nin]]
        if self.__name__ == "matmul" and any(isinstance(x, numpy.ndarray) and x.ndim > 2 and x.dtype == BFLOAT16
                                             for x in ins):
            # cupy/_core/_routines_linalg.pyx: an N-D matmul not of 'efdFD' (bfloat16's char is 'E') takes the
            # integer path, whose get_typename('E') raises
            raise TypeError("data type 'E' not understood (cupy.matmul of bfloat16 arrays of more than 2 dimensions)")
        _count_ufunc(self.__name__, ins)
        kw = {} if dtype is None else {"dtype": dtype}
        if out is None:   # CuPy allocates a ufunc's output C-contiguous (_kernel.pyx, _get_out_args_from_optionals)
            kw["order"] = "C"
        r = self._np(*ins, out=None if out is None else out._a, casting=casting, **kw)
        return _wrap(_weak_scalars(r, ins) if out is None and dtype is None else r, out)

    def __getattr__(self, name):
        if name in ("at", "reduceat") and name in self._methods:
            return getattr(self, "_" + name)
        raise AttributeError(f"cupy ufunc '{self.__name__}' has no usable {name!r} (CuPy: NotImplementedError, or "
                             f"not among the methods checked for minitf)")

    # _routines_indexing.pyx _scatter_op_single: the atomics CuPy has (int64 add only since after 14.0: left out)
    _AT_DTYPES = {"add": {"int32", "float16", "float32", "float64", "uint32", "uint64"},
                  "subtract": {"int32", "uint32"}, **{f"bitwise_{op}": {"int32", "int64", "uint32", "uint64"}
                                                      for op in ("and", "or", "xor")}}

    def _at(self, a, indices, b=None):
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.{self.__name__}.at: a must be a cupy.ndarray")
        if a.dtype.name not in self._AT_DTYPES.get(self.__name__, {a.dtype.name}):
            raise TypeError(f"cupy.{self.__name__}.at does not support {a.dtype} as data type")
        _launched(f"cupy_scatter_{self.__name__}")
        self._np.at(a._a, _index(indices), None if b is None else _operand(b, f"cupy.{self.__name__}.at"))

    def _reduceat(self, array, indices, axis=0, dtype=None, out=None):
        if not isinstance(array, ndarray) or out is not None:
            raise TypeError("cupy.add.reduceat: array must be a cupy.ndarray (out= not emulated)")
        _launched(f"cupy_{self.__name__}_reduceat")
        return _new(self._np.reduceat(array._a, _index(indices), axis=axis, dtype=dtype))


_UFUNCS = {name: ufunc(name, methods) for name, methods in UFUNCS.items()}


# --- methods
def _method(name, impl=None):
    where = f"cupy.ndarray.{name}"

    def generic(self, *args, **kwargs):
        out = kwargs.get("out")
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"{where}: out must be a cupy.ndarray")
        r = getattr(self._a, name)(*_dev(args, where), **{k: _dev(v, where) for k, v in kwargs.items()})
        return _wrap(r, out)
    check = _checked(where, "self, " + METHODS[name] if METHODS[name] else "self", impl or generic)
    check.__name__ = name
    return check


_VIEWS = {"reshape", "transpose", "swapaxes", "ravel", "squeeze", "view", "astype"}   # a kernel only when copying


def _count_method(name, self, args, kwargs, result):
    if name in _VIEWS:
        copied = isinstance(result, ndarray) and not numpy.shares_memory(result._a, self._a)
        _launched(f"cupy_copy ({name})", int(copied))
    elif name == "nonzero":
        _launched("cupy.nonzero", 2)
    else:   # copy, fill, the reductions, argsort, argpartition
        _launched(f"cupy.ndarray.{name}")


def _astype(self, dtype, order="K", casting=None, subok=None, copy=True):
    if casting is not None:
        raise TypeError("casting is not supported yet")     # core.pyx _astype
    if subok is not None:
        raise TypeError("subok is not supported yet")
    r = self._a.astype(dtype, order=order, copy=bool(copy))
    return self if r is self._a else _new(r)


def _fill(self, value):
    if isinstance(value, ndarray):
        if value.shape != ():
            raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
        value = value._a
    elif numpy.ndim(value) != 0:
        raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
    self._a.fill(value)


def _nonzero(self):
    _transfer("d2h", "implicit sync (nonzero: data-dependent shape)")
    return _wrap(self._a.nonzero())


def _reshape(self, *shape, order="C"):   # CuPy 14.0 and 14.1 take no copy= (14.2 does): minitf may not pass it
    return _new(self._a.reshape(*shape, order=order))


try:
    from numpy.lib.array_utils import normalize_axis_tuple as _normalize_axis_tuple   # NumPy 2
except ImportError:
    from numpy.core.numeric import normalize_axis_tuple as _normalize_axis_tuple      # NumPy 1


def _tree_reduce(a, name, axis, keepdims):
    """a.sum or a.mean over `axis` added along a contiguous axis, where NumPy adds pairwise: an error that grows like a
    tree's, as in CuPy's reductions (a block's threads, then the blocks). NumPy over a leading axis adds one row at a
    time into the result instead (in float32, 3,000 rows of a column sum off by 1e-6 where CuPy's is off by 1e-7)."""
    axes = sorted(range(a.ndim) if axis is None else _normalize_axis_tuple(axis, a.ndim))   # NumPy's AxisError and
    # "repeated axis" ValueError, as CuPy's
    kept = [ax for ax in range(a.ndim) if ax not in axes]
    n = 1
    for ax in axes:
        n *= a.shape[ax]
    moved = numpy.ascontiguousarray(a.transpose(kept + axes)).reshape([a.shape[ax] for ax in kept] + [n])
    r = getattr(moved, name)(axis=-1)
    return r.reshape([1 if ax in axes else a.shape[ax] for ax in range(a.ndim)]) if keepdims else r


def _summed(name):
    """sum and mean of float16, bfloat16 and float32 arrays as CuPy computes them: 16-bit values added in float32 and
    the result rounded once (cupy/_core/_routines_math.pyx, sum's 'e->e' and bfloat16 loops with a float reduce type;
    _routines_statistics.pyx, mean), where NumPy adds a bfloat16 array in bfloat16 (10,000 ones sum to 256 there) and
    a float16 array's rows in float16 (a column sum of 3,000 rows off by 8e-3); every float32 or narrower sum in the
    array's own dtype along a contiguous axis (_tree_reduce)."""
    def impl(self, axis=None, dtype=None, out=None, keepdims=False):
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"cupy.ndarray.{name}: out must be a cupy.ndarray")
        a = self._a
        if a.dtype.name in ("float16", "bfloat16", "float32") and (dtype is None or numpy.dtype(dtype) == a.dtype):
            r = _tree_reduce(a.astype(numpy.float32, copy=False), name, axis, keepdims)
            r = numpy.asarray(r).astype(a.dtype)
        else:
            r = getattr(a, name)(axis=axis, dtype=dtype, keepdims=keepdims)
        if out is not None:
            if out.shape != numpy.shape(r):   # cupy/_core/_kernel.pyx, _get_out_args_from_optionals
                raise ValueError("Out shape is mismatched")
            out._a[...] = r
        return _wrap(r, out)
    return impl


_METHOD_IMPLS = {"astype": _astype, "fill": _fill, "nonzero": _nonzero, "reshape": _reshape,
                 "sum": _summed("sum"), "mean": _summed("mean"),
                 "argsort": lambda self, axis=-1, kind=None: _argsort(self, axis, kind),
                 "argpartition": lambda self, kth, axis=-1: _argpartition(self, kth, axis)}
for _name in METHODS:
    setattr(ndarray, _name, _method(_name, _METHOD_IMPLS.get(_name)))

_FUNCTIONS = {name: _checked(f"cupy.{name}", text, _IMPLS.get(name) or _generic(name)) for name, text in
              ALLOWED.items()}
_FUNCTIONS.update(_UFUNCS)


# ============================================================================ random (cupy/random)
class _Generator:
    """cupy.random.Generator (_generator_api.pyx), drawing with NumPy's PCG64 (other numbers than
    CuPy's XORWOW: runs compare with runs of the same backend, never with a real GPU)."""

    def __init__(self, seed):
        self._rng = numpy.random.default_rng(seed)

    def _float_draw(self, name, size, dtype, out):
        """CuPy's float distributions: float32/float64 only; `out=` is not emulated."""
        if out is not None:
            raise TypeError(f"strict_cupy: {name}(out=) is not emulated")
        if numpy.dtype(dtype).char not in "fd":
            raise TypeError(f"Unsupported dtype {numpy.dtype(dtype).name} for {name}")
        return _new(numpy.asarray(getattr(self._rng, name)(size, dtype=dtype)))

    def random(self, size=None, dtype=numpy.float64, out=None):
        return self._float_draw("random", size, dtype, out)

    def standard_normal(self, size=None, dtype=numpy.float64, out=None):
        return self._float_draw("standard_normal", size, dtype, out)

    def integers(self, low, high=None, size=None, dtype=numpy.int64, endpoint=False):
        return _new(numpy.asarray(self._rng.integers(low, high, size, dtype=dtype, endpoint=endpoint)))

    def __getattr__(self, name):
        raise AttributeError(f"'Generator' object has no attribute {name!r} (strict_cupy: not among the CuPy "
                             f"methods checked)")


def _default_rng(seed=None):
    if isinstance(seed, (ndarray, numpy.ndarray)):
        raise TypeError("strict_cupy: default_rng takes an int seed here")
    return _Generator(seed)


random = types.ModuleType(__name__ + ".random")
random.default_rng = _default_rng
random.Generator = _Generator


# ============================================================================ raw kernels
_C_DTYPES = {"half_t": numpy.float16, "bf16_t": BFLOAT16, "float": numpy.float32, "double": numpy.float64, "int": numpy.int32,
             "long long": numpy.int64, "long long int": numpy.int64, "unsigned": numpy.uint32,
             "unsigned int": numpy.uint32, "unsigned long long": numpy.uint64, "unsigned long long int": numpy.uint64,
             "unsigned short": numpy.uint16, "unsigned char": numpy.uint8, "signed char": numpy.int8,
             "bool": numpy.bool_}


def python_scalar_dtype(x):
    """The dtype CuPy's launcher gives a kernel argument that is no array (cuda/function.pyx
    _pointer -> _scalar.CScalar -> numpy_dtype_from_pyscalar): bool -> bool, int -> int64
    (uint64 from 2**63), float -> float64, NumPy scalars their own."""
    if type(x) is bool:
        return numpy.dtype(numpy.bool_)
    if type(x) is int:
        return numpy.dtype(numpy.uint64 if x >= 1 << 63 else numpy.int64)
    if type(x) is float:
        return numpy.dtype(numpy.float64)
    if isinstance(x, numpy.generic):
        return x.dtype
    raise TypeError(f"Unsupported type {type(x)}")


# An `extern "C" __global__` kernel's declaration: (its __launch_bounds__ threads or '', its name, its parameters)
_KERNEL_DECL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+'
                          r'(?:__launch_bounds__\s*\(\s*(\d+)\s*(?:,\s*\w+\s*)?\)\s*)?(\w+)\s*\(([^)]*)\)')


def parse_kernels(code):
    """{kernel name: [C parameter types]} of the `extern "C" __global__` kernels in CUDA source,
    types as written without `const` (e.g. 'T*', 'long long', 'float')."""
    out = {}
    for _, name, params in _KERNEL_DECL.findall(code):
        types_ = []
        for p in params.split(","):
            words = re.sub(r"\bconst\b", " ", p.replace("*", " * ")).split()
            types_.append(" ".join(words[:-1]).replace(" *", "*"))
        out[name] = types_
    return out


def parse_launch_bounds(code):
    """{kernel name: the most threads a block it declares with __launch_bounds__(threads[, blocks])}."""
    return {name: int(threads) for threads, name, _ in _KERNEL_DECL.findall(code) if threads}


class _RawKernel:
    """A kernel of a RawModule; calling it checks the arguments and runs it in the emulator."""

    def __init__(self, module, name, params):
        self.module, self.name, self.params = module, name, params
        self.max_threads = module.bounds.get(name, 1024)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        where = f"RawKernel {self.name}"
        if not isinstance(grid, tuple) or not isinstance(block, tuple):   # function.pyx: (tuple grid, tuple block, ...)
            raise TypeError(f"{where}: grid and block must be tuples (got {type(grid).__name__}, "
                            f"{type(block).__name__})")
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        if grid[1:] != (1, 1) or block[1:] != (1, 1):
            raise TypeError(f"{where}: only 1-D grids and blocks are emulated")
        if not 1 <= block[0] <= 1024:
            raise ValueError(f"{where}: {block[0]} threads per block (CUDA allows 1 to 1024)")
        if block[0] > self.max_threads:     # compiled for at most that many: the launch fails on a GPU
            raise ValueError(f"{where}: {block[0]} threads per block, more than its __launch_bounds__ "
                             f"({self.max_threads})")
        if grid[0] >= 1 << 31:
            raise ValueError(f"{where}: grid of {grid[0]} blocks (CUDA allows < 2**31)")
        if len(args) != len(self.params):
            raise TypeError(f"{where}: {len(args)} arguments for a kernel of {len(self.params)} parameters "
                            f"({', '.join(self.params)})")
        host = []
        for i, (c, a) in enumerate(zip(self.params, args)):
            if c.endswith("*"):
                want = self.module.dtype_of(c[:-1])
                if not isinstance(a, ndarray):
                    raise TypeError(f"{where}: argument {i} ({c}) must be a cupy.ndarray, got {type(a).__name__}")
                if a.dtype != want:
                    raise TypeError(f"{where}: argument {i} ({c}) points to {numpy.dtype(want).name}, got a "
                                    f"{a.dtype} array (the kernel would misread it)")
                host.append(a._a)
            else:
                want = numpy.dtype(self.module.dtype_of(c))
                if isinstance(a, ndarray):
                    raise TypeError(f"{where}: argument {i} ({c}) is passed by value; got a cupy.ndarray (its "
                                    f"pointer would be passed)")
                if isinstance(a, numpy.ndarray):
                    if a.size != 1:   # function.pyx _pointer
                        raise TypeError(f"You are trying to pass a numpy.ndarray of shape {a.shape} as a kernel "
                                        f"parameter. Only numpy.ndarrays of size one can be passed by value.")
                    got = a.dtype
                else:
                    got = python_scalar_dtype(a)
                if got != want:
                    raise TypeError(f"{where}: argument {i} is C {c} ({want.name}) but CuPy passes this "
                                    f"{type(a).__name__} as {got.name}: pass numpy.{want.name}(...)")
                host.append(want.type(a.item() if isinstance(a, numpy.ndarray) else a))
        _emulator().launch(self.name, self.module.dtype, int(grid[0]), int(block[0]), host, code=self.module.code)
        LAUNCHES[self.name] = LAUNCHES.get(self.name, 0) + 1


class RawModule:
    """cupy.RawModule (cupy/_core/raw.pyx): code= CUDA source whose `typedef X T;` names the
    storage dtype (minitf/kernels.py source(dtype), or another version's); its kernels run in
    tests/cuda_emulator.py, compiled from this code."""

    def __init__(self, *, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        if (code is None) == (path is None):
            raise TypeError("Exactly one of `code` and `path` keyword arguments must be given.")
        if path is not None or not isinstance(code, str):
            raise TypeError("strict_cupy: RawModule(code=<str>) only")
        if not isinstance(options, tuple):   # raw.pyx: tuple options
            raise TypeError(f"Argument 'options' has incorrect type (expected tuple, got {type(options).__name__})")
        self.code, self.options = code, options
        self.typedefs = dict((alias, ctype) for ctype, alias in re.findall(r"typedef\s+([\w ]+?)\s+(\w+)\s*;", code))
        self.dtype = numpy.dtype(self.dtype_of("T"))
        self.kernels, self.bounds = parse_kernels(code), parse_launch_bounds(code)

    def dtype_of(self, c):
        c = self.typedefs.get(c, c)
        if c not in _C_DTYPES:
            raise TypeError(f"strict_cupy: C type {c!r} has no emulated dtype")
        return _C_DTYPES[c]

    def get_function(self, name):
        if not isinstance(name, str):
            raise TypeError("Argument 'name' has incorrect type (expected str)")
        if name not in self.kernels:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name!r} is no extern \"C\" "
                               f"__global__ kernel of the module)")
        from minitf import kernels as mk   # the emulator builds its launchers from kernels.declared_signatures (kernels.py's
        # reading of the declarations, SIGNATURES for its own source): this reading must agree
        want = [c.replace(" ", "") for c in self.kernels[name]]
        have = [c.replace(" ", "") for c in mk.declared_signatures(self.code).get(name, [])]
        if want != have:
            raise AssertionError(f"minitf.kernels.declared_signatures reads {name!r} as {have} but the CUDA source "
                                 f"declares {want}")
        _emulator()._lib(self.dtype, self.code)   # compiles now (this module's code), as CuPy does in get_function
        return _RawKernel(self, name, self.kernels[name])


_EMULATOR = []


def _emulator():
    if not _EMULATOR:
        from cuda_emulator import Emulator, compiler, kernel_dir
        if compiler() is None:
            raise RuntimeError("strict_cupy: no C++ compiler that builds tests/cuda_emulator.py's shim (g++ >= 12)")
        _EMULATOR.append(Emulator(kernel_dir()))
    return _EMULATOR[0]


# ============================================================================ cuda
class _CurrentDevice(threading.local):
    """The current device, per thread as CUDA's (and CuPy's cuBLAS handles) are: a new thread starts on device 0,
    whatever the thread that made it uses."""
    id = 0


_CURRENT_DEVICE = _CurrentDevice()


def _device_count():
    return int(os.environ.get("STRICT_CUPY_DEVICES", "1"))


class _Device:
    """cupy.cuda.Device: a number here."""

    def __init__(self, device=None):
        self.id = _CURRENT_DEVICE.id if device is None else int(device)
        if not 0 <= self.id < _device_count():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def use(self):
        _CURRENT_DEVICE.id = self.id

    @property
    def compute_capability(self):
        """'90' (an H100's, as CuPy writes it), or what STRICT_CUPY_COMPUTE_CAPABILITY says."""
        return os.environ.get("STRICT_CUPY_COMPUTE_CAPABILITY", "90")


class _Stream:
    """The current (null) stream: every operation here has finished when it returns."""
    ptr = 0

    def synchronize(self):
        _land_copies()


class _MemoryPool:
    """cupy.get_default_memory_pool(): bytes of the live device arrays (no caching)."""

    def used_bytes(self):
        return sum(a.nbytes for a in list(_LIVE.values()))

    total_bytes = used_bytes

    def free_all_blocks(self):
        pass


_POOL = _MemoryPool()

_runtime = types.ModuleType(__name__ + ".cuda.runtime")
_runtime.getDeviceCount = _device_count
_runtime.getDevice = lambda: _CURRENT_DEVICE.id
_runtime.getDeviceProperties = lambda device: {"name": b"strict_cupy (NumPy)", "totalGlobalMem": 1 << 34,
                                              "multiProcessorCount": 1, "major": 9, "minor": 0}

# ---------------------------------------------------------------------------- cuBLAS
# cupy_backends/cuda/libs/cublas.pyx: gemmEx and gemmStridedBatchedEx take raw pointers and
# column-major sizes; cuBLAS's documented rules (cublas docs, "cublasGemmEx") are checked here.
_cublas = types.ModuleType(__name__ + ".cuda.cublas")
_cublas.CUBLAS_OP_N, _cublas.CUBLAS_OP_T = 0, 1
_cublas.CUBLAS_COMPUTE_32F, _cublas.CUBLAS_COMPUTE_32F_FAST_TF32, _cublas.CUBLAS_COMPUTE_64F = 68, 77, 70
_cublas.CUBLAS_GEMM_DEFAULT, _cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
_CUBLAS_HANDLE = 0x5ca1ab1e
_CUDA_DTYPES = {0: numpy.float32, 1: numpy.float64, 2: numpy.float16, 14: BFLOAT16}   # CUDA_R_32F, _64F, _16F, _16BF
# compute type -> (alpha/beta C type, the (A, B, C) storage types cuBLAS accepts with it)
_COMPUTE = {68: ("f", {(2, 2, 2), (2, 2, 0), (14, 14, 14), (14, 14, 0), (0, 0, 0)}),       # CUBLAS_COMPUTE_32F
            77: ("f", {(0, 0, 0)}),                             # CUBLAS_COMPUTE_32F_FAST_TF32
            70: ("d", {(1, 1, 1)})}                             # CUBLAS_COMPUTE_64F
CUBLAS_CALLS = []   # (function, m, n, k, batch, dtype name) of every GEMM, for tests


def _cublas_operand(what, ptr, dtype, rows, cols, ld, stride, batch, writable=False):
    """The column-major rows x cols matrices (batch of them, `stride` elements apart) at raw
    pointer ptr, as a NumPy view [batch, rows, cols]; refuses a pointer into no live buffer, a
    wrong or misaligned dtype, a leading dimension below the row count, and reads past the end."""
    if ld < max(1, rows):
        raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: {what}: leading dimension {ld} < max(1, rows {rows})")
    if batch == 0 or rows == 0 or cols == 0:
        return numpy.zeros((batch, rows, cols), dtype=dtype), (ptr, ptr)
    root = next((b for start, b in list(_BUFFERS.items()) if start <= ptr < start + b.nbytes), None)
    if root is None:
        raise RuntimeError(f"cuBLAS {what}: {ptr:#x} points into no live device array whose .data was taken")
    if root.dtype != dtype:
        raise RuntimeError(f"cuBLAS {what}: declared {numpy.dtype(dtype).name}, but the memory holds {root.dtype}")
    if not root.flags.c_contiguous:
        raise RuntimeError(f"strict_cupy: {what}: the buffer is not C-contiguous")
    start = int(root.__array_interface__["data"][0])
    item = root.itemsize
    if (ptr - start) % item:
        raise RuntimeError(f"cuBLAS {what}: pointer {ptr:#x} is not aligned to its {item}-byte elements")
    first = (ptr - start) // item
    last = first + (batch - 1) * stride + (cols - 1) * ld + rows - 1
    if last >= root.size or (batch > 1 and stride < 0):
        raise RuntimeError(f"cuBLAS {what}: reads elements {first}..{last} of a buffer of {root.size} "
                           f"(rows {rows}, cols {cols}, ld {ld}, stride {stride}, batch {batch}): out of bounds")
    flat = root.reshape(-1)
    view = numpy.lib.stride_tricks.as_strided(flat[first:], shape=(batch, cols, rows),
                                              strides=(stride * item, ld * item, item), writeable=writable)
    return view.transpose(0, 2, 1), (start + first * item, start + (last + 1) * item)


def _cublas_scalar(ptr, ctype):
    import ctypes
    return (ctypes.c_float if ctype == "f" else ctypes.c_double).from_address(ptr).value


def _cublas_gemm(fn, handle, transa, transb, m, n, k, alpha, A, Atype, lda, sA, B, Btype, ldb, sB, beta, C, Ctype,
                 ldc, sC, batch, computeType, algo):
    args = dict(handle=handle, transa=transa, transb=transb, m=m, n=n, k=k, alpha=alpha, A=A, Atype=Atype, lda=lda,
                strideA=sA, B=B, Btype=Btype, ldb=ldb, strideB=sB, beta=beta, C=C, Ctype=Ctype, ldc=ldc, strideC=sC,
                batchCount=batch, computeType=computeType, algo=algo)
    for name, v in args.items():   # Cython's int / size_t / long long parameters
        if not isinstance(v, (int, numpy.integer)) or isinstance(v, bool):
            raise TypeError(f"cublas.{fn}: {name} must be an int, got {type(v).__name__}")
        if name in ("m", "n", "k", "lda", "ldb", "ldc", "batchCount", "transa", "transb", "Atype", "Btype", "Ctype",
                    "computeType", "algo") and not -2 ** 31 <= v < 2 ** 31:
            raise OverflowError(f"cublas.{fn}: {name}={v} does not fit a C int")
    if handle != _CUBLAS_HANDLE:
        raise RuntimeError(f"CUBLAS_STATUS_NOT_INITIALIZED: cublas.{fn}: {handle:#x} is not a cuBLAS handle "
                           f"(cupy.cuda.device.get_cublas_handle())")
    if transa not in (0, 1) or transb not in (0, 1):
        raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: cublas.{fn}: transa/transb {transa}/{transb} (OP_N 0, OP_T 1)")
    if min(m, n, k, batch) < 0:
        raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: cublas.{fn}: m, n, k, batchCount {m}, {n}, {k}, {batch}")
    if algo not in (-1, 99):
        raise RuntimeError(f"strict_cupy: cublas.{fn}: algo {algo} (CUBLAS_GEMM_DEFAULT -1 or _TENSOR_OP 99)")
    if computeType not in _COMPUTE:
        raise RuntimeError(f"CUBLAS_STATUS_INVALID_VALUE: cublas.{fn}: compute type {computeType} not emulated")
    ctype, allowed = _COMPUTE[computeType]
    if (Atype, Btype, Ctype) not in allowed:
        raise RuntimeError(f"CUBLAS_STATUS_NOT_SUPPORTED: cublas.{fn}: types A {Atype}, B {Btype}, C {Ctype} with "
                           f"compute type {computeType}")
    a_rows, a_cols = (m, k) if transa == 0 else (k, m)
    b_rows, b_cols = (k, n) if transb == 0 else (n, k)
    a, ra = _cublas_operand("A", A, _CUDA_DTYPES[Atype], a_rows, a_cols, lda, sA, batch)
    b, rb = _cublas_operand("B", B, _CUDA_DTYPES[Btype], b_rows, b_cols, ldb, sB, batch)
    c, rc = _cublas_operand("C", C, _CUDA_DTYPES[Ctype], m, n, ldc, sC, batch, writable=True)
    for r, what in ((ra, "A"), (rb, "B")):
        if r[0] < rc[1] and rc[0] < r[1] and rc[0] != rc[1]:
            raise RuntimeError(f"cuBLAS {fn}: C overlaps {what} (undefined in cuBLAS)")
    if batch > 1 and sC < m + (n - 1) * ldc and n * m:
        raise RuntimeError(f"cuBLAS {fn}: strideC {sC} makes the batch's C matrices overlap")
    acc = numpy.float64 if ctype == "d" else numpy.float32
    al, be = _cublas_scalar(alpha, ctype), _cublas_scalar(beta, ctype)
    opa = a.astype(acc) if transa == 0 else a.astype(acc).transpose(0, 2, 1)
    opb = b.astype(acc) if transb == 0 else b.astype(acc).transpose(0, 2, 1)
    out = acc(al) * numpy.matmul(opa, opb)
    if be != 0:   # beta == 0: C is not read (cuBLAS: "C need not be a valid input")
        out += acc(be) * c.astype(acc)
    c[...] = out
    CUBLAS_CALLS.append((fn, m, n, k, batch, c.dtype.name))
    LAUNCHES[f"cublas.{fn}"] = LAUNCHES.get(f"cublas.{fn}", 0) + 1


def _gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType,
            algo):
    _cublas_gemm("gemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype,
                 ldc, 0, 1, computeType, algo)


def _gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
                          beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
    _cublas_gemm("gemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                 ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)


_cublas.gemmEx, _cublas.gemmStridedBatchedEx = _gemmEx, _gemmStridedBatchedEx
_device_module = types.ModuleType(__name__ + ".cuda.device")
_device_module.get_cublas_handle = lambda: _CUBLAS_HANDLE

_nccl = types.ModuleType(__name__ + ".cuda.nccl")
_nccl.available = True
for _i, _n in enumerate(("NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG")):
    setattr(_nccl, _n, _i)
_NCCL_DTYPES = {6: numpy.float16, 7: numpy.float32, 8: numpy.float64, 9: BFLOAT16}
_nccl.NCCL_FLOAT16, _nccl.NCCL_FLOAT32, _nccl.NCCL_FLOAT64, _nccl.NCCL_BFLOAT16 = 6, 7, 8, 9


def _get_unique_id():
    """cupy_backends/cuda/libs/nccl.pyx (CuPy 14): 128 bytes."""
    return os.urandom(128)


class _NcclCommunicator:
    """NCCL's communicator faked over MPI.COMM_WORLD: rank r of ndev, one device per rank."""

    def __init__(self, ndev, commId, rank, config=None):
        from mpi4py import MPI
        if not isinstance(commId, bytes) or len(commId) != 128:
            raise ValueError(f"commId length {len(commId)} != 128." if isinstance(commId, bytes) else
                             "Argument 'commId' has incorrect type (expected bytes)")
        self.comm = MPI.COMM_WORLD
        self.MPI = MPI
        if (self.comm.Get_size(), self.comm.Get_rank()) != (ndev, rank):
            raise RuntimeError(f"NCCL error: rank {rank} of {ndev}, but MPI has rank {self.comm.Get_rank()} of "
                               f"{self.comm.Get_size()}")
        seen = self.comm.allgather((commId, _CURRENT_DEVICE.id))
        if len({s[0] for s in seen}) != 1:
            raise RuntimeError("NCCL error: the ranks were given different unique ids")
        if len({s[1] for s in seen}) != len(seen):
            raise RuntimeError("NCCL error: invalid usage (two ranks on one device: call Device(i).use() first)")

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        for v, what in ((sendbuf, "sendbuf"), (recvbuf, "recvbuf"), (count, "count"), (datatype, "datatype"),
                        (op, "op"), (stream, "stream")):
            if not isinstance(v, (int, numpy.integer)):
                raise TypeError(f"allReduce: {what} must be an int (a raw pointer or enum), got {type(v).__name__}")
        if op != _nccl.NCCL_SUM:
            raise NotImplementedError("strict_cupy: only NCCL_SUM is emulated")
        dtype = _NCCL_DTYPES.get(datatype)
        bufs = []
        for ptr in (sendbuf, recvbuf):
            a = _PTRS.get(ptr)
            if a is None:
                raise RuntimeError(f"NCCL error: {ptr:#x} is not the data pointer of a live device array")
            if a.dtype != dtype or not a.flags.c_contiguous or a.size < count:
                raise RuntimeError(f"NCCL error: buffer {a.dtype} {a.shape} does not hold {count} "
                                   f"contiguous {numpy.dtype(dtype).name}")
            bufs.append(a.reshape(-1)[:count])
        send, recv = bufs
        if send.itemsize == 2:   # NCCL sums 16-bit floats in 16 bits: each rank's addition rounded (a ring's order)
            parts = self.comm.allgather(send.copy())
            work = parts[0]
            for part in parts[1:]:
                work = (work.astype(numpy.float32) + part.astype(numpy.float32)).astype(send.dtype)
        else:
            work = send.copy()
            self.comm.Allreduce(self.MPI.IN_PLACE, work, op=self.MPI.SUM)
        recv[...] = work
        LAUNCHES["nccl.allReduce"] = LAUNCHES.get("nccl.allReduce", 0) + 1


_nccl.get_unique_id = _get_unique_id
_nccl.NcclCommunicator = _NcclCommunicator

cuda = types.ModuleType(__name__ + ".cuda")
cuda.runtime, cuda.nccl, cuda.Device, cuda.Stream = _runtime, _nccl, _Device, _Stream
cuda.cublas, cuda.device, cuda.get_cublas_handle = _cublas, _device_module, _device_module.get_cublas_handle
cuda.MemoryPointer = _MemoryPointer
cuda.Event, cuda.alloc_pinned_memory = _Event, PinnedMemoryPointer
cuda.get_current_stream = lambda: _Stream()
cuda.is_available = lambda: _device_count() > 0
# `from <module>.cuda import nccl` and importlib find these as they find a package's submodules
sys.modules[cuda.__name__], sys.modules[_nccl.__name__], sys.modules[random.__name__] = cuda, _nccl, random


# ============================================================================ the module's names
def get_default_memory_pool():
    return _POOL


_MODULE_NAMES = {**_FUNCTIONS, **CONSTANTS, "random": random, "cuda": cuda, "RawModule": RawModule,
                 "get_default_memory_pool": get_default_memory_pool}
globals().update({k: v for k, v in _MODULE_NAMES.items() if k not in ("ndarray",)})


def __getattr__(name):
    raise AttributeError(f"module 'cupy' has no attribute {name!r} (strict_cupy: not among the CuPy names checked "
                         f"for minitf: ALLOWED, UFUNCS, CONSTANTS; check CuPy's source before adding it)")
