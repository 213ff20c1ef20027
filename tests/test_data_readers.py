"""Readers (plain/gz/SGM, parallel files) and pair cleaning."""

import gzip
import io
import os

import pytest

from minitf.data import clean_pairs, find_file, read_lines, read_parallel, read_sgm
from minitf.errors import DataError


def test_plain_and_gz_read_the_same(tmp_path):
    text = "Hello world\r\nzweite Zeile \u2028 bleibt\n\n  spaces kept  \nlast"
    (tmp_path / "a.txt").write_bytes(text.encode("utf-8"))
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(text.encode("utf-8"))
    expected = ["Hello world", "zweite Zeile \u2028 bleibt", "", "  spaces kept  ",
                "last"]
    assert read_lines(tmp_path / "a.txt") == expected
    assert read_lines(str(tmp_path / "a.txt.gz")) == expected


def test_a_byte_order_mark_at_the_start_is_not_text(tmp_path):
    # what Windows editors write: dropped at the start of a file by every reader, kept elsewhere (U+FEFF in a line
    # is a character of it)
    import io
    from minitf.data.readers import LineStream, read_stream_lines
    data = "\ufeffA dog runs.\nmid \ufeff line\n".encode("utf-8")
    (tmp_path / "bom.txt").write_bytes(data)
    (tmp_path / "bom.txt.gz").write_bytes(gzip.compress(data))
    want = ["A dog runs.", "mid \ufeff line"]
    for path in (tmp_path / "bom.txt", tmp_path / "bom.txt.gz"):
        assert read_lines(path) == want
        assert list(LineStream(str(path))) == want
    assert read_stream_lines(io.BytesIO(data), "standard input") == want
    assert read_lines(tmp_path / "bom.txt")[0] == "A dog runs."


def test_gzip_detected_by_magic_and_trailing_newline(tmp_path):
    with gzip.open(tmp_path / "noext", "wb") as f:
        f.write(b"x\ny\n")
    assert read_lines(tmp_path / "noext") == ["x", "y"]
    (tmp_path / "empty").write_bytes(b"")
    assert read_lines(tmp_path / "empty") == []


def test_sgm_segments_and_entities(tmp_path):
    sgm = ('<srcset setid="newstest2014" srclang="any">\n'
           '<doc sysid="ref" docid="1" genre="news" origlang="en">\n'
           '<p>\n'
           '<seg id="1">Tom &amp; Jerry say &quot;hi&quot; &lt;3</seg>\n'
           '<seg id="2">  it&apos;s   spaced\tout </seg>\n'
           '</p>\n</doc>\n</srcset>\n')
    (tmp_path / "t.sgm").write_text(sgm, encoding="utf-8")
    assert read_sgm(tmp_path / "t.sgm") == ['Tom & Jerry say "hi" <3',
                                            "it's spaced out"]
    assert read_sgm(tmp_path / "t.sgm", unescape=False)[0] == \
        "Tom &amp; Jerry say &quot;hi&quot; &lt;3"


def test_parallel_mismatch_names_both_files(tmp_path):
    (tmp_path / "x.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "x.de").write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_parallel(tmp_path / "x.en", tmp_path / "x.de")
    msg = str(e.value)
    assert "x.en" in msg and "x.de" in msg and "3" in msg and "2" in msg
    assert "\n" not in msg


def test_parallel_reads_sgm_pairs(tmp_path):
    (tmp_path / "s.en.sgm").write_text('<seg id="1">a</seg>\n<seg id="2">b</seg>\n')
    (tmp_path / "r.de.gz").write_bytes(gzip.compress(b"A\nB\n"))
    assert read_parallel(tmp_path / "s.en.sgm", tmp_path / "r.de.gz") == \
        (["a", "b"], ["A", "B"])


def test_undecodable_bytes_name_file_and_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok\nfine\nbro\xffken\n")
    with pytest.raises(DataError, match=r"bad\.txt:3: invalid UTF-8"):
        read_lines(tmp_path / "bad.txt")
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(b"\xc3\n")
    with pytest.raises(DataError, match=r"bad\.gz:1:"):
        read_lines(tmp_path / "bad.gz")


def _both_readers(path):
    """What read_lines and LineStream (the training corpus's streaming reader) make of `path`: its lines, or the
    DataError's message; the two must agree."""
    from minitf.data.readers import LineStream
    out = []
    for read in (read_lines, lambda p: list(LineStream(str(p)))):
        try:
            out.append(read(path))
        except DataError as e:
            out.append(str(e))
    return out


def test_nul_bytes_a_line_is_full_of_are_refused_and_a_stray_one_dropped(tmp_path):
    # a UTF-16LE file without a BOM decodes as UTF-8 without error, every other byte NUL: it had trained as characters
    # and <unk>s, one pair more than the file's lines (its final "\x00"); a file a crash filled with zeros is damaged.
    # A stray NUL in a line of text (web-crawled corpora carry a few) is dropped, not the whole corpus refused
    (tmp_path / "u16.en").write_bytes("a dog\nthe cat\n".encode("utf-16-le"))
    (tmp_path / "zeros.en").write_bytes(b"one\ntwo\n" + b"\x00" * 64)
    for name, line in (("u16.en", 1), ("zeros.en", 3)):
        for said in _both_readers(tmp_path / name):
            assert said == (f"{tmp_path / name}:{line}: a line of NUL bytes (0x00), which text never holds: the file "
                            f"is UTF-16 (convert it, e.g. iconv -f UTF-16LE -t UTF-8) or damaged")
    (tmp_path / "stray.en").write_bytes(b"one\nth\x00ree\n\x00four\n")
    assert _both_readers(tmp_path / "stray.en") == [["one", "three", "four"]] * 2


def test_lines_ended_by_a_carriage_return_alone_are_refused_not_joined(tmp_path):
    # old Mac text: split on "\n" it had been one sentence (a validation set of 40 became 1 pair); a CR inside a line
    # of a file with newlines stays a character of it, as before
    (tmp_path / "mac.en").write_bytes(b"a dog\rthe cat\rthe end\r")
    for said in _both_readers(tmp_path / "mac.en"):
        assert said.startswith(f"{tmp_path / 'mac.en'}: its lines end in a carriage return alone (old Mac text), so "
                               f"it reads as one line; convert them")
    (tmp_path / "fine.en").write_bytes(b"a dog\r\nmid\rline\none line\r")
    assert _both_readers(tmp_path / "fine.en") == [["a dog", "mid\rline", "one line"]] * 2
    (tmp_path / "one.en").write_bytes(b"a single line\r")          # one line, no newline: its ending is a CR
    assert _both_readers(tmp_path / "one.en") == [["a single line"]] * 2
    (tmp_path / "mac_nl.en").write_bytes(b"a dog\rthe cat\r\n")         # a newline a tool added at the end: the same
    for said in _both_readers(tmp_path / "mac_nl.en"):
        assert said.startswith(f"{tmp_path / 'mac_nl.en'}: its lines end in a carriage return alone")
    from minitf.data import readers
    long = b"x" * (readers.MAX_LINE_BYTES // 2) + b"\r"                # a big file in CRs: the 1 MiB cap says why
    (tmp_path / "big.en").write_bytes(long * 3 + b"\n")
    for said in _both_readers(tmp_path / "big.en"):
        assert said.startswith(f"{tmp_path / 'big.en'}:1: a line of over 1,048,576 bytes") and \
            said.endswith("its lines end in a carriage return alone (old Mac text): convert them, e.g. tr '\\r' '\\n'")


def test_a_plain_file_named_gz_is_read_as_text(tmp_path):
    # the name had decided: a plain file named .gz was refused as "truncated or corrupt"
    (tmp_path / "p.en.gz").write_bytes(b"a dog\nthe cat\n")
    assert _both_readers(tmp_path / "p.en.gz") == [["a dog", "the cat"]] * 2


def test_a_file_without_read_permission_is_said_as_such_not_as_damaged(tmp_path, monkeypatch):
    # the advice for a damaged file (delete a downloaded one, make your own again) had come with a permission error
    from minitf.data import readers

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", os.fspath(path))
    (tmp_path / "locked.en").write_text("a dog\n")
    monkeypatch.setattr(readers, "open", refused, raising=False)
    want = f"{tmp_path / 'locked.en'}: cannot read it (permission denied); give read permission to the user running minitf"
    assert _both_readers(tmp_path / "locked.en") == [want, want]


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DataError, match="nope.txt: file not found"):
        read_lines(tmp_path / "nope.txt")
    (tmp_path / "trunc.gz").write_bytes(gzip.compress(b"hello\n" * 100)[:20])
    with pytest.raises(DataError, match="trunc.gz: cannot read"):
        read_lines(tmp_path / "trunc.gz")


def test_find_file(tmp_path, capsys):
    assert find_file(tmp_path, "train.en") is None
    (tmp_path / "train.en.gz").write_bytes(gzip.compress(b"x\n"))
    assert find_file(tmp_path, "train.en").endswith("train.en.gz")
    assert capsys.readouterr().err == ""
    (tmp_path / "train.en").write_text("x\n")      # both there: the plain one is read, and said once
    assert find_file(tmp_path, "train.en").endswith("train.en")
    assert find_file(tmp_path, "train.en").endswith("train.en")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: {tmp_path / 'train.en'} and {tmp_path / 'train.en.gz'} are both there: reading "
                   f"{tmp_path / 'train.en'} (remove the one that is not the corpus)"]
    from minitf.data.readers import notes_off   # MPI ranks other than 0 (load_data's notes=False): unsaid
    (tmp_path / "val.en.gz").write_bytes(gzip.compress(b"x\n"))
    (tmp_path / "val.en").write_text("x\n")
    with notes_off():
        assert find_file(tmp_path, "val.en").endswith("val.en")
    assert capsys.readouterr().err == ""


def test_clean_pairs_drops_what_it_should():
    src = ["ok", "", "long", "ratio", "fine", "  ", "ok2"]
    tgt = ["ok", "x", "long", "r", "fine", "y", "ok2"]
    src_lens = [3, 0, 300, 10, 4, 2, 3]
    tgt_lens = [4, 1, 5, 2, 4, 1, 2]   # ratios: 4/3 ok, 10/2 bad, 3/2 = 1.5 ok
    kept, stats = clean_pairs(src, tgt, src_lens, tgt_lens, max_len=250,
                              max_ratio=1.5)
    assert kept == [0, 4, 6]
    assert stats == {"total": 7, "kept": 3, "empty": 2, "too_long": 1, "ratio": 1}
    kept, _ = clean_pairs(["a"], ["b"], [9], [3], max_ratio=3.0)
    assert kept == [0]


class _Terminal(io.BufferedIOBase):
    """Standard input on a terminal as a buffered reader meets it: read(n) gives n typed bytes while there are as many,
    else the rest, the end of input (one Ctrl-D) used up; a read after that would wait for another Ctrl-D."""

    def __init__(self, typed):
        self.typed, self.done = typed, False

    def read(self, n=-1):
        assert not self.done, "read again after the Ctrl-D: the command waits for a second one"
        if 0 <= n <= len(self.typed):
            out, self.typed = self.typed[:n], self.typed[n:]
            return out
        out, self.typed, self.done = self.typed, b"", True
        return out


@pytest.mark.parametrize("typed", [b"A man.\nA dog on the grass.\n", b"", b"A", b"ab", b"no newline at the end"])
def test_input_typed_at_a_terminal_ends_at_one_ctrl_d(typed):
    # translate --output, evaluate --src - and score --src - read all of standard input at once: the first read's
    # short return was the terminal's one end of input, and the reader had asked again, waiting for a second Ctrl-D
    from minitf.data.readers import _read_stream
    assert _read_stream(_Terminal(typed), "<stdin>") == typed


def test_a_raw_stream_is_read_to_its_end_not_to_its_first_short_read():
    # an unbuffered pipe returns what has come so far: only an empty read ends it (its first line alone had been kept)
    import threading
    import time
    from minitf.data.readers import read_stream_lines
    r, w = os.pipe()
    lines = [f"line {i}" for i in range(5)]

    def write():
        with open(w, "wb", buffering=0) as f:
            for line in lines:
                f.write((line + "\n").encode())
                time.sleep(0.05)
    writer = threading.Thread(target=write)
    writer.start()
    with open(r, "rb", buffering=0) as f:
        assert read_stream_lines(f, "pipe") == lines
    writer.join()
