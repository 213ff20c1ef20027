"""Reading text corpora: plain or gzip files, WMT SGM files, parallel pairs.

Every failure (missing file, bad gzip, invalid UTF-8, parallel files of different
lengths) raises `DataError` with a one-line message naming the file, the line where
relevant, and what to do.

A byte-order mark at the start of a file is dropped (Windows editors write one; it is not text of line 1).
Lines are split on ``"\\n"`` only (never on the other Unicode line breaks that
`str.splitlines` honours, such as U+2028 or U+0085, which would silently shift a
parallel corpus out of alignment); a trailing ``"\\r"`` is removed. A file whose lines end in
``"\\r"`` alone (old Mac text) reads as one line: it is refused rather than joined.
A line of NUL bytes is refused (`without_stray_nuls`): text holds none, and a UTF-16 file without a byte-order mark
(or one a crash filled with zeros) decodes without error into pieces of nothing; a stray NUL is dropped.
Gzip is told by a file's first two bytes, not its name.
"""

import contextlib
import gzip
import io
import os
import re
import sys
import zlib

from minitf.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"


MAX_LINE_BYTES = 1 << 20   # a training line longer than this is refused before more of it is read


def is_gzip(path):
    """True if `path` starts with the gzip magic bytes: a plain file named .gz is read as plain text (it had been
    refused as "truncated or corrupt"), a gzip file with a plain name is decompressed."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _must_be_a_file(path):
    """DataError unless `path` is a file: missing, or a folder."""
    if os.path.isdir(path):
        raise DataError(f"{path} is a folder, not a text file; name the file itself")
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found; check the path")


def _read_stream(f, name):
    """The (decompressed) bytes of a binary stream read once (a pipe, standard input): its first
    two bytes tell whether it is gzip."""
    head = f.read(2)
    if head == GZIP_MAGIC:
        with gzip.GzipFile(fileobj=_Prefixed(head, f), mode="rb") as g:
            return _read_capped(g, name)
    return _read_capped(_Prefixed(head, f), name)


def _read_bytes(path):
    """The (decompressed) bytes of `path`, a file or a pipe (/dev/stdin, a shell's <(zcat f.gz));
    DataError if missing or unreadable."""
    path = os.fspath(path)
    if os.path.isdir(path) or not os.path.exists(path):   # a pipe (not a regular file) is read below
        _must_be_a_file(path)
    try:
        if not os.path.isfile(path):   # a pipe can be read once
            with open(path, "rb") as f:
                return _read_stream(f, path)
        if is_gzip(path):
            with gzip.open(path, "rb") as f:
                return _read_capped(f, path)
        with open(path, "rb") as f:
            return _read_capped(f, path)
    except (OSError, EOFError, zlib.error) as e:
        raise unreadable(path, e) from None


def unreadable(path, e):
    """The DataError for a file that could not be read: no permission is said as such (the advice for a damaged file
    had invited deleting a good one), anything else as a damaged file."""
    if isinstance(e, PermissionError):
        return DataError(f"{path}: cannot read it (permission denied); give read permission to the user running minitf")
    return DataError(f"{path}: cannot read ({e.__class__.__name__}: {e}); {_DAMAGED}")


_DAMAGED = ("the file is probably truncated or corrupt: a downloaded one can be deleted and downloaded again (the next "
            "run does it); a file of your own, made again from its source (`gzip -t FILE` tests a .gz)")


class _Prefixed:
    """A read(n) stream: `head` (bytes already read from f), then the rest of f, read until f first comes back short.
    f is a buffered binary stream, whose read(n) returns fewer than n bytes only at its end; on a terminal that end is
    one Ctrl-D, which a second read would wait past (input typed for `translate --output`, `evaluate --src -` had
    needed Ctrl-D twice)."""

    def __init__(self, head, f, asked=2):
        self.buffered = isinstance(f, io.BufferedIOBase)   # a raw stream returns what has come so far: only b"" ends it
        self.head, self.f, self.ended = head, f, not head or self.buffered and len(head) < asked

    def _more(self, n):
        if self.ended:
            return b""
        out = self.f.read(n)
        self.ended = n < 0 or not out or self.buffered and len(out) < n
        return out

    def read(self, n=-1):
        if self.head:
            out = self.head if n < 0 else self.head[:n]
            self.head = self.head[len(out):]
            if n < 0 or len(out) < n:
                out += self._more(-1 if n < 0 else n - len(out))
            return out
        return self._more(n)

    def readable(self):
        return True


def line_too_long(path, number, sentences, carriage_returns=False):
    """The DataError for line `number` of `path` passing MAX_LINE_BYTES ("far longer than any
    sentence {sentences}"); carriage_returns: the line holds "\\r", the likely cause is said."""
    why = ("its lines end in a carriage return alone (old Mac text): convert them, e.g. tr '\\r' '\\n'"
           if carriage_returns else "the file is not one sentence per line, or it is damaged")
    return DataError(f"{path}:{number}: a line of over {MAX_LINE_BYTES:,} bytes, far longer than any sentence "
                     f"{sentences}; {why}")


NUL_SHARE = 0.25   # a line this much NUL bytes is not text: UTF-16 (every other byte of ASCII), or zeros


def without_stray_nuls(line, path, number):
    """The bytes of line `number` of `path` without their NUL bytes, which text never holds: a stray one (web-crawled
    corpora carry a few) is dropped; a line NUL_SHARE or more NUL bytes is a DataError: a UTF-16 file without a
    byte-order mark decodes as UTF-8 without error, every other byte NUL (it had trained as characters and <unk>s),
    and a file a crash filled with zeros is damaged."""
    n = line.count(b"\x00")
    if not n:
        return line
    if n >= NUL_SHARE * len(line.rstrip(b"\r\n")):
        raise DataError(f"{path}:{number}: a line of NUL bytes (0x00), which text never holds: the file is UTF-16 "
                        f"(convert it, e.g. iconv -f UTF-16LE -t UTF-8) or damaged")
    return line.replace(b"\x00", b"")


def only_carriage_returns(path):
    """The DataError for a file whose lines end in "\\r" alone: read on "\\n", it would be one line."""
    return DataError(f"{path}: its lines end in a carriage return alone (old Mac text), so it reads as one line; "
                     f"convert them, e.g. tr '\\r' '\\n' < FILE > NEW")


def _mac_text(only_line):
    """Whether the bytes of a file's only line (a "\\n" at its end at most) hold a carriage return before its end:
    lines ended by "\\r" alone."""
    return b"\r" in only_line.rstrip(b"\n").rstrip(b"\r")


def _read_capped(f, path):
    """All of f's bytes, read 1 MB at a time; a line longer than MAX_LINE_BYTES is refused as soon
    as it has been read that far (a decompression bomb that is one long line costs about a MB, not its size)."""
    parts, open_line, newlines = [], 0, 0     # open_line: bytes of the line not yet ended
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            break
        parts.append(chunk)
        segments = chunk.split(b"\n")        # k newlines: k ended lines' tails, then an open piece
        lengths = [open_line + len(segments[0])] + [len(x) for x in segments[1:]]
        for i, n in enumerate(lengths):
            if n > MAX_LINE_BYTES:
                raise line_too_long(path, newlines + i + 1, "minitf reads", b"\r" in segments[i])
        newlines += len(segments) - 1
        open_line = lengths[-1]
    return b"".join(parts)


BOM = "\ufeff"   # a byte-order mark, which some editors put at the start of a UTF-8 file: not part of line 1


def _decode(path, data):
    """Strict UTF-8 decode, a leading byte-order mark dropped; an error names the file and the 1-based line number."""
    if b"\x00" in data:
        data = b"\n".join(without_stray_nuls(line, path, i + 1) for i, line in enumerate(data.split(b"\n")))
    if b"\n" not in data.rstrip(b"\n") and _mac_text(data):
        raise only_carriage_returns(path)
    try:
        return data.decode("utf-8").removeprefix(BOM)
    except UnicodeDecodeError as e:
        raise invalid_utf8(path, data.count(b"\n", 0, e.start) + 1, data, e) from None


def invalid_utf8(path, number, data, e):
    """The DataError for the UnicodeDecodeError `e` of `data` (line `number` of `path`, or the whole file)."""
    return DataError(f"{path}:{number}: invalid UTF-8 (bytes 0x{data[e.start:e.end].hex()}); convert the file to "
                     f"UTF-8 (e.g. iconv) or fix that line")


def read_lines(path):
    """Read a UTF-8 text file (plain or gzip) as a list of lines.

    Gzip is detected by the gzip magic bytes. Trailing
    ``"\\n"``/``"\\r"`` are stripped from each line, everything else is kept.
    """
    path = os.fspath(path)
    return _split_lines(_decode(path, _read_bytes(path)))


def read_stream_lines(f, name):
    """read_lines of a binary stream read once, such as standard input (`sys.stdin.buffer`),
    plain or gzip; `name` stands for the file in messages."""
    try:
        data = _read_stream(f, name)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{name}: cannot read ({e.__class__.__name__}: {e}); the input is probably "
                        f"truncated or corrupt") from None
    return _split_lines(_decode(name, data))


def _split_lines(text):
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":          # the file ended with a newline
        lines.pop()
    return [line.rstrip("\r") for line in lines]


_SEG_RE = re.compile(r"<seg[^>]*>(.*)</seg>")
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"),
             ("&amp;", "&"))  # &amp; last, so "&amp;lt;" becomes "&lt;"


def unescape_xml(text):
    """Replace the five predefined XML entities by their characters."""
    if "&" not in text:
        return text
    for entity, char in _ENTITIES:
        text = text.replace(entity, char)
    return text


def read_sgm(path, unescape=True):
    """Read the segments of a WMT SGM file (``<seg id="1">text</seg>`` lines).

    Like sacreBLEU, only lines starting with ``<seg`` count, and surrounding
    whitespace is stripped and internal runs of whitespace are collapsed to one
    space. With `unescape` (the default) the XML entities &amp; &lt; &gt; &quot;
    &apos; are replaced by their characters. (sacreBLEU's own SGM reader leaves
    entities alone; the WMT news test sets since 2010 contain none, so both agree.)
    """
    path = os.fspath(path)
    segments = []
    for number, line in enumerate(read_lines(path), start=1):
        stripped = line.lstrip()
        if not stripped.startswith("<seg"):
            continue
        m = _SEG_RE.search(stripped)
        if m is None:
            raise DataError(f"{path}:{number}: <seg> without a closing </seg> on the "
                            f"same line; the SGM file is malformed, download it again")
        text = re.sub(r"\s+", " ", m.group(1).strip())
        segments.append(unescape_xml(text) if unescape else text)
    return segments


def read_text(path):
    """`read_sgm` for ``*.sgm`` / ``*.sgm.gz`` files, `read_lines` otherwise."""
    name = os.fspath(path)
    if name.endswith(".sgm") or name.endswith(".sgm.gz"):
        segments = read_sgm(name)
        if not segments and any(line.strip() for line in read_lines(name)):
            raise DataError(f"{name}: named .sgm, but it has no <seg> lines: not SGM (a plain text file is read line "
                            f"by line under another name)")
        return segments
    return read_lines(name)


def read_parallel(src_path, tgt_path):
    """Read two aligned files (plain, gzip or SGM) as (src_lines, tgt_lines).

    DataError if their line (segment) counts differ, naming both files and counts.
    """
    src, tgt = read_text(src_path), read_text(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"parallel files differ in length: {os.fspath(src_path)} has "
                        f"{len(src)} lines but {os.fspath(tgt_path)} has {len(tgt)}; "
                        f"they must be line-aligned translations, re-download or fix "
                        f"them")
    return src, tgt


_BOTH_SAID = set()   # the plain files find_file has said it reads beside a .gz (once each)
_QUIET = [0]         # > 0 inside notes_off: find_file's note is not printed (MPI ranks other than 0)


@contextlib.contextmanager
def notes_off():
    """find_file's notes unsaid for the block: every rank of an MPI job reads the data, rank 0 says what it saw."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def find_file(data_dir, stem):
    """Path of `stem` or `stem + '.gz'` inside `data_dir` (plain first), else None. Where both are there, a note on
    stderr (once a process) says which is read: a plain copy left beside a newer .gz would be read without a word."""
    plain, gz = (os.path.join(os.fspath(data_dir), name) for name in (stem, stem + ".gz"))
    if os.path.isfile(plain):
        if os.path.isfile(gz) and plain not in _BOTH_SAID and not _QUIET[0]:
            _BOTH_SAID.add(plain)
            print(f"note: {plain} and {gz} are both there: reading {plain} (remove the one that is not the corpus)",
                  file=sys.stderr, flush=True)
        return plain
    return gz if os.path.isfile(gz) else None


class LineStream:
    """Stream the lines of a UTF-8 text file (plain or gzip) without holding the file in memory.

    Iterating yields lines exactly as `read_lines` returns them (split on ``"\\n"`` only,
    trailing ``"\\r"`` removed). While reading it hashes the bytes ON DISK (the compressed
    bytes of a .gz file) with SHA-256 and counts them, so a corpus fingerprint costs no
    second pass: after a complete iteration, `sha256` and `bytes_read` are final. Errors
    (bad gzip, invalid UTF-8) raise DataError naming the file and, for UTF-8, the line.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        _must_be_a_file(self.path)
        self.size = os.path.getsize(self.path)
        self.bytes_read = 0
        self._hash = None

    @property
    def sha256(self):
        return self._hash.hexdigest() if self._hash is not None else None

    def _read_raw(self, raw, n=-1):
        data = raw.read(n)
        self._hash.update(data)
        self.bytes_read += len(data)
        return data

    def __iter__(self):
        import hashlib
        self._hash, self.bytes_read = hashlib.sha256(), 0
        stream = self

        class _Hashing:  # what gzip reads from: every raw byte goes through the hash
            def __init__(self, raw):
                self.raw = raw

            def read(self, n=-1):
                return stream._read_raw(self.raw, n)

            def readable(self):
                return True

        number = 0
        try:
            with open(self.path, "rb") as raw:
                if is_gzip(self.path):
                    f = gzip.GzipFile(fileobj=_Hashing(raw), mode="rb")
                else:
                    f = io.BufferedReader(_RawHashing(_Hashing(raw)), 1 << 20)
                with f:
                    first = None   # line 1, held until line 2 is read: a file of one line may be old Mac text
                    while True:
                        line = f.readline(MAX_LINE_BYTES + 2)   # at most this much, even of a 1 GiB line
                        if not line:
                            break
                        number += 1
                        if len(line) - line.endswith(b"\n") > MAX_LINE_BYTES:   # the limit is read_lines', newline apart
                            raise line_too_long(self.path, number, "minitf trains on (--max-len pieces)",
                                                b"\r" in line)
                        line = without_stray_nuls(line, self.path, number)
                        if number == 1:
                            first = line
                            continue
                        if number == 2:
                            yield _line_text(self.path, first, 1)
                        yield _line_text(self.path, line, number)
                    if number == 1:
                        if _mac_text(first):
                            raise only_carriage_returns(self.path)
                        yield _line_text(self.path, first, 1)
                while self._read_raw(raw, 1 << 20):  # gzip may stop before trailing bytes
                    pass
        except (OSError, EOFError, zlib.error) as e:
            raise unreadable(self.path, e) from None


def _line_text(path, line, number):
    """Line `number`'s bytes as text, its newline (and a "\\r" before it) and, on line 1, a byte-order mark dropped;
    invalid UTF-8 is a DataError naming the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_utf8(path, number, line, e) from None
    if number == 1:
        text = text.removeprefix(BOM)
    return text.rstrip("\n").rstrip("\r")


class _RawHashing(io.RawIOBase):
    """A raw stream over a read(n) callable, so BufferedReader can split lines fast."""

    def __init__(self, source):
        self._source = source

    def readable(self):
        return True

    def readinto(self, buf):
        data = self._source.read(len(buf))
        buf[:len(data)] = data
        return len(data)
