"""Downloading and unpacking archives: resumable, checksummed, atomic.

`download` streams to ``<dest>.part``, resumes it with an HTTP Range request after
a cut connection (restarting if the server ignores Range), checks the checksum
and only then renames it to `dest`. The resume carries If-Range with the first
response's validator (its strong ETag, else its Last-Modified, kept beside the part
in ``<dest>.part.validator``), so that a file changed on the server in between is
fetched again whole instead of spliced from two versions (most of WMT's archives
have no checksum to catch that). `extract` unpacks tar/tgz (refusing absolute
paths, ``..`` and links) and single .gz files, writing each file atomically too,
so a half-written file is never mistaken for a complete one.
"""

import datetime
import email.utils
import gzip
import hashlib
import http.client
import os
import re
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zlib

from minitf.data.readers import GZIP_MAGIC, is_gzip
from minitf.errors import DataError
from minitf.progress import bar as progress_bar

_CHUNK = 1 << 16
_USER_AGENT = "minitf-data/0.1 (+python urllib)"


def _network_error(url, reason):
    if reason.startswith("HTTP 429"):
        advice = "the server asks for fewer requests: try again later"
    elif reason.startswith("HTTP 5"):
        advice = "the server is failing: try again later"
    else:
        advice = "check your internet connection"
    return DataError(f"cannot download {url} ({reason}); {advice}, or pass --data-dir pointing at a folder that "
                     f"already holds the data files")


def _http_advice(code):
    """What to do about an HTTP error that is not retried (a client error, a redirect that goes nowhere)."""
    if code in (401, 403, 407):
        return ("the server (or a proxy between) refused access: a network that wants a login first, or a proxy "
                "that needs its settings (HTTPS_PROXY)? Or pass --data-dir with the files already present")
    if 300 <= code < 400:
        return ("its redirects lead nowhere or go round in a loop; check the URL (a mirror of the same layout is named "
                "by MINITF_MULTI30K_BASE_URL or MINITF_WMT_BASE_URL), or pass --data-dir with the files already "
                "present")
    return ("the file is not on the server (check the URL; a mirror of the same layout is named by "
            "MINITF_MULTI30K_BASE_URL or MINITF_WMT_BASE_URL), or pass --data-dir with the files already present")


def _seconds(retry_after):
    """An HTTP Retry-After, in seconds or as a date, as seconds from now (0 to 60; 0 for none or one unreadable)."""
    if not retry_after:
        return 0.0
    try:
        wait = float(retry_after)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(retry_after)
        except (TypeError, ValueError):
            return 0.0
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        wait = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return min(max(wait, 0.0), 60.0) if wait == wait else 0.0


def _validator_path(part):
    return part + ".validator"


def _validator(headers):
    """What a response says its file's version is, for If-Range: a strong ETag, else Last-Modified (RFC 9110 13.1.5:
    a weak ETag cannot be used there), or None."""
    etag = (headers.get("ETag") or "").strip()
    if etag and not etag.startswith("W/"):
        return etag
    return (headers.get("Last-Modified") or "").strip() or None


def _remember_validator(part, value):
    """Keeps the validator of the response a part file starts from beside it (none: forgets it)."""
    path = _validator_path(part)
    if value is None:
        _forget_validator(part)
        return
    try:
        with open(path, "w", encoding="ascii", errors="replace") as f:
            f.write(value)
    except OSError as e:
        raise _WriteError(path, e) from None


def _read_validator(part):
    try:
        with open(_validator_path(part), encoding="ascii", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _forget_validator(part):
    try:
        os.unlink(_validator_path(part))
    except FileNotFoundError:
        pass


def _drop_part(part):
    """Removes a part file and its validator."""
    if os.path.exists(part):
        os.unlink(part)
    _forget_validator(part)


def _part_bytes(part):
    """The bytes a .part file holds for a next run to resume from (0: none)."""
    return os.path.getsize(part) if os.path.isfile(part) else 0


def _kept(part):
    """'; the bytes received are kept ...' where a .part file holds bytes a next run resumes from."""
    n = _part_bytes(part)
    return f"; the {n:,} bytes received are kept in {part}, and a run again resumes from there" if n else ""


def note(msg):
    """One plain line on stderr (not a Python warning with a source line under it)."""
    print(f"note: {msg}", file=sys.stderr, flush=True)


def file_digest(path, algorithm="sha256"):
    """Hex digest of a file's contents."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_digests(path, sha256, md5):
    """None if `path` matches the given checksums, else (algo, expected, actual)."""
    for algo, expected in (("sha256", sha256), ("md5", md5)):
        if expected:
            actual = file_digest(path, algo)
            if actual.lower() != expected.lower():
                return algo, expected, actual
    return None


class NotTheFile(DataError):
    """The server answered with something that is not the file (a web page, an empty body): not retried; an optional
    test set is skipped as one the network did not give (`http_status` None)."""
    http_status = None


class _WriteError(Exception):
    """Writing `path` (the download, or an extracted file) failed: an OSError `error` of the disk's, not the
    network's, so it is not retried."""

    def __init__(self, path, error):
        super().__init__(path, error)
        self.path, self.error = path, error


def _write_failed(path, e):
    """The one-line DataError for a file that could not be written: a full disk says how full."""
    from minitf.fileio import disk_full, is_disk_full
    if is_disk_full(e):
        return disk_full(path, os.path.dirname(os.path.abspath(path)))
    return DataError(f"{path}: cannot write it ({e.strerror or e}); check disk space and permissions")


def _fetch_once(url, part, progress, timeout):
    """One HTTP attempt, appending to `part` if the server honours Range.

    Returns True when the body was received completely; False when the
    connection ended early (the caller retries and resumes).
    """
    have = os.path.getsize(part) if os.path.exists(part) else 0
    headers = {"User-Agent": _USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
        since = _read_validator(part)
        if since:   # the file as it was when the part began, or all of it again (a 200)
            headers["If-Range"] = since
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        status = getattr(resp, "status", 200)
        if resp.headers.get_content_type() == "text/html":   # a login page, a proxy's or a portal's, sent as 200
            raise NotTheFile(f"cannot download {url}: the server sent a web page (text/html), not the file: a "
                             f"network that wants a login first, or a proxy's page? Open the URL in a browser, or "
                             f"pass --data-dir with the files already present")
        mode = "wb"
        if have and status == 206:
            m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            if m and int(m.group(1)) == have:
                mode = "ab"
            else:  # a range we did not ask for: start over
                resp.close()
                _drop_part(part)
                return False
        if mode == "wb":
            have = 0
            _remember_validator(part, _validator(resp.headers))   # the version the part now starts from
        length = resp.headers.get("Content-Length")
        remaining = int(length) if length and length.isdigit() else None
        total = have + remaining if remaining is not None else None
        received = 0
        try:
            f = open(part, mode)
        except OSError as e:
            raise _WriteError(part, e) from None
        with f, progress_bar(total, os.path.basename(part[:-5]), progress, unit="B", initial=have, unit_scale=True,
                             unit_divisor=1024, leave=False) as bar:
            while True:
                chunk = resp.read(_CHUNK)       # an OSError here is the network's: retried
                if not chunk:
                    break
                try:
                    f.write(chunk)
                    f.flush()
                except OSError as e:
                    raise _WriteError(part, e) from None
                received += len(chunk)
                bar.update(len(chunk))
        return remaining is None or received >= remaining


def download(url, dest_path, sha256=None, progress=True, retries=3, md5=None,
             timeout=60.0, backoff=1.0):
    """Download `url` to `dest_path` (atomically) and return `dest_path`.

    If `dest_path` already exists and matches the checksums (or none is given),
    nothing is fetched. A partial ``dest_path + ".part"`` from an earlier attempt
    is resumed with a Range request. Up to `retries` further attempts follow a
    cut connection, a network error or an HTTP 408, 429 or 5xx, each said in a note,
    sleeping ``backoff * 2**k`` seconds (at most 30), or the Retry-After the server
    asks for where longer (at most 60); backoff 0 sleeps not at all.

    DataError when the network fails (the message says to check the connection or
    to use --data-dir with the files already present), on an HTTP error (its code
    is in the error's ``http_status`` attribute), or when the checksum differs
    (naming url, expected and actual digest; no file is left behind).
    """
    dest_path = os.fspath(dest_path)
    if os.path.isfile(dest_path):
        if _check_digests(dest_path, sha256, md5) is None:
            return dest_path
        os.unlink(dest_path)  # stale or corrupt: fetch again
    os.makedirs(os.path.dirname(os.path.abspath(dest_path)), exist_ok=True)
    part = dest_path + ".part"

    last_error, retry_after = "no attempt made", 0.0
    try:
        for attempt in range(int(retries) + 1):
            if attempt:   # a retry, said (a stalled server had been minutes of silence)
                wait = max(min(backoff * 2 ** (attempt - 1), 30.0), retry_after) if backoff else 0.0
                note(f"{url}: {last_error}; trying again" + (f" in {wait:.0f} s" if wait else "")
                      + f" (try {attempt + 1} of {retries + 1})")
                time.sleep(wait)
            retry_after = 0.0
            try:
                if _fetch_once(url, part, progress, timeout):
                    break
                last_error = "connection closed before the end of the file"
            except urllib.error.HTTPError as e:
                e.close()  # release the connection the error response holds
                if e.code == 416 and os.path.exists(part):  # bad resume point: restart
                    _drop_part(part)
                    last_error = "HTTP 416 on resume"
                    continue
                if e.code in (408, 429) or e.code >= 500:   # busy or failing for now: retried, after the wait it asks
                    retry_after = _seconds(e.headers.get("Retry-After") if e.headers else None)
                    last_error = f"HTTP {e.code} {e.reason}"
                    continue
                err = DataError(f"cannot download {url}: HTTP {e.code} {e.reason}; {_http_advice(e.code)}")
                err.http_status = e.code
                raise err from None
            except _WriteError as e:  # writing the file failed: not worth retrying
                raise _write_failed(e.path, e.error) from None
            except (OSError, http.client.HTTPException) as e:   # the network's (URLError, a reset, SSL): retried
                if isinstance(getattr(e, "reason", None), FileNotFoundError):   # a file:// mirror without it: a 404
                    err = DataError(f"cannot download {url}: no such file; {_http_advice(404)}")
                    err.http_status = 404
                    raise err from None
                last_error = str(getattr(e, "reason", None) or e) or e.__class__.__name__
        else:
            tries = f"{retries + 1} tries" if retries else "1 try"
            err = _network_error(url, f"{last_error}; gave up after {tries}" + _kept(part))
            err.http_status = None
            raise err
    except KeyboardInterrupt as e:   # Ctrl-C, SIGTERM: the part downloaded stays for the next run to resume
        kept = _part_bytes(part)
        if kept:
            e.kept = f"{part} ({kept:,} bytes)"
        raise
    if os.path.getsize(part) == 0:
        _drop_part(part)
        raise NotTheFile(f"cannot download {url}: the server sent an empty file; try again later, or pass "
                         f"--data-dir with the files already present")

    mismatch = _check_digests(part, sha256, md5)
    if mismatch is not None:
        algo, expected, actual = mismatch
        _drop_part(part)
        raise DataError(f"checksum mismatch for {url}: expected {algo} {expected}, "
                        f"got {actual}; the download is corrupt or the file changed "
                        f"upstream, try again or fetch it by hand into {dest_path}")
    os.replace(part, dest_path)
    _forget_validator(part)
    return dest_path


def _safe_target(dest_dir, name, archive):
    """Absolute path for archive member `name`, refusing escapes from dest_dir."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith("/") or os.path.isabs(name) or ".." in parts \
            or re.match(r"^[A-Za-z]:", name):
        raise DataError(f"{archive}: unsafe member path {name!r} (absolute or with "
                        f"'..'); refusing to extract, delete the archive")
    root = os.path.abspath(dest_dir)
    target = os.path.abspath(os.path.join(root, *[p for p in parts if p]))
    if os.path.commonpath([root, target]) != root:
        raise DataError(f"{archive}: member {name!r} would be written outside "
                        f"{dest_dir}; refusing to extract, delete the archive")
    return target


def _write_stream(src, target):
    """src's bytes into `target`, through target.part (removed on any failure, Ctrl-C included); a failed write is a
    _WriteError."""
    tmp = target + ".part"
    try:
        try:
            out = open(tmp, "wb")
        except OSError as e:
            raise _WriteError(tmp, e) from None
        with out:
            while True:
                chunk = src.read(_CHUNK)         # a corrupt archive's error here is the archive's
                if not chunk:
                    break
                try:
                    out.write(chunk)
                except OSError as e:
                    raise _WriteError(tmp, e) from None
        os.replace(tmp, target)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _member_name(name):
    while name.startswith("./"):
        name = name[2:]
    return name


def extract(archive, dest_dir, members=None):
    """Unpack a .tar/.tgz/.tar.gz archive, or gunzip a single .gz file.

    `members`: optional collection of tar member names (relative paths) to
    extract; the others are skipped (e.g. the languages of a multilingual
    corpus that are not needed). Tar members with absolute paths or ``..``, and
    selected links or device files, make it raise DataError before anything is
    written. A .gz file becomes `dest_dir`/name-without-.gz. Returns the list of
    extracted file paths.
    """
    archive = os.fspath(archive)
    if not os.path.isfile(archive):
        raise DataError(f"{archive}: archive not found; download it first")
    os.makedirs(dest_dir, exist_ok=True)
    name = os.path.basename(archive)
    written = []
    try:
        if tarfile.is_tarfile(archive):
            if is_gzip(archive):   # tarfile stops at the archive's end marker and never reads gzip's CRC: a
                _read_through(archive, trailing_ok=True)   # damaged .tgz had extracted changed lines without a word
            with tarfile.open(archive, "r:*") as tar:
                wanted = None if members is None else {_member_name(n) for n in members}
                chosen = []
                for m in tar.getmembers():  # check everything before writing
                    _safe_target(dest_dir, m.name, archive)
                    if wanted is not None and _member_name(m.name) not in wanted:
                        continue
                    chosen.append(m)
                    if not (m.isfile() or m.isdir()):
                        raise DataError(f"{archive}: member {m.name!r} is a link or "
                                        f"special file; refusing to extract, delete "
                                        f"the archive")
                for m in chosen:
                    target = _safe_target(dest_dir, m.name, archive)
                    if m.isdir():
                        os.makedirs(target, exist_ok=True)
                        continue
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with tar.extractfile(m) as src:
                        _write_stream(src, target)
                    written.append(target)
        elif name.endswith(".gz"):
            target = _safe_target(dest_dir, name[:-3], archive)
            with gzip.open(archive, "rb") as src:
                _write_stream(src, target)
            written.append(target)
        else:
            raise DataError(f"{archive}: not a tar or .gz archive")
    except _WriteError as e:
        raise _write_failed(e.path, e.error) from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{archive}: corrupt archive ({e})") from None
    except OSError as e:   # a folder that cannot be made in dest_dir, a read error of the disk's
        raise DataError(f"{archive}: cannot extract it into {dest_dir} ({e.strerror or e}); check disk space and "
                        f"permissions") from None
    return written


def set_aside(path):
    """Move a download that failed its check to `path + ".bad"` (replacing an older one), so the
    next run fetches it anew instead of tripping on it; returns the new name (None if it is gone)."""
    bad = path + ".bad"
    try:
        os.replace(path, bad)
    except OSError:
        return None
    return bad


def _read_through(path, keep=1 << 16, trailing_ok=False):
    """Decompress the gzip file `path` to its end, each member's CRC and length checked (zlib checks the trailer),
    1 MiB of output at a time (a small file that inflates to gigabytes costs no more memory); returns its first `keep`
    bytes. After the last member, zero bytes (padding) are ignored, as Python's gzip ignores them; other bytes are
    an error unless `trailing_ok` (an archive for tar, which ignores them too). A damaged or truncated file raises
    zlib.error or EOFError."""
    head, d, members, carry = b"", None, 0, b""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            chunk, carry = carry + chunk, b""
            while chunk:
                if d is None:                     # a member's start, or what follows the last one
                    if chunk == b"\x1f":
                        carry = chunk             # the magic split between two reads
                        break
                    if chunk[:2] != GZIP_MAGIC:
                        if members and (trailing_ok or not chunk.strip(b"\0")):
                            chunk = b""           # padding after the last member: the rest of the file too
                            continue
                        raise zlib.error("not a gzip file" if not members else
                                         f"bytes after the gzip stream that start no gzip member ({chunk[:8]!r})")
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                out = d.decompress(chunk, 1 << 20)
                head += out[:max(keep - len(head), 0)]
                if d.eof:                         # this member ends here: what follows may start another
                    chunk, d, members = d.unused_data, None, members + 1
                else:
                    chunk = d.unconsumed_tail     # more output for this input, or the next read
    if d is not None:
        raise EOFError("the gzip stream ends early (the file is truncated)")
    if not members:
        raise EOFError("the file is empty" if not carry else "not a gzip file")
    if carry and not trailing_ok:
        raise zlib.error("bytes after the gzip stream that start no gzip member (b'\\x1f')")
    return head


def check_gzip(path):
    """DataError naming `path` unless it is a complete, readable gzip file of text (read through: the Multi30k files
    are a few MB): not empty, and not a web page (a portal's or a proxy's page sent gzip-encoded had been taken for
    the corpus)."""
    try:
        head = _read_through(path)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None
    if not head.strip():
        raise DataError(f"{path}: holds no text")
    start = head.lstrip()[:64].lower()
    if start.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        raise DataError(f"{path}: holds a web page, not the corpus's text (a network that wants a login first, or a "
                        f"proxy's page?)")
