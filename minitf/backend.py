"""The one module that imports CuPy (guarded). Everything else asks the arrays for `xp`.

`--device cpu` means NumPy, `--device gpu` means CuPy. Asking for the GPU without CuPy, or
with CuPy but no usable CUDA device, raises one `DeviceError` that says which.

The environment variable MINITF_CUPY_MODULE (default `cupy`) names the module imported as
CuPy: the tests set it to `strict_cupy` (tests/strict_cupy.py, a stand-in on NumPy that
refuses what CuPy refuses and counts the transfers) to run the GPU path without a GPU, e.g.
`PYTHONPATH=tests MINITF_CUPY_MODULE=strict_cupy python train_wmt.py --device gpu ...`.
In a process, replacing `backend.cupy` does the same: all of minitf reaches CuPy through it.
"""
import contextlib
import importlib
import os
import threading

import numpy

from .errors import DeviceError

CUPY_MODULE = os.environ.get("MINITF_CUPY_MODULE", "cupy")
try:  # the only cupy import in minitf
    cupy = importlib.import_module(CUPY_MODULE)
    _CUPY_IMPORT_ERROR = None
except Exception as e:  # ImportError, or a broken CUDA install raising something else
    cupy = None
    _CUPY_IMPORT_ERROR = e

DEVICES = ("cpu", "gpu")
DTYPES = ("float64", "float32", "float16", "bfloat16")   # float16 and bfloat16: mixed precision (half_dtype)


def dtype_named(name):
    """The NumPy dtype of a name in DTYPES. NumPy has no bfloat16: its dtype comes from the
    ml_dtypes package, the one CuPy 14 uses for bfloat16 arrays (a DeviceError says how to get it)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise DeviceError(f"bfloat16 (--bf16) needs the ml_dtypes package, which CuPy uses for its bfloat16 "
                              f"arrays ({e}); install it with `pip install ml_dtypes`") from None
        return numpy.dtype(ml_dtypes.bfloat16)
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return numpy.dtype(name)


def check_gpu_dtype(dtype):
    """A DeviceError unless CuPy computes in `dtype` here: bfloat16 needs CuPy 14 or newer with
    ml_dtypes installed, on NumPy 2.1.2 or newer (CuPy leaves its bfloat16 loops out otherwise). The kinds of
    CuPy kernel a bfloat16 run makes are compiled here, up front, not in the middle of a run: a sum of two arrays,
    casts, a product with a Python float into a bfloat16 array (float32's loop with ml_dtypes before 0.7, bfloat16's
    from 0.7 on), and an argmax (decoding's)."""
    if dtype.name != "bfloat16":
        return
    try:
        x = cupy.ones(2, dtype=dtype)
        (x + x).astype(numpy.float32)
        cupy.multiply(x, 0.5, out=x)
        x.argmax()
    except Exception as e:
        raise DeviceError(f"--bf16: CuPy {getattr(cupy, '__version__', '?')} cannot compute in bfloat16 here "
                          f"({type(e).__name__}: {e}); it needs CuPy 14 or newer with ml_dtypes, on NumPy 2.1.2 "
                          f"or newer (this one: {numpy.__version__})") from None


def gpu_arch():
    """The current GPU's compute capability as major * 10 + minor (90 for an H100)."""
    return int(cupy.cuda.Device().compute_capability)


def half_dtype(dtype):
    """Whether dtype is a 16-bit compute dtype (float16 or bfloat16), kept beside float32 master weights."""
    return dtype == numpy.float16 or (dtype.itemsize == 2 and dtype.name == "bfloat16")


def gpu_available():
    """(ok, reason): whether `get_xp('gpu')` would work, and why not."""
    if cupy is None:
        return False, (f"CuPy is not installed ({_CUPY_IMPORT_ERROR}); install it with `pip install -e \".[gpu]\"` "
                       f"(CUDA 12 drivers) or `\".[gpu13]\"` (CUDA 13)")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"CuPy is installed but CUDA is not usable: {e}"
    if n == 0:
        return False, "CuPy is installed but no CUDA GPU is visible"
    return True, ""


def get_xp(device):
    """Array module for a device name: 'cpu' -> numpy, 'gpu' -> cupy."""
    if device == "cpu":
        return numpy
    if device == "gpu":
        ok, why = gpu_available()
        if not ok:
            raise DeviceError(f"device 'gpu' (--device gpu): {why}; run on NumPy with device 'cpu' (--device cpu)")
        return cupy
    raise DeviceError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")


def xp_of(*arrays):
    """The array module (numpy or cupy) the given arrays live in: cupy if any of them is a CuPy
    array (what cupy.get_array_module says for the arrays minitf makes, without its call: the
    GPU step asks this hundreds of times)."""
    if cupy is not None:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    return numpy


def is_gpu(xp):
    return cupy is not None and xp is cupy


def to_numpy(a):
    """A host (NumPy) copy/view of an array from either device."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return numpy.asarray(a)


def to_numpy_all(*arrays):
    """Host copies of several arrays with ONE device->host copy (on a GPU each copy waits for the
    queued work: one synchronisation instead of one per array): their bytes are concatenated on
    the device, copied, and split on the host. NumPy arrays come back as they are."""
    if cupy is None or not isinstance(arrays[0], cupy.ndarray):
        return [to_numpy(a) for a in arrays]
    flat = cupy.concatenate([cupy.ascontiguousarray(a).reshape(-1).view(numpy.uint8) for a in arrays])
    host, out, start = cupy.asnumpy(flat), [], 0
    for a in arrays:
        out.append(host[start: start + a.nbytes].view(a.dtype).reshape(a.shape))
        start += a.nbytes
    return out


def to_device(a, xp):
    """Move a NumPy (or CuPy) array to the device of `xp`."""
    if is_gpu(xp):
        return cupy.asarray(a)
    return to_numpy(a)


class HostCopy:
    """A small device array's copy to the host that does not wait for the GPU: `start(a)` queues
    the copy on the current stream, after the work queued so far, into page-locked host memory
    (so the copy itself is asynchronous) and records an event behind it; `result()` waits for that
    event only, not for the work queued after it, and returns the values. The training loop starts
    the copy of an update's outcome and reads it an update later, while the next one computes.
    On NumPy there is nothing to wait for: `start` copies, `result` returns the copy."""

    def __init__(self, xp, size, dtype):
        self._gpu = is_gpu(xp)
        dtype = numpy.dtype(dtype)
        if self._gpu:
            self._host = numpy.frombuffer(cupy.cuda.alloc_pinned_memory(size * dtype.itemsize), dtype, size)
            self._event = cupy.cuda.Event(disable_timing=True)
        else:
            self._host = numpy.empty(size, dtype)

    def start(self, a):
        if self._gpu:
            cupy.asnumpy(a, out=self._host, blocking=False)
            self._event.record()
        else:
            self._host[...] = a

    def result(self):
        if self._gpu:
            self._event.synchronize()
        return self._host.copy()


def synchronize(xp):
    """Wait for queued GPU work (timing only); a no-op on CPU."""
    if is_gpu(xp):
        cupy.cuda.get_current_stream().synchronize()


def select_gpu(index):
    """Make GPU `index` the current device of this process (a rank takes its local rank's GPU)."""
    if cupy is None:
        raise DeviceError(gpu_available()[1])
    n = cupy.cuda.runtime.getDeviceCount()
    if index >= n:
        raise DeviceError(f"this rank needs GPU {index} but the machine has {n}: launch at most {n} ranks per machine")
    cupy.cuda.Device(index).use()


def nccl_module():
    """cupy.cuda.nccl (NCCL, the GPU all-reduce); DeviceError saying what to install otherwise."""
    if cupy is None:
        raise DeviceError(gpu_available()[1])
    try:
        nccl = importlib.import_module(cupy.__name__ + ".cuda.nccl")
    except ImportError as e:
        raise DeviceError(f"CuPy has no NCCL ({e}): install NCCL for your CUDA (pip install -e \".[gpu]\" brings "
                          f"nvidia-nccl-cu12, \".[gpu13]\" nvidia-nccl-cu13) to train on several GPUs") from None
    if not getattr(nccl, "available", True):
        raise DeviceError("CuPy was built without NCCL: install nvidia-nccl-cu12 (or -cu13; the gpu/gpu13 extras "
                          "bring them) to train on several GPUs")
    return nccl


def current_stream_ptr():
    """The raw pointer of the current CUDA stream (what NCCL calls take)."""
    return cupy.cuda.get_current_stream().ptr


def keep_freed_memory():
    """Ask glibc malloc to keep freed memory instead of returning it to the OS.

    NumPy allocates a fresh array for almost every operation; big ones (over glibc's mmap
    threshold) are mmap-ed and unmapped each time, so every training step page-faults
    through hundreds of MB. With a high mmap and trim threshold, the freed blocks are
    reused from the heap instead: measured 17% less time per training step (2.418 -> 2.013 s on
    Multi30k batches of 4096 tokens; docs/benchmarks.md). Process-wide, CPU only, and a no-op where glibc is absent.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
    except (OSError, AttributeError):
        pass


_MALLOC_TUNED = False


def release_freed_memory():
    """Give the heap's free pages back to the OS now (glibc malloc_trim), the counterpart of
    `keep_freed_memory` for a rare, large, temporary peak: planning an epoch of a 36M-pair corpus
    sorts arrays of hundreds of MB, which would otherwise stay resident until the next epoch.
    A no-op where glibc is absent."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _openblas_local_threads():
    """OpenBLAS's openblas_set_num_threads_local (0.3.27+: the BLAS threads of the CALLING
    thread only) from the OpenBLAS NumPy is linked with, or None (another BLAS, no /proc)."""
    global _LOCAL_THREADS
    if _LOCAL_THREADS is False:
        _LOCAL_THREADS = None
        try:
            import ctypes
            import re
            with open("/proc/self/maps") as f:
                libs = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
            for lib in libs:
                fn = getattr(ctypes.CDLL(lib), "openblas_set_num_threads_local", None)
                if fn is not None:
                    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                    _LOCAL_THREADS = fn
                    break
        except (OSError, AttributeError):
            pass
    return _LOCAL_THREADS


_LOCAL_THREADS = False


def can_limit_blas_threads():
    """Whether `blas_threads` works here (NumPy on OpenBLAS 0.3.27+, Linux)."""
    return _openblas_local_threads() is not None


@contextlib.contextmanager
def blas_threads(n):
    """NumPy's matrix products use n BLAS threads until the block ends, then the count found before. OpenBLAS's
    openblas_set_num_threads_local is meant for the calling thread only, but the OpenBLAS NumPy ships (0.3.31,
    NumPy 2.x wheels) applies it to the whole process: enter it from one thread, around work that waits for any
    threads it starts (translate._side_by_side); blocks of several threads that overlap put back, when the last ends,
    the count found before the first. A no-op where can_limit_blas_threads() is False."""
    fn = _openblas_local_threads()
    if fn is None:
        yield
        return
    entry = object()
    with _BLAS_LOCK:
        found = fn(int(n))
        if not _BLAS_OPEN:
            _BLAS_BEFORE[0] = found   # the count before the first open block
        _BLAS_OPEN.append((entry, found))
    try:
        yield
    finally:
        with _BLAS_LOCK:
            i = next(k for k, (e, _) in enumerate(_BLAS_OPEN) if e is entry)
            _, found = _BLAS_OPEN.pop(i)
            if not _BLAS_OPEN:
                fn(_BLAS_BEFORE[0])
            elif i == len(_BLAS_OPEN):   # the newest open block (one nested in another): the count it found
                fn(found)


# blas_threads' open blocks, oldest first, with the count each found: a nested block puts back its own count, a block
# that ends before a later one (another thread's) leaves the count alone, and the last to end puts back what the first
# found (two threads' translations had each put back what the other set: the process went on with 1 BLAS thread)
_BLAS_LOCK, _BLAS_OPEN, _BLAS_BEFORE = threading.Lock(), [], [None]


def set_blas_threads(n):
    """From now on, BLAS uses n threads (this thread's, or the process's: blas_threads); False where that cannot be
    set."""
    fn = _openblas_local_threads()
    if fn is not None:
        fn(int(n))
    return fn is not None


def usable_cores():
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
