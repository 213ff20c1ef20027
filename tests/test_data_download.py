"""Downloader, extraction and prepare_dataset against a local HTTP server.

Nothing here leaves 127.0.0.1: a ThreadingHTTPServer on port 0 serves in-memory
files, honouring Range requests (or not, and If-Range against a file's ETag or
Last-Modified where it has one), and can cut the first response short.
"""

import gzip
import hashlib
import io
import os
import socket
import tarfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minitf.data import DATASETS, download, extract, prepare_dataset, read_parallel
from minitf.errors import DataError


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class _Handler(BaseHTTPRequestHandler):
    timeout = 5  # a stuck client cannot hold a server thread forever

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        srv = self.server
        srv.requests.append((self.path, self.headers.get("Range")))
        srv.if_ranges.append(self.headers.get("If-Range"))
        data = srv.files.get(self.path)
        if self.path in srv.answers:   # a status (and headers) of this test's choosing instead of the file
            code, headers = srv.answers[self.path]
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if data is None:
            self.send_error(404)
            return
        start, status = 0, 200
        rng = self.headers.get("Range")
        same = self.headers.get("If-Range") in (None, srv.etags.get(self.path), srv.modified.get(self.path))
        if rng and srv.honour_range and same:   # another version than If-Range names: all of it (RFC 9110 13.1.5)
            start = int(rng.split("=")[1].split("-")[0])
            status = 206
        self.send_response(status)
        if self.path in srv.etags:
            self.send_header("ETag", srv.etags[self.path])
        if self.path in srv.modified:
            self.send_header("Last-Modified", srv.modified[self.path])
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Content-Type", srv.types.get(self.path, "application/octet-stream"))
        self.end_headers()
        body = data[start:]
        if srv.cut_after and self.path not in srv.cut_done:  # first time: cut short
            srv.cut_done.add(self.path)
            body = body[:srv.cut_after]
            self.close_connection = True
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.files, srv.requests, srv.cut_done, srv.answers, srv.types = {}, [], set(), {}, {}
    srv.if_ranges, srv.etags, srv.modified = [], {}, {}
    srv.honour_range, srv.cut_after = True, 0
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _tgz(files):
    """In-memory .tgz of {member name: text or bytes}."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _sgm(lines):
    segs = "".join(f'<seg id="{i}">{s}</seg>\n' for i, s in enumerate(lines, 1))
    return f'<srcset setid="newstest2014">\n<doc docid="d1">\n{segs}</doc>\n</srcset>\n'


def _unreachable_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}/"


PAYLOAD = os.urandom(50_000)
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _dl(server, tmp_path, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("backoff", 0)
    kw.setdefault("timeout", 5)
    return download(server.url + "/blob.bin", tmp_path / "blob.bin", **kw)


def test_plain_download_with_checksum(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    path = _dl(server, tmp_path, sha256=PAYLOAD_SHA)
    assert _read(path) == PAYLOAD
    n = len(server.requests)
    _dl(server, tmp_path, sha256=PAYLOAD_SHA)        # present and valid: no request
    assert len(server.requests) == n


def test_checksum_mismatch_leaves_no_file(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    with pytest.raises(DataError) as e:
        _dl(server, tmp_path, sha256="0" * 64)
    msg = str(e.value)
    assert "blob.bin" in msg and "0" * 64 in msg and PAYLOAD_SHA in msg
    assert os.listdir(tmp_path) == []


def test_interrupted_download_resumes_with_range(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    server.cut_after = 12_345
    path = _dl(server, tmp_path, sha256=PAYLOAD_SHA)
    assert hashlib.sha256(_read(path)).hexdigest() == PAYLOAD_SHA
    assert server.requests == [("/blob.bin", None), ("/blob.bin", "bytes=12345-")]
    assert not os.path.exists(str(path) + ".part")


def test_existing_part_file_is_resumed(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    (tmp_path / "blob.bin.part").write_bytes(PAYLOAD[:777])
    _dl(server, tmp_path, sha256=PAYLOAD_SHA)
    assert server.requests == [("/blob.bin", "bytes=777-")]


OTHER = os.urandom(50_000)
OTHER_SHA = hashlib.sha256(OTHER).hexdigest()


@pytest.mark.parametrize("etag, modified, kept", [
    ('"v1"', None, '"v1"'),                                               # a strong ETag
    ('W/"v1"', "Mon, 30 Nov 2026 10:00:00 GMT", "Mon, 30 Nov 2026 10:00:00 GMT"),   # a weak one: Last-Modified
])
def test_a_file_changed_on_the_server_between_two_runs_is_fetched_again_whole(server, tmp_path, etag, modified, kept):
    """A download cut short keeps its part and the first response's validator beside it; the next run's resume asks
    for the rest If-Range that version: where the file changed on the server meanwhile, it gets all of the new file
    (not the old file's first bytes spliced to the new one's rest, which no checksum would catch where there is none);
    where it did not, the rest."""
    server.files["/blob.bin"], server.cut_after = PAYLOAD, 12_345
    server.etags["/blob.bin"] = etag
    if modified:
        server.modified["/blob.bin"] = modified
    with pytest.raises(DataError, match="gave up after 1 try"):
        _dl(server, tmp_path, retries=0)
    assert (tmp_path / "blob.bin.part.validator").read_text() == kept
    assert (tmp_path / "blob.bin.part").read_bytes() == PAYLOAD[:12_345]
    server.files["/blob.bin"], server.etags["/blob.bin"] = OTHER, '"v2"'     # a new version, changed as a whole
    server.modified.pop("/blob.bin", None)
    path = _dl(server, tmp_path)
    assert _read(path) == OTHER and server.if_ranges[-1] == kept and server.requests[-1][1] == "bytes=12345-"
    assert sorted(os.listdir(tmp_path)) == ["blob.bin"]
    # the same version: the rest of it
    os.unlink(path)
    server.cut_done.clear()
    with pytest.raises(DataError, match="gave up after 1 try"):
        _dl(server, tmp_path, retries=0)
    path = _dl(server, tmp_path, sha256=OTHER_SHA)
    assert _read(path) == OTHER and server.if_ranges[-1] == '"v2"' and server.requests[-1][1] == "bytes=12345-"
    assert sorted(os.listdir(tmp_path)) == ["blob.bin"]


def test_a_response_without_a_validator_forgets_the_old_one(server, tmp_path):
    """A part begun again from a response that names no version keeps no validator from before: its resume asks for
    the rest without If-Range, as a server without validators needs."""
    server.files["/blob.bin"] = PAYLOAD
    (tmp_path / "blob.bin.part.validator").write_text('"stale"')
    server.honour_range = False
    (tmp_path / "blob.bin.part").write_bytes(b"x" * 100)
    server.cut_after = 10_000
    with pytest.raises(DataError, match="gave up after 1 try"):
        _dl(server, tmp_path, retries=0)
    assert not (tmp_path / "blob.bin.part.validator").exists() and server.if_ranges[-1] == '"stale"'
    server.honour_range = True
    path = _dl(server, tmp_path, sha256=PAYLOAD_SHA)
    assert server.if_ranges[-1] is None and server.requests[-1][1] == "bytes=10000-" and _read(path) == PAYLOAD


def test_server_ignoring_range_restarts(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    server.cut_after, server.honour_range = 20_000, False
    path = _dl(server, tmp_path, sha256=PAYLOAD_SHA)
    assert _read(path) == PAYLOAD
    assert len(server.requests) == 2 and server.requests[1][1] == "bytes=20000-"


def test_http_404_and_network_failure(server, tmp_path):
    with pytest.raises(DataError, match="HTTP 404") as e:
        _dl(server, tmp_path)
    assert e.value.http_status == 404
    url = _unreachable_url() + "x.tgz"
    with pytest.raises(DataError) as e:
        download(url, tmp_path / "x.tgz", progress=False, retries=1, backoff=0,
                 timeout=5)
    assert url in str(e.value) and "--data-dir" in str(e.value)
    assert "internet" in str(e.value)


def test_extract_tar_and_gz(tmp_path):
    (tmp_path / "a.tgz").write_bytes(_tgz({"d/x.txt": "x\n", "y.txt": "y\n"}))
    written = extract(tmp_path / "a.tgz", tmp_path / "out")
    assert sorted(os.path.relpath(p, tmp_path / "out") for p in written) == \
        [os.path.join("d", "x.txt"), "y.txt"]
    assert (tmp_path / "out" / "d" / "x.txt").read_text() == "x\n"
    (tmp_path / "z.en.gz").write_bytes(gzip.compress(b"zzz\n"))
    extract(tmp_path / "z.en.gz", tmp_path / "out")
    assert (tmp_path / "out" / "z.en").read_bytes() == b"zzz\n"


@pytest.mark.parametrize("bad", ["../evil.txt", "/abs/evil.txt", "ok/../../evil.txt"])
def test_extract_refuses_unsafe_members(tmp_path, bad):
    (tmp_path / "bad.tgz").write_bytes(_tgz({"fine.txt": "f\n", bad: "evil\n"}))
    with pytest.raises(DataError, match="unsafe member"):
        extract(tmp_path / "bad.tgz", tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()
    assert not (tmp_path / "out" / "fine.txt").exists()  # checked before writing


def _serve_wmt(server, monkeypatch):
    """Tiny WMT14 archives in the real layout; returns the expected lines."""
    en = [f"sentence {i} & more" for i in range(6)]
    de = [f"Satz {i} & mehr" for i in range(6)]
    t_en, t_de = ['He said "yes" & left', "a < b"], ['Er sagte "ja" & ging', "a < b"]
    esc = lambda s: s.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")
    archives = {
        "/wmt13/training-parallel-europarl-v7.tgz": {
            "training/europarl-v7.de-en.en": "\n".join(en[:2]) + "\n",
            "training/europarl-v7.de-en.de": "\n".join(de[:2]) + "\n"},
        "/wmt13/training-parallel-commoncrawl.tgz": {
            "commoncrawl.de-en.en": "\n".join(en[2:4]) + "\n",
            "commoncrawl.de-en.de": "\n".join(de[2:4]) + "\n"},
        "/wmt14/training-parallel-nc-v9.tgz": {
            "training/news-commentary-v9.de-en.en": "\n".join(en[4:]) + "\n",
            "training/news-commentary-v9.de-en.de": "\n".join(de[4:]) + "\n"},
        "/wmt14/dev.tgz": {"dev/newstest2013.en": "dev en\n",
                           "dev/newstest2013.de": "dev de\n"},
        "/wmt14/test-full.tgz": {
            f"test-full/newstest2014-deen-{kind}.{lang}.sgm":
                _sgm([esc(s) for s in (t_en if lang == "en" else t_de)])
            for kind in ("src", "ref") for lang in ("en", "de")},
        "/wmt14/test-filtered.tgz": {
            f"test/newstest2014-deen-{kind}.{lang}.sgm":
                _sgm([esc(s) for s in (t_en if lang == "en" else t_de)[:1]])
            for kind in ("src", "ref") for lang in ("en", "de")},
    }
    for path, files in archives.items():
        server.files[path] = _tgz(files)
    # the registry's md5 sums are those of the real files: use the fixtures' sums
    table = DATASETS["wmt14"]["archives"]
    for key, (rel, md5) in list(table.items()):
        if md5:
            monkeypatch.setitem(table, key, (
                rel, hashlib.md5(server.files["/" + rel]).hexdigest()))
    return en, de, t_en, t_de


def test_prepare_wmt14_downloads_extracts_and_reads(server, tmp_path, monkeypatch):
    en, de, t_en, t_de = _serve_wmt(server, monkeypatch)
    monkeypatch.setenv("MINITF_WMT_BASE_URL", server.url + "/")
    data = prepare_dataset("wmt14", tmp_path / "wmt", src="en", tgt="de",
                           progress=False)
    assert _train_text(data) == (en, de)
    assert data["valid"] == (["dev en"], ["dev de"])
    assert data["tests"]["newstest2014"] == (t_en, t_de)
    assert data["tests"]["newstest2014-filtered"] == (t_en[:1], t_de[:1])
    assert not [f for f in os.listdir(tmp_path / "wmt") if f.endswith((".tgz", ".part"))]

    # reversed direction, from the extracted files: no more requests
    n = len(server.requests)
    rev = prepare_dataset("wmt14", tmp_path / "wmt", src="de", tgt="en",
                          progress=False)
    assert len(server.requests) == n
    assert _train_text(rev) == (de, en) and rev["tests"]["newstest2014"] == (t_de, t_en)


def _train_text(data):
    """The training corpora's lines, concatenated (prepare_dataset gives their paths only)."""
    src, tgt = [], []
    for p in data["paths"]["train"]:
        s, t = read_parallel(*p)
        src, tgt = src + s, tgt + t
    return src, tgt


def test_prepare_wmt14_en_fr_downloads_its_five_corpora(server, tmp_path, monkeypatch):
    """En-Fr: Europarl, Common Crawl, UN, News Commentary and the gzipped 10^9 corpus inside a
    .tar, newstest2013 to validate and newstest2014 (fren) to test, in the real layout."""
    en = [f"sentence {i}" for i in range(10)]
    fr = [f"phrase {i}" for i in range(10)]
    two = lambda lines, a: "\n".join(lines[a:a + 2]) + "\n"
    esc = lambda s: s.replace("&", "&amp;")
    t_en, t_fr = ["He left & came back", "b"], ["Il est parti & revenu", "b"]
    archives = {
        "/wmt13/training-parallel-europarl-v7.tgz": {f"training/europarl-v7.fr-en.{l}": two(x, 0) for l, x in (("en", en), ("fr", fr))},
        "/wmt13/training-parallel-commoncrawl.tgz": {f"commoncrawl.fr-en.{l}": two(x, 2) for l, x in (("en", en), ("fr", fr))},
        "/wmt13/training-parallel-un.tgz": {f"un/undoc.2000.fr-en.{l}": two(x, 4) for l, x in (("en", en), ("fr", fr))},
        "/wmt14/training-parallel-nc-v9.tgz": {f"training/news-commentary-v9.fr-en.{l}": two(x, 6) for l, x in (("en", en), ("fr", fr))},
        "/wmt10/training-giga-fren.tar": {f"giga-fren.release2.fixed.{l}.gz": gzip.compress(two(x, 8).encode())
                                          for l, x in (("en", en), ("fr", fr))},
        "/wmt14/dev.tgz": {"dev/newstest2013.en": "dev en\n", "dev/newstest2013.fr": "dev fr\n"},
        "/wmt14/test-full.tgz": {f"test-full/newstest2014-fren-{kind}.{l}.sgm": _sgm([esc(x) for x in lines])
                                 for kind in ("src", "ref") for l, lines in (("en", t_en), ("fr", t_fr))},
        "/wmt14/test-filtered.tgz": {f"test/newstest2014-fren-{kind}.{l}.sgm": _sgm([esc(x) for x in lines[:1]])
                                     for kind in ("src", "ref") for l, lines in (("en", t_en), ("fr", t_fr))},
    }
    for path, files in archives.items():
        server.files[path] = _tgz(files)
    table = DATASETS["wmt14"]["archives"]
    for key, (rel, md5) in list(table.items()):
        if md5:
            monkeypatch.setitem(table, key, (rel, hashlib.md5(server.files["/" + rel]).hexdigest()))
    data = prepare_dataset("wmt14", tmp_path / "wmt", src="en", tgt="fr", progress=False, base_url=server.url)
    assert _train_text(data) == (en, fr)
    assert [os.path.basename(p[0]) for p in data["paths"]["train"]][-1] == "giga-fren.release2.fixed.en.gz"
    assert data["valid"] == (["dev en"], ["dev fr"])
    assert data["tests"]["newstest2014"] == (t_en, t_fr)
    assert data["tests"]["newstest2014-filtered"] == (t_en[:1], t_fr[:1])
    from minitf.data.datasets import dataset_default
    assert dataset_default("wmt14", "vocab_size", "fr", "en") == 32000
    assert dataset_default("wmt14", "vocab_size", "en", "de") == 37000
    assert dataset_default("wmt14", "max_ratio", "en", "fr") == 1.5


def test_prepare_wmt14_bad_archive_checksum(server, tmp_path, monkeypatch):
    _serve_wmt(server, monkeypatch)
    server.files["/wmt14/test-full.tgz"] += b"tampered"
    with pytest.raises(DataError, match="checksum mismatch.*test-full.tgz"):
        prepare_dataset("wmt14", tmp_path / "wmt", base_url=server.url,
                        progress=False)
    assert not (tmp_path / "wmt" / "test-full.tgz").exists()


def _multi30k_folder(folder, langs=("en", "de"), stems=("train", "val",
                                                         "test_2016_flickr")):
    folder.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        for lang in langs:
            lines = [f"{stem} {lang} {i}" for i in range(3)]
            (folder / f"{stem}.{lang}.gz").write_bytes(
                gzip.compress(("\n".join(lines) + "\n").encode()))


def test_prepare_multi30k_local_folder_needs_no_network(tmp_path, monkeypatch):
    _multi30k_folder(tmp_path / "m30k", stems=("train", "val", "test_2016_flickr",
                                               "test_2017_flickr", "test_2018_flickr"))
    monkeypatch.setenv("MINITF_MULTI30K_BASE_URL", _unreachable_url())

    def no_network(*a, **k):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    data = prepare_dataset("multi30k", tmp_path / "m30k", src="de", tgt="en",
                           progress=False)
    assert _train_text(data) == (["train de 0", "train de 1", "train de 2"],
                                 ["train en 0", "train en 1", "train en 2"])
    assert data["valid"][0][0] == "val de 0"
    assert sorted(data["tests"]) == ["test_2016_flickr", "test_2017_flickr",
                                     "test_2018_flickr"]


def test_prepare_multi30k_download_tolerates_missing_test(server, tmp_path, capsys):
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir, stems=("train", "val", "test_2016_flickr",
                                     "test_2017_flickr"))
    for p in src_dir.iterdir():
        server.files["/raw/" + p.name] = p.read_bytes()
    data = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de",
                           progress=False, base_url=server.url + "/raw/")
    notes = [line for line in capsys.readouterr().err.splitlines() if "test_2018_flickr" in line]
    assert len(notes) == 1 and notes[0].startswith("note: test set multi30k test_2018_flickr is not available")
    assert sorted(data["tests"]) == ["test_2016_flickr", "test_2017_flickr"]
    assert data["tests"]["test_2017_flickr"][1][2] == "test_2017_flickr de 2"
    assert (tmp_path / "m30k" / "train.en.gz").is_file()


def test_a_missing_local_test_set_is_one_note_and_none_with_notes_off(tmp_path, capsys):
    """train.py passes notes=False on MPI ranks other than 0: one note per run, not one per rank."""
    _multi30k_folder(tmp_path / "m30k", stems=("train", "val", "test_2016_flickr"))
    data = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", download=False, progress=False)
    err = capsys.readouterr().err.splitlines()
    assert sorted(data["tests"]) == ["test_2016_flickr"]
    assert len(err) == 2 and all(line.startswith(f"note: test set multi30k {t} skipped: ")
                                 for line, t in zip(err, ("test_2017_flickr", "test_2018_flickr")))
    data = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", download=False, progress=False, notes=False)
    assert sorted(data["tests"]) == ["test_2016_flickr"] and capsys.readouterr().err == ""


def test_prepare_errors(tmp_path):
    with pytest.raises(DataError, match="multi30k.*wmt14"):
        prepare_dataset("wmt99", tmp_path)
    with pytest.raises(DataError, match="en-de, de-en, en-fr, fr-en"):
        prepare_dataset("wmt14", tmp_path, src="en", tgt="cs")
    with pytest.raises(DataError) as e:
        prepare_dataset("multi30k", tmp_path / "empty", download=False)
    assert "train.en[.gz]" in str(e.value) and str(tmp_path / "empty") in str(e.value)


def test_extract_selected_members_only(tmp_path):
    (tmp_path / "multi.tgz").write_bytes(_tgz({"./training/c.de-en.de": "d\n",
                                               "training/c.fr-en.fr": "f\n"}))
    written = extract(tmp_path / "multi.tgz", tmp_path, members=["training/c.de-en.de"])
    assert [os.path.basename(p) for p in written] == ["c.de-en.de"]
    assert not (tmp_path / "training" / "c.fr-en.fr").exists()


@pytest.mark.parametrize("body", [b"\x1f\x8b\x08\x00garbage that is not deflate", b"random bytes, not gzip at all"])
def test_a_corrupt_download_is_moved_aside_with_a_line_saying_so(server, tmp_path, body):
    """A Multi30k file that downloads but is no readable gzip (truncated, random bytes): one
    DataError naming it and saying it was moved aside to .bad; nothing is left under the name the
    next run would read, and that run downloads it anew."""
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir)
    for p in src_dir.iterdir():
        server.files["/raw/" + p.name] = p.read_bytes()
    good = server.files["/raw/train.en.gz"]
    server.files["/raw/train.en.gz"] = body
    data_dir = tmp_path / "m30k"
    with pytest.raises(DataError) as e:
        prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=server.url + "/raw/")
    msg = str(e.value)
    assert "train.en.gz" in msg and "moved it aside" in msg and ".bad" in msg and "run again" in msg
    assert not (data_dir / "train.en.gz").exists() and (data_dir / "train.en.gz.bad").read_bytes() == body
    server.files["/raw/train.en.gz"] = good
    data = prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=server.url + "/raw/")
    assert data["paths"]["train"] and (data_dir / "train.en.gz").read_bytes() == good


def test_a_corrupt_archive_is_moved_aside(server, tmp_path, monkeypatch):
    """A WMT archive that passes no checksum (none given) but does not extract: moved aside too."""
    from minitf.data import datasets
    spec = {"archives": {"a": ("a.tgz", None)}}
    corpus = datasets._in("a", "train.{lang}")
    server.files["/a.tgz"] = b"not a tar archive at all"
    with pytest.raises(DataError) as e:
        datasets._fetch(spec, server.url + "/", str(tmp_path), corpus, "en", "de", progress=False)
    assert "moved it aside" in str(e.value) and (tmp_path / "a.tgz.bad").exists() and not (tmp_path / "a.tgz").exists()


def test_a_progress_bar_in_a_log_file_ends_its_line(server, tmp_path):
    """stderr in a file: the finished bar is left as a whole line, so the next message starts a
    line of its own (not after the bar's carriage return)."""
    import subprocess
    import sys
    server.files["/f.bin"] = b"x" * 300_000
    log = tmp_path / "stderr.txt"
    code = ("import sys; from minitf.data.download import download; "
            f"download({server.url + '/f.bin'!r}, {str(tmp_path / 'f.bin')!r}, progress=True); "
            "print('error: the next message', file=sys.stderr)")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", code], stderr=f, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0
    text = log.read_text()
    assert "error: the next message" in text.split("\n")   # not glued after a "\r"


def test_a_download_that_fails_into_a_named_data_dir_says_which_folder_and_whether_it_existed(server, tmp_path,
                                                                                               monkeypatch):
    """--data-dir names the folder the files are looked up in, and downloaded into when missing. A mistyped path
    reads as a new folder to download into: when that download fails, the error names the flag, the folder and that
    it did not exist, and the folder made for it is removed again; an existing folder without the files is named as
    such, and stays."""
    from minitf.data.pipeline import DataSettings, load_data
    monkeypatch.setenv("MINITF_MULTI30K_BASE_URL", server.url + "/raw/")     # the server holds none of the files
    typo = tmp_path / "multi30kk"
    with pytest.raises(DataError) as e:
        load_data(DataSettings(dataset="multi30k", data_dir=str(typo), quiet=True))
    msg = str(e.value)
    assert msg.startswith(f"--data-dir {typo} does not exist, so minitf tried to download multi30k's files into it: "
                          f"cannot download {server.url}/raw/train.en.gz: HTTP 404"), msg
    assert not typo.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        load_data(DataSettings(dataset="multi30k", data_dir=str(empty), quiet=True))
    assert str(e.value).startswith(f"--data-dir {empty} does not hold every file of the train and valid sets, so "
                                   f"minitf tried to download multi30k's files into it: cannot download"), str(e.value)
    assert empty.is_dir()
    with pytest.raises(DataError) as e:          # --offline: the missing files named, nothing downloaded
        load_data(DataSettings(dataset="multi30k", data_dir=str(empty), offline=True, quiet=True))
    assert "train.en[.gz]" in str(e.value) and "--data-dir" not in str(e.value)


def test_a_data_dir_that_is_a_file_or_cannot_be_made_is_one_clear_error(tmp_path):
    """--data-dir naming a file, or a folder that cannot be made (here: below a file), is a DataError naming it, not
    an OSError's traceback."""
    from minitf.data.pipeline import DataSettings, load_data
    a_file = tmp_path / "train.en"
    a_file.write_text("a cat\n")
    with pytest.raises(DataError, match=f"^--data-dir {a_file} is a file: name the folder that holds"):
        load_data(DataSettings(dataset="multi30k", data_dir=str(a_file), quiet=True))
    below = a_file / "m30k"
    with pytest.raises(DataError, match=f"^cannot make the data folder {below} \\(Not a directory\\): name another"):
        prepare_dataset("multi30k", below, progress=False)


def test_a_network_error_while_reading_is_retried_and_a_disk_error_is_not(server, tmp_path, monkeypatch):
    # an OSError from the response (an SSL record, a network gone) is the network's: retried and resumed; one from
    # writing the file is the disk's: one line at once, no retry
    import errno
    import http.client
    server.files["/blob.bin"] = PAYLOAD
    real_read, failed = http.client.HTTPResponse.read, []

    def flaky_read(self, *a):
        if not failed:
            failed.append(1)
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return real_read(self, *a)
    monkeypatch.setattr(http.client.HTTPResponse, "read", flaky_read)
    assert _dl(server, tmp_path, sha256=PAYLOAD_SHA) == str(tmp_path / "blob.bin") and failed
    assert _read(tmp_path / "blob.bin") == PAYLOAD and len(server.requests) == 2
    monkeypatch.setattr(http.client.HTTPResponse, "read", real_read)

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    import sys
    dl = sys.modules["minitf.data.download"]        # the module (minitf.data's `download` is its function)
    monkeypatch.setattr(dl, "open", lambda *a, **k: FullDisk(), raising=False)
    server.requests.clear()
    from minitf.errors import MinitfError
    with pytest.raises(MinitfError, match=r"other.bin.part: no space left on the device of .*, the disk is full"):
        download(server.url + "/blob.bin", tmp_path / "other.bin", progress=False, backoff=0, timeout=5)
    assert len(server.requests) == 1
    # extracting onto a full disk: the same line, and no .part file left
    with gzip.open(tmp_path / "c.txt.gz", "wb") as f:
        f.write(b"a corpus line\n")
    monkeypatch.setattr(dl, "open", lambda path, mode="r", *a, **k: FullDisk() if "w" in mode else open(path, mode),
                        raising=False)
    with pytest.raises(MinitfError, match=r"c.txt.part: no space left on the device"):
        extract(tmp_path / "c.txt.gz", tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []


def test_a_first_download_cut_short_fetches_its_test_sets_on_the_next_run(server, tmp_path, capsys):
    # train and valid came down, the test sets did not (the server failed, Ctrl-C): the folder is minitf's download,
    # not a user's own copy, so the next run fetches the test sets instead of skipping them
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir, stems=("train", "val", "test_2016_flickr"))
    for p in src_dir.iterdir():
        if not p.name.startswith("test"):
            server.files["/raw/" + p.name] = p.read_bytes()
    first = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=server.url + "/raw/")
    assert first["tests"] == {}
    for p in src_dir.glob("test*"):
        server.files["/raw/" + p.name] = p.read_bytes()
    again = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=server.url + "/raw/")
    assert sorted(again["tests"]) == ["test_2016_flickr"]
    assert again["tests"]["test_2016_flickr"][0][1] == "test_2016_flickr en 1"


def test_two_processes_downloading_into_one_folder_take_turns(server, tmp_path, capsys):
    # the second waits for the first's lock (they would share .part files), then finds the files there
    from minitf.fileio import folder_lock
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir, stems=("train", "val", "test_2016_flickr"))
    for p in src_dir.iterdir():
        server.files["/raw/" + p.name] = p.read_bytes()
    folder, out = tmp_path / "m30k", {}
    folder.mkdir()
    with folder_lock(folder, lambda holder, path: None):      # another process's download, in progress
        t = threading.Thread(target=lambda: out.update(data=prepare_dataset(
            "multi30k", folder, "en", "de", progress=False, base_url=server.url + "/raw/")))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive() and server.requests == []         # waiting, nothing fetched
    t.join(timeout=60)
    assert not t.is_alive() and sorted(out["data"]["tests"]) == ["test_2016_flickr"]
    assert f"note: waiting for process {os.getpid()}" in capsys.readouterr().err


def test_an_optional_test_set_that_cannot_be_downloaded_is_skipped_and_a_failed_download_marks_nothing(server, tmp_path,
                                                                                                      capsys, monkeypatch):
    # a folder minitf downloaded into, used again with the server out of reach: a test set missing there had ended the
    # run (connection refused) where it is a note; a download that failed into a folder of the user's own had left the
    # mark of minitf's downloads, so the folder was taken for minitf's from then on
    import functools
    import minitf.data.datasets as datasets
    from minitf.data.datasets import DOWNLOADED
    # the retries' waits in milliseconds, not the 1 + 2 + 4 s of each of three downloads (still said, as "in 0 s")
    monkeypatch.setattr(datasets, "_download", functools.partial(download, backoff=0.001))
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir, stems=("train", "val", "test_2016_flickr"))
    for p in src_dir.iterdir():
        server.files["/raw/" + p.name] = p.read_bytes()
    prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=server.url + "/raw/")
    assert (tmp_path / "m30k" / DOWNLOADED).is_file()
    capsys.readouterr()
    again = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=_unreachable_url())
    assert sorted(again["tests"]) == ["test_2016_flickr"]
    notes = capsys.readouterr().err.splitlines()
    skipped = [n for n in notes if n.startswith("note: test set")]
    assert [n[:60] for n in skipped] == [f"note: test set multi30k {t} could not be downloaded for en-de"[:60]
                                         for t in ("test_2017_flickr", "test_2018_flickr")], notes
    retries = [n for n in notes if n not in skipped]   # each retry is said (a stalled server had been minutes of silence)
    assert len(retries) == 6 and all("trying again in" in n and "(try " in n for n in retries), notes
    own = tmp_path / "own"          # the user's copy, lacking val: the download of val fails
    _multi30k_folder(own, stems=("train",))
    with pytest.raises(DataError):
        prepare_dataset("multi30k", own, "en", "de", progress=False, base_url=_unreachable_url())
    assert not (own / DOWNLOADED).exists()


def test_an_empty_valid_or_test_set_in_a_dataset_folder_is_refused_at_the_start(tmp_path):
    # it had trained to the end without a validation and then failed in sacreBLEU (IndexError), results.json unwritten
    for stem, says in (("val", "multi30k valid: .*val.en.gz and .*val.de.gz hold no lines: there is nothing to "
                                "validate on"),
                       ("test_2016_flickr", "multi30k test_2016_flickr: .* hold no lines: there is nothing to score")):
        folder = tmp_path / stem
        _multi30k_folder(folder)
        for lang in ("en", "de"):
            (folder / f"{stem}.{lang}.gz").write_bytes(gzip.compress(b""))
        with pytest.raises(DataError, match=says):
            prepare_dataset("multi30k", folder, "en", "de", download=False, progress=False, notes=False)


def _serve_multi30k(server, tmp_path, stems=("train", "val", "test_2016_flickr")):
    src_dir = tmp_path / "served"
    _multi30k_folder(src_dir, stems=stems)
    for p in src_dir.iterdir():
        server.files["/raw/" + p.name] = p.read_bytes()
    return server.url + "/raw/"


PORTAL = b"<!DOCTYPE html>\n<html><body>Access denied: log in to use this network</body></html>\n"


def test_a_web_page_or_an_empty_file_in_the_corpus_s_place_is_refused(server, tmp_path):
    """A login page sent with status 200 (as text/html, or gzip-encoded as a file) had been taken for the corpus and
    prepared with exit 0; an empty body had been kept as train.de.gz and read as a corpus of no lines by every later
    run. Each is one line naming the URL, nothing is kept under the corpus's name, and the next run downloads it."""
    base = _serve_multi30k(server, tmp_path)
    good = server.files["/raw/train.de.gz"]
    data_dir = tmp_path / "m30k"
    server.files["/raw/train.de.gz"], server.types["/raw/train.de.gz"] = PORTAL, "text/html; charset=utf-8"
    with pytest.raises(DataError, match=r"train.de.gz: the server sent a web page \(text/html\), not the file"):
        prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=base)
    assert not (data_dir / "train.de.gz").exists()
    del server.types["/raw/train.de.gz"]
    server.files["/raw/train.de.gz"] = gzip.compress(PORTAL)   # Content-Encoding: gzip, as a file
    with pytest.raises(DataError, match=r"train.de.gz: holds a web page, not the corpus's text.*moved it aside"):
        prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=base)
    assert not (data_dir / "train.de.gz").exists() and (data_dir / "train.de.gz.bad").exists()
    for body in (b"", gzip.compress(b"")):
        server.files["/raw/train.de.gz"] = body
        with pytest.raises(DataError, match=r"train.de.gz(: the server sent an empty file|: holds no text)"):
            prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=base)
        assert not (data_dir / "train.de.gz").exists() and not (data_dir / "train.de.gz.part").exists()
    server.files["/raw/train.de.gz"] = good
    data = prepare_dataset("multi30k", data_dir, "en", "de", progress=False, base_url=base)
    assert (data_dir / "train.de.gz").read_bytes() == good and data["paths"]["train"]
    assert not (data_dir / "train.de.gz.bad").exists()   # the failed one is gone once a download passed


def test_an_optional_test_set_served_empty_is_skipped_with_a_note(server, tmp_path, capsys):
    base = _serve_multi30k(server, tmp_path, stems=("train", "val", "test_2016_flickr", "test_2017_flickr"))
    server.files["/raw/test_2017_flickr.de.gz"] = b""
    data = prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=base)
    assert sorted(data["tests"]) == ["test_2016_flickr"]
    assert "note: test set multi30k test_2017_flickr could not be downloaded for en-de (cannot download " \
           f"{base}test_2017_flickr.de.gz: the server sent an empty file" in capsys.readouterr().err


def _gzip_trailer_damaged(data):
    """A .tgz whose gzip CRC no longer matches its contents (the last 8 bytes: CRC-32, then the length)."""
    return data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:]


def test_a_tgz_whose_gzip_check_fails_is_not_extracted(server, tmp_path, monkeypatch):
    """tarfile stops at the archive's end marker and never reads gzip's CRC: a .tgz with a damaged byte had been
    extracted (changed lines, NUL bytes) and prepared without a word. Its gzip stream is now read through first:
    a damaged or shortened archive is refused before a file is written, and moved aside."""
    archive = _tgz({"train.en": "a line\n", "train.de": "eine Zeile\n"})
    for bad in (_gzip_trailer_damaged(archive), archive[:-4]):
        (tmp_path / "a.tgz").write_bytes(bad)
        with tarfile.open(tmp_path / "a.tgz") as tar:        # what tarfile alone makes of it: the members, whole
            assert tar.extractfile("train.en").read() == b"a line\n"
        with pytest.raises(DataError, match=r"a.tgz: corrupt archive"):
            extract(tmp_path / "a.tgz", tmp_path / "out")
        assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    from minitf.data import datasets
    spec = {"archives": {"a": ("a.tgz", None)}}
    corpus = datasets._in("a", "train.{lang}")
    server.files["/a.tgz"] = _gzip_trailer_damaged(archive)
    with pytest.raises(DataError, match="corrupt archive.*moved it aside"):
        datasets._fetch(spec, server.url + "/", str(tmp_path / "d"), corpus, "en", "de", progress=False)
    assert (tmp_path / "d" / "a.tgz.bad").exists() and not (tmp_path / "d" / "train.en").exists()


def test_an_archive_without_the_files_is_moved_aside_and_fetched_again(server, tmp_path, monkeypatch):
    """A dev.tgz that extracted without newstest2013 (cut at a member boundary, another layout) had been kept, and
    every later run took it again without a request, repeating the same error."""
    _serve_wmt(server, monkeypatch)
    monkeypatch.setenv("MINITF_WMT_BASE_URL", server.url + "/")
    good = server.files["/wmt14/dev.tgz"]
    server.files["/wmt14/dev.tgz"] = _tgz({"dev/other.en": "x\n"})
    with pytest.raises(DataError, match=r"wmt14 valid: the download did not bring .*newstest2013.*neither is there.*"
                                        r"which .*dev.tgz .* should hold; moved it aside to .*dev.tgz.bad. Run again"):
        prepare_dataset("wmt14", tmp_path / "wmt", src="en", tgt="de", progress=False)
    assert not (tmp_path / "wmt" / "dev.tgz").exists()
    server.files["/wmt14/dev.tgz"] = good
    data = prepare_dataset("wmt14", tmp_path / "wmt", src="en", tgt="de", progress=False)
    assert data["valid"] == (["dev en"], ["dev de"])


def test_http_errors_say_what_they_are_and_only_passing_ones_are_retried(server, tmp_path):
    server.files["/blob.bin"] = PAYLOAD
    for code, retried, says in ((403, False, "refused access"), (407, False, "refused access"),
                                (301, False, "redirects lead nowhere or go round in a loop"),
                                (503, True, "the server is failing: try again later"),
                                (408, True, "check your internet connection"),
                                (429, True, "the server asks for fewer requests: try again later")):
        server.answers["/blob.bin"] = (code, {"Location": "/blob.bin"} if code == 301 else {})
        server.requests.clear()
        with pytest.raises(DataError) as e:
            _dl(server, tmp_path, retries=2)
        assert f"HTTP {code}" in str(e.value) and says in str(e.value), str(e.value)
        # one try each (a loop of redirects is urllib's several requests, at most 11), three for the passing ones
        n = len(server.requests)
        assert (n == 3) if retried else (n < 12 if code == 301 else n == 1), (code, n)
        assert code == 408 or "check your internet connection" not in str(e.value)
    del server.answers["/blob.bin"]
    assert _read(_dl(server, tmp_path)) == PAYLOAD


@pytest.mark.parametrize("url", ["127.0.0.1:8765/raw/", "htp://example.org/x/", "https://example.org/x/ "])
def test_a_malformed_base_url_names_where_it_came_from(tmp_path, monkeypatch, url):
    monkeypatch.setenv("MINITF_MULTI30K_BASE_URL", url)
    with pytest.raises(DataError, match=r"^MINITF_MULTI30K_BASE_URL .* is not a URL the files can be downloaded from"):
        prepare_dataset("multi30k", tmp_path / "m30k", progress=False)
    # where nothing is to be downloaded (--offline, or every file there), the variable is not read
    _multi30k_folder(tmp_path / "full", stems=("train", "val", "test_2016_flickr", "test_2017_flickr",
                                               "test_2018_flickr"))
    for fetch in (True, False):
        assert prepare_dataset("multi30k", tmp_path / "full", download=fetch, progress=False)["paths"]["train"]


def test_a_file_url_with_a_space_in_its_path_is_a_mirror(server, tmp_path):
    mirror = tmp_path / "my mirror"
    _multi30k_folder(mirror)
    data = prepare_dataset("multi30k", tmp_path / "m30k", progress=False, base_url=f"file://{mirror}/")
    assert (tmp_path / "m30k" / "train.en.gz").read_bytes() == (mirror / "train.en.gz").read_bytes()
    assert data["paths"]["train"]


def test_a_data_folder_below_a_file_named_by_minitf_cache_names_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"cannot make the data folder .*: name another \(--data-dir, or MINITF_CACHE\)"):
        prepare_dataset("multi30k", progress=False)
    from minitf.cli import main          # through the command line too (it had passed the default folder as given)
    assert main(["prepare", "--dataset", "multi30k"]) == 2
    assert "(--data-dir, or MINITF_CACHE)" in capsys.readouterr().err


def test_ctrl_c_during_a_download_keeps_the_part_and_says_so(server, tmp_path, monkeypatch, capsys):
    """The interruption's line had said 'nothing half-written was kept' while the .part stayed (rightly: the same
    command resumes it). It now says where the part is; a download that gives up says so too."""
    import http.client
    from minitf.errors import nothing_half_written
    server.files["/blob.bin"] = PAYLOAD
    real_read, calls = http.client.HTTPResponse.read, []

    def read_then_ctrl_c(self, *a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_read(self, 1000)
    monkeypatch.setattr(http.client.HTTPResponse, "read", read_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as e:
        _dl(server, tmp_path)
    part = tmp_path / "blob.bin.part"
    assert part.stat().st_size == 1000
    assert nothing_half_written(e.value) == (f"the download so far is kept in {part} (1,000 bytes), and the same "
                                             f"command again resumes it; nothing else half-written was kept")
    assert nothing_half_written(KeyboardInterrupt()) == "nothing half-written was kept"
    monkeypatch.setattr(http.client.HTTPResponse, "read", real_read)
    server.cut_after = 500   # the server cuts every first answer short: then it is out of reach
    server.files["/other.bin"] = PAYLOAD
    with pytest.raises(DataError, match=r"gave up after 1 try; the 500 bytes received are kept in .*other.bin.part, "
                                        r"and a run again resumes from there"):
        download(server.url + "/other.bin", tmp_path / "other.bin", progress=False, retries=0, backoff=0, timeout=5)


def test_retry_after_in_seconds_or_as_a_date():
    import email.utils
    import time
    from minitf.data.download import _seconds
    assert _seconds("5") == 5.0 and _seconds("600") == 60.0 and _seconds(None) == 0.0 and _seconds("soon") == 0.0
    assert 15 < _seconds(email.utils.formatdate(time.time() + 20, usegmt=True)) <= 20   # a date had counted as 0
    assert _seconds(email.utils.formatdate(time.time() - 100, usegmt=True)) == 0.0


def test_a_tgz_with_bytes_after_its_gzip_stream_extracts_as_tar_takes_it(tmp_path):
    """A tape's zero padding (or other bytes that start no gzip member) after the stream: gzip and tar ignore them,
    and the read-through does too; a second gzip member is read and checked."""
    archive = _tgz({"train.en": "a line\n"})
    for tail in (b"\0" * 512, b"garbage", gzip.compress(b"more")):
        (tmp_path / "a.tgz").write_bytes(archive + tail)
        out = tmp_path / f"out{len(tail)}"
        extract(tmp_path / "a.tgz", out)
        assert (out / "train.en").read_text() == "a line\n"
    (tmp_path / "a.tgz").write_bytes(archive + _gzip_trailer_damaged(gzip.compress(b"more")))
    with pytest.raises(DataError, match="corrupt archive"):   # a damaged second member is not let through
        extract(tmp_path / "a.tgz", tmp_path / "outbad")


def test_a_multi30k_gz_with_bytes_after_its_stream_is_moved_aside_as_gzip_would_fail_on_it(server, tmp_path):
    """Python's gzip, which reads the corpus later, takes zero padding after a .gz's stream but no other bytes: the
    download's check does the same (bytes it let through had stopped the cache's build with a file never moved
    aside, so every later run tripped on it); a .tgz for tar takes any (tested above)."""
    from minitf.data.download import check_gzip
    good = gzip.compress(b"a line\n")
    for tail, ok in ((b"", True), (b"\0" * 100, True), (b"junk", False), (b"\x1f", False)):
        (tmp_path / "f.gz").write_bytes(good + tail)
        if ok:
            check_gzip(tmp_path / "f.gz")
            with gzip.open(tmp_path / "f.gz") as f:   # and gzip reads it
                assert f.read() == b"a line\n"
        else:
            with pytest.raises(DataError, match="not a readable gzip file"):
                check_gzip(tmp_path / "f.gz")
            with pytest.raises(OSError), gzip.open(tmp_path / "f.gz") as f:
                f.read()
    base = _serve_multi30k(server, tmp_path)
    server.files["/raw/train.de.gz"] += b"junk"
    with pytest.raises(DataError, match=r"train.de.gz: not a readable gzip file .*moved it aside"):
        prepare_dataset("multi30k", tmp_path / "m30k", "en", "de", progress=False, base_url=base)
