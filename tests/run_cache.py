"""What the suite compiles, made once a test run: a compile the test processes (pytest-xdist's -n) would each repeat
(NVRTC's CUBIN of the kernels for an architecture, ptxas's report) is made by the first process to ask, while the
others wait for it, and read by them.

tests/conftest.py gives the run a fresh folder (RUN_CACHE, removed at the run's end), so nothing is kept from one
run to the next: a run compiles what it tests. Without that folder (a test module run outside pytest), `once` makes
the value each time.
"""
import contextlib
import hashlib
import json
import os

try:
    import fcntl
except ImportError:      # no file locks: each process makes its own
    fcntl = None

RUN_CACHE = "MINITF_TEST_RUN_CACHE"


@contextlib.contextmanager
def held(path):
    """An exclusive lock on `path`.lock for the block: a second process asking for the same waits for the first to
    leave it (no lock where there is no fcntl)."""
    if fcntl is None:
        yield
        return
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def once(key, make):
    """make()'s value (JSON: strings, numbers, lists, dicts), made once a test run for `key`, a string that names
    every input of the value (the tool and its version, its options, the source)."""
    folder = os.environ.get(RUN_CACHE)
    if not folder or fcntl is None or not os.path.isdir(folder):
        return make()
    path = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    with held(path):     # a second process asking waits here for the first's value
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        value = make()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, path)
        return json.loads(json.dumps(value))   # what the other processes read: tuples as lists
