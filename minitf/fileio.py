"""Atomic file writes: a crash never leaves a half-written checkpoint, tokenizer or result."""
import contextlib
import errno
import os
import platform
import shutil
import stat
import tempfile

from .errors import ConfigError, DataError, MinitfError, signals_held


TMP_PREFIX = ".tmp-"   # atomic_write's temporary file beside `path`: TMP_PREFIX + 8 random characters + its name


def leftover_temp_files(folder, is_ours):
    """The temporary files atomic_write left in `folder` when its process was killed mid-write,
    for the final names `is_ours(name)` accepts (a later start removes its own kind's)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names)
            if n.startswith(TMP_PREFIX) and len(n) > len(TMP_PREFIX) + 8 and is_ours(n[len(TMP_PREFIX) + 8:])
            and os.path.isfile(os.path.join(folder, n))]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


class DiskFull(MinitfError):
    """A write failed for want of space (ENOSPC, or EDQUOT: the quota)."""


def is_disk_full(e):
    return isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))


class WriteFailed(MinitfError):
    """A write refused for another reason than space (no permission, a read-only file system, the file-size limit,
    an I/O error): one line naming the file that was being written (not the temporary file beside it), with `reason`
    (the system's words) kept for callers that say it their own way."""

    def __init__(self, path, error):
        self.path = os.fspath(path)
        self.reason = getattr(error, "reason", None) or getattr(error, "strerror", None) or str(error)
        super().__init__(f"{self.path}: cannot write it ({self.reason})")


def disk_full(what, folder, size_hint=None, advice=None):
    """The one-line MinitfError for a full disk (or quota) while writing `what` into `folder`."""
    free = shutil.disk_usage(folder).free
    need = f"; writing it takes {size_hint / 1e6:,.1f} MB" if size_hint else ""
    return DiskFull(f"{what}: no space left on the device of {folder}, the disk is full ({free / 1e6:,.1f} MB "
                    f"free{need}); {advice or 'free some space and run again'}")


def make_folder(path, what, flag):
    """os.makedirs(path, exist_ok=True); a folder that cannot be made (below a file, no permission) is a one-line
    DataError naming `what` it is (e.g. "the data folder") and the flag that chooses it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot make {what} {path} ({e.strerror or e}): name another ({flag})") from None


def check_output_file(path, flag):
    """ConfigError unless `path` can be written as a file: its folder exists (a mistyped folder is not made), and it
    is no folder itself."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(("/", os.sep)):   # "new/": a folder's name, not a file's
        raise ConfigError(f"{flag} {path} is a folder; name the file to write")
    check_parent_folder(path, flag)


def not_a_regular_file(path):
    """What `path` is where it exists and is no regular file nor folder (through a link, what the link leads to): "a
    pipe", "a device", "a socket" (with the link's target named); None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:   # nothing there (or a link to nowhere): a new file
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
    return f"a link to {os.path.realpath(path)}, {kind}" if os.path.islink(path) else kind


def written_in_place(path):
    """Whether the file `path` is to be written in place rather than atomically (atomic_write: a temporary file beside
    it, renamed over it): True for an existing file that opens for writing in a folder that takes no new file (a
    read-only folder holding a writable file, as a shell's `>` writes it); False where a temporary file can be made
    there (or the disk is full: atomic_write says so). OSError where neither can be written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)
    except OSError as e:
        if is_disk_full(e):
            return False
        if os.path.isfile(path):
            try:
                os.close(os.open(path, os.O_WRONLY))   # (no O_TRUNC: nothing written)
                return True
            except OSError:
                pass
        raise
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:   # (a folder that takes files but lets none be removed: the write will say so)
        pass
    return False


def check_parent_folder(path, flag):
    """ConfigError unless the folder `path` goes into exists (a mistyped folder is not made) and is a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: {folder} is a file, not a folder; fix the path" if os.path.exists(folder)
                          else f"{flag} {path}: the folder {folder} does not exist; create it first or fix the path")


def check_export_folder(out_dir, names, earlier, what):
    """ConfigError where writing the files `names` into the folder `out_dir` would replace files that are not those of
    an earlier minitf export of the same kind (`earlier(out_dir)` says whether the folder holds one): a run's folder
    keeps its model.npz and config.json, an OPUS-MT folder or another converter's CTranslate2 model its files. A new or empty folder, or an earlier export (written again), is taken."""
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} is a file; name the folder to write the {what} into")
    clash = sorted(n for n in names if os.path.lexists(os.path.join(out_dir, n)))
    if clash and not earlier(out_dir):
        raise ConfigError(f"{out_dir} holds {', '.join(clash)}, and no {what} minitf exported: writing the {what} "
                          f"there would replace {'it' if len(clash) == 1 else 'them'} (another model's files, or a run's "
                          f"folder?); name a new or empty folder")


def atomic_write(path, write, size_hint=None, advice=None):
    """write(fileobj) into a temp file beside `path`, fsync it, rename it over `path`, fsync the dir.

    A new file gets the permissions of any new file (0666 less the umask), not the temporary
    file's 0600, so a teammate can read a shared run's checkpoints; a file written over keeps its own (a
    private 0600 file had become readable by all). A full disk is a one-line
    MinitfError naming the folder, its free space, (with `size_hint`, bytes) what was needed and
    `advice` (what to do; default: free some space); the previous file at `path` is untouched."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise MinitfError(f"{path} is a folder: name the file to write inside it")
    special = not_a_regular_file(path)
    if special:   # renamed over, a pipe or a device (through a link: /dev/null itself) had become a regular file
        raise WriteFailed(path, f"{special}: a file written whole is renamed over the one there; name a regular file")
    if os.path.islink(path):   # written through: the link stays, its target gets the new file
        path = os.path.realpath(path)
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    # the temporary name is longer by the prefix and 8 random characters: a name near the file system's 255 bytes
    # keeps only its end
    # (cut whole characters: a character cut in two is no name a UTF-8-only file system takes)
    suffix = name if len(os.fsencode(name)) <= 200 else os.fsencode(name)[-40:].decode(errors="ignore")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=folder)
    except OSError as e:   # no space (or no inode, the quota) to make the file is a full disk, as below
        raise (disk_full(path, folder, size_hint, advice) if is_disk_full(e) else WriteFailed(path, e)) from None
    try:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:   # a new file
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if is_disk_full(e):
            raise disk_full(path, folder, size_hint, advice) from None
        if isinstance(e, OSError):   # the file-size limit (EFBIG), an I/O error: one line, not a traceback
            raise WriteFailed(path, e) from None
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some filesystems do not fsync directories
        pass


STAGING = ".minitf-staging-"   # staging_folder's names: STAGING + what + random characters


@contextlib.contextmanager
def export_into(out_dir):
    """Hold the folder an export writes (`out_dir`) for the block: a second export into it meanwhile is refused,
    naming the first (fileio.folder_lock), and the staging folders of an export killed there (SIGKILL, a power cut:
    nothing removed them) are removed first, as nothing else can be writing them. A link to nowhere is refused."""
    out_dir = os.fspath(out_dir)
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise ConfigError(f"--out {out_dir} is a link to nowhere (to {os.readlink(out_dir)}): name a folder, or make "
                          f"the one it points to")
    with folder_lock(out_dir, refuse_if_busy("--out", out_dir)):
        if os.path.isdir(out_dir):
            for name in os.listdir(out_dir):
                if name.startswith(STAGING) and os.path.isdir(os.path.join(out_dir, name)):
                    shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
        yield


@contextlib.contextmanager
def staging_folder(out_dir, what):
    """A hidden folder inside out_dir (STAGING + `what` + random characters; made where missing; removed again if the
    block fails) for files to be written whole before move_in puts them in place: on out_dir's own file system,
    whatever a link or a mount makes it."""
    prefix = STAGING + what + "-"
    created = not os.path.lexists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=prefix, dir=os.path.realpath(out_dir)) as made:
            yield made
    except BaseException:
        if created and not os.listdir(out_dir):   # nothing moved in yet (a signal held by move_in comes after)
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def move_in(made, out_dir, names):
    """The files `names` of the folder `made` into `out_dir`, each replacing its namesake, with Ctrl-C and SIGTERM held
    back until all are in (handled then): an export written file by file into its folder, stopped part-way, had
    left one model's weights beside another's vocabulary. `made` is on out_dir's file system (renames)
    (errors.signals_held)."""
    os.makedirs(out_dir, exist_ok=True)
    with signals_held(replay=True):
        for name in names:
            os.replace(os.path.join(made, name), os.path.join(out_dir, name))


def atomic_write_bytes(path, data):
    atomic_write(path, lambda f: f.write(data))


def lock_path(folder):
    """The lock file of a folder: `.<name>.lock` beside it, the folder's real path (a link to it, or a path through
    one, takes the same lock); a name too long for the lock's own (255 bytes) is cut and told apart by its hash."""
    parent, name = os.path.split(os.path.realpath(folder))
    return os.path.join(parent, f".{fit_name(name, 200, 100)}.lock")


def fit_name(name, most, keep):
    """`name`, or where it is over `most` bytes (the room a longer name built on it leaves under a file system's 255),
    its first `keep` bytes and a hash of the whole, which tells such names apart. (fsencode: a name of bytes that are
    not UTF-8 is one of a file system's too.)"""
    if len(os.fsencode(name)) <= most:
        return name
    import hashlib
    return os.fsencode(name)[:keep].decode(errors="ignore") + "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]


INNER_LOCK = ".minitf.lock"   # a folder's lock inside it, where its parent cannot be written


def _lock_paths(folder):
    """Where `folder`'s lock may be: beside it (lock_path: it also guards the folder's making), then inside it (a
    folder one may write whose parent one may not, such as a mounted volume: it had run unlocked, and two trainings
    had written one --out)."""
    return lock_path(folder), os.path.join(os.path.realpath(folder), INNER_LOCK)


def _open_lock(folder, flags):
    """(fd, path) of the first of `folder`'s lock files that opens with `flags`; OSError if none does."""
    beside, inside = _lock_paths(folder)
    try:
        return os.open(beside, flags, 0o644), beside
    except OSError:
        if not os.path.isdir(inside.rsplit(os.sep, 1)[0]) or os.path.exists(beside):   # (a lock file there is it)
            raise
        return os.open(inside, flags, 0o644), inside


def _take_soon(fd, fcntl, tries=5, wait=0.05):
    """The exclusive lock on fd within tries * wait seconds, else BlockingIOError: a look at the lock (lock_holder,
    `info` of a run) holds it for an instant, and is not a run holding the folder."""
    import time
    for i in range(tries):
        try:
            return fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if i == tries - 1:
                raise
            time.sleep(wait)


def _holder(fd):
    """Who the lock file open as fd says holds it ("process PID on HOST", written by folder_lock)."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"


def lock_holder(folder):
    """Who holds `folder`'s lock now ("process PID on HOST"), or None: no live process holds it (or the file system
    cannot lock, or there is no lock file)."""
    try:
        import fcntl
        fd, _ = _open_lock(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None   # taken at once: nobody holds it
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)   # a lock taken here goes with it


@contextlib.contextmanager
def folder_lock(folder, busy):
    """Hold `folder`'s lock for the block: an exclusive `flock` on `lock_path(folder)`, the file
    holding the holder's name ("process PID on HOST"). When another live process holds it,
    busy(holder, path) is called: it raises to refuse, or returns to wait for the lock. A holder
    that died released the lock with its file descriptor, so its stale file is simply taken over.
    The lock file is beside the folder, or inside it (INNER_LOCK) where the parent cannot be written.
    Where the file system cannot lock (no `fcntl`, a read-only or lockless mount), the block runs
    unlocked."""
    try:
        import fcntl
        os.makedirs(os.path.dirname(lock_path(folder)), exist_ok=True)
        fd, path = _open_lock(folder, os.O_RDWR | os.O_CREAT)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            _take_soon(fd, fcntl)
        except BlockingIOError:
            busy(_holder(fd), path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:   # ENOLCK, EOPNOTSUPP: this file system does not lock
            pass
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {platform.node()}".encode(), 0)
        yield
    finally:
        os.close(fd)   # releases the lock


def refuse_if_busy(what, folder):
    """A `folder_lock` busy-handler that refuses: one MinitfError naming the holder."""
    def busy(holder, path):
        raise MinitfError(f"{what} {folder} is in use by {holder}, which is writing to it (lock {path}): wait for it "
                          f"to end, or choose another {what}")
    return busy
