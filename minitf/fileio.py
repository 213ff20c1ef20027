"""Atomic file writes: a crash never leaves a half-written checkpoint, tokenizer or result."""
import os
import tempfile


def atomic_write(path, write):
    """write(fileobj) into a temp file beside `path`, fsync it, rename it over `path`, fsync the dir."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some filesystems do not fsync directories
        pass


def atomic_write_bytes(path, data):
    atomic_write(path, lambda f: f.write(data))
