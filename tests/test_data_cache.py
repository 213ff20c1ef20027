"""The binarized corpus cache (built by minitf/data/prepare.py, read by minitf/data/binarized.py): round trip, reuse, invalidation,
corrupt files, interrupted builds, and the user's own files through train_wmt.py / prepare."""
import gzip
import json
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from minitf.data import TokenPairs, Tokenizer, clean_pairs, collate, open_cache, prepare_cache, token_batches
from minitf.data import binarized, prepare
from minitf.data.prepare import _NpyWriter, cache_folder
from minitf.errors import DataError, MinitfError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = "a the man woman dog cat sees eats red big small house runs".split()
DE = "ein der mann frau hund katze sieht isst rot gross klein haus rennt".split()


def _write(path, lines):
    """The same lines always give the same bytes: gzip's header holds no time (mtime=0), so a file written again
    with its old lines has its old SHA-256 even when a second has passed between the writes."""
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)


def _corpus(folder, n=300, seed=0, stem="train", gz=(True, False)):
    """Word-by-word 'translations', a few blank and overlong pairs for the cleaning rules."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, len(EN), size=rng.integers(1, 9)) for _ in range(n)]
    en = [" ".join(EN[i] for i in r) for r in rows]
    de = [" ".join(DE[i] for i in r) for r in rows]
    en[3], de[7] = "", "   "                      # empty on one side
    en[11] = " ".join(EN * 3)                     # far more pieces than its German side
    folder.mkdir(parents=True, exist_ok=True)
    paths = (folder / (f"{stem}.en" + (".gz" if gz[0] else "")), folder / (f"{stem}.de" + (".gz" if gz[1] else "")))
    _write(paths[0], en)
    _write(paths[1], de)
    return paths, en, de


def _left(folder):
    """What a cache's parent folder holds, less the caches' lock files (`.<name>.lock`, kept for good)."""
    return sorted(p for p in os.listdir(folder) if not (p.startswith(".") and p.endswith(".lock")))


class Log(list):
    def __call__(self, msg):
        self.append(msg)

    def built(self):
        return [m for m in self if m.startswith("cache: building")]


def _prepare(tmp_path, paths, log=None, **kw):
    kw.setdefault("vocab_size", 60)
    return prepare_cache(cache_folder(tmp_path / "cache", "toy", ("en", "de")), [paths], ("en", "de"),
                         progress=False, log=Log() if log is None else log, **kw)


def test_round_trip_same_ids_and_batches_as_encoding_in_memory(tmp_path):
    paths, en, de = _corpus(tmp_path / "data")
    corpus = _prepare(tmp_path, paths, chunk_lines=64)   # several chunks
    tok = corpus.tokenizer
    pairs = corpus.pairs("en", "de")
    assert isinstance(pairs.src_tokens, np.memmap) and isinstance(pairs.tgt_offsets, np.memmap)
    assert pairs.src_tokens.dtype == np.uint16 and pairs.src_lens.dtype == np.uint16

    # the same corpus, encoded and cleaned in memory the way train.py used to
    src_ids, tgt_ids = tok.encode(en), tok.encode(de)
    kept, stats = clean_pairs(en, de, [len(s) for s in src_ids], [len(t) for t in tgt_ids], 250, 1.5)
    assert corpus.manifest["counts"] == stats and stats["empty"] == 2 and stats["ratio"] >= 1
    assert len(pairs) == len(kept) == stats["kept"]
    memory = TokenPairs.from_lists([src_ids[i] for i in kept], [tgt_ids[i] for i in kept])
    np.testing.assert_array_equal(pairs.src_lens, memory.src_lens)
    np.testing.assert_array_equal(pairs.tgt_lens, memory.tgt_lens)
    for k in (0, 5, len(kept) - 1):
        for a, b in zip(pairs.ids(k), (src_ids[kept[k]], tgt_ids[kept[k]])):
            assert a.tolist() == b
    for epoch in (0, 1):
        cached = token_batches(pairs.src_lens, pairs.tgt_lens, 64, seed=3, epoch=epoch)
        plain = token_batches(memory.src_lens, memory.tgt_lens, 64, seed=3, epoch=epoch)
        assert len(cached) == len(plain)
        for x, y in zip(cached, plain):
            np.testing.assert_array_equal(x, y)
            want = collate([src_ids[kept[i]] for i in x], [tgt_ids[kept[i]] for i in x])
            for got in (pairs.collate(x), memory.collate(y)):
                for g, w in zip(got, want):
                    assert g.dtype == np.int64
                    np.testing.assert_array_equal(g, w)

    # the other direction reads the same folder: no rebuild, sides swapped
    log = Log()
    rev = prepare_cache(corpus.folder, [paths[::-1]], ("de", "en"), vocab_size=60, progress=False, log=log)
    assert not log.built() and rev.data_id == corpus.data_id
    r = rev.pairs("de", "en")
    np.testing.assert_array_equal(r.src_lens, pairs.tgt_lens)
    with pytest.raises(DataError, match="not fr"):
        rev.pairs("en", "fr")


def test_npy_writer_streams_a_loadable_array(tmp_path):
    for dtype, chunks in ((np.uint16, [np.arange(5), np.arange(70000) % 65536]), (np.int64, []), (np.int32, [[7]])):
        w = _NpyWriter(str(tmp_path / "a.npy"), dtype)
        for c in chunks:
            w.append(np.asarray(c))
        info = w.close()
        want = np.concatenate([np.asarray(c, dtype=dtype) for c in chunks]) if chunks else np.zeros(0, dtype)
        got = np.load(tmp_path / "a.npy", mmap_mode="r", allow_pickle=False)
        assert got.dtype == dtype and np.array_equal(got, want)
        assert info["bytes"] == os.path.getsize(tmp_path / "a.npy") and info["shape"] == [want.size]


def test_a_cleaning_rule_and_the_vocabulary_changed_together_train_a_new_tokenizer(tmp_path):
    """The reason names both changes (it had named the cleaning rule alone), and the tokenizer is trained anew at the
    size asked for, not kept from the cache: only a change of the cleaning rule alone keeps it."""
    paths, _, _ = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    log = Log()
    both = _prepare(tmp_path, paths, log, vocab_size=50, max_len=5)
    assert log.built() == [f"cache: building {first.folder} (cleaning rule max_len 250 -> 5; vocabulary size 60 -> 50)"]
    assert both.tokenizer.vocab_size == 50 and both.tokenizer.sha256 != first.tokenizer.sha256
    assert [m for m in log if m.startswith("tokenizer: training")], log


def test_reuse_and_each_reason_to_rebuild(tmp_path):
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    manifest = os.path.join(first.folder, "manifest.json")
    stamp = os.stat(manifest).st_mtime_ns

    log = Log()
    assert _prepare(tmp_path, paths, log).data_id == first.data_id and not log.built()
    assert os.stat(manifest).st_mtime_ns == stamp

    os.utime(paths[1], ns=(1, 1))                  # touched, same bytes: hashed again, reused
    log = Log()
    assert _prepare(tmp_path, paths, log).data_id == first.data_id and not log.built()
    recorded = json.loads(open(manifest).read())["corpus"]
    assert [f["mtime_ns"] for f in recorded if f["path"] == str(paths[1])] == [1]   # not hashed again next time

    log = Log()
    cleaner = _prepare(tmp_path, paths, log, max_len=5)
    assert log.built() == [f"cache: building {first.folder} (cleaning rule max_len 250 -> 5)"]
    assert cleaner.tokenizer.sha256 == first.tokenizer.sha256   # same corpus and vocabulary: tokenizer kept,
    assert not [m for m in log if m.startswith("tokenizer: training")], log   # not trained again (the same bytes)
    assert len(cleaner) < len(first) and cleaner.data_id != first.data_id

    log = Log()
    _prepare(tmp_path, paths, log, max_len=5, max_ratio=None)
    assert log.built() == [f"cache: building {first.folder} (cleaning rule max_ratio 1.5 -> None)"]

    log = Log()
    other_vocab = _prepare(tmp_path, paths, log, vocab_size=50, max_len=5, max_ratio=None)
    assert log.built() == [f"cache: building {first.folder} (vocabulary size 60 -> 50)"]
    assert other_vocab.tokenizer.vocab_size == 50


    given = Tokenizer.train(EN + DE, tmp_path / "given.model", 40)
    log = Log()
    assert _prepare(tmp_path, paths, log, vocab_size=50, max_len=5, max_ratio=None,
                    tokenizer=given).tokenizer.sha256 == given.sha256
    assert log.built() == [f"cache: building {first.folder} (another tokenizer than the cache's: --tokenizer, or a "
                           f"resumed or --init-from model's)"]

    assert de[-2][::-1] != de[-2]
    _write(paths[1], de[:-2] + [de[-2][::-1], de[-1]])     # same size, other text
    log = Log()
    changed = _prepare(tmp_path, paths, log, vocab_size=50, max_len=5, max_ratio=None, tokenizer=given)
    assert len(log.built()) == 1 and "train.de changed (same size, different content)" in log.built()[0]
    assert changed.data_id != first.data_id

    log = Log()
    prepare_cache(first.folder, [paths], ("en", "fr"), vocab_size=60, progress=False, log=log)
    assert "language pair de-en -> en-fr" in log.built()[0]


def test_the_subword_model_trained_is_the_one_asked_for_and_a_change_rebuilds(tmp_path):
    paths, en, de = _corpus(tmp_path / "data")
    log = Log()
    uni = _prepare(tmp_path, paths, log, model_type="unigram", vocab_size=45)
    assert uni.tokenizer.model_type == "unigram"
    assert any(m.startswith("tokenizer: training a joint SentencePiece unigram model of 45 pieces") for m in log)
    log = Log()
    assert _prepare(tmp_path, paths, log, model_type="unigram", vocab_size=45).data_id == uni.data_id and not log.built()

    log = Log()
    bpe = _prepare(tmp_path, paths, log, model_type="bpe", vocab_size=45)
    assert log.built() == [f"cache: building {uni.folder} (subword model unigram -> bpe)"]
    assert bpe.tokenizer.model_type == "bpe" and bpe.data_id != uni.data_id

    manifest = os.path.join(bpe.folder, "manifest.json")
    m = json.loads(open(manifest).read())
    del m["tokenizer"]["trained"]                     # a cache written before the field: trained as BPE
    open(manifest, "w").write(json.dumps(m))
    log = Log()
    assert _prepare(tmp_path, paths, log, vocab_size=45).data_id == bpe.data_id and not log.built()

    given = Tokenizer.train(EN + DE, tmp_path / "given.model", 40, model_type="unigram")
    log = Log()
    assert _prepare(tmp_path, paths, log, tokenizer=given, vocab_size=45).tokenizer.sha256 == given.sha256
    log = Log()                                       # the next run without --tokenizer trains its own again
    again = _prepare(tmp_path, paths, log, model_type="unigram", vocab_size=45)
    assert log.built() == [f"cache: building {uni.folder} (its tokenizer was given then (--tokenizer, or a resumed or "
                           f"--init-from model's); training one)"]
    assert again.tokenizer.sha256 == uni.tokenizer.sha256 and again.data_id == uni.data_id


@pytest.mark.parametrize("damage", ["truncate tokens", "garbage offsets", "delete lengths", "bad manifest",
                                    "manifest without entries", "swap tokenizer", "offsets do not span"])
def test_a_corrupt_cache_is_named_and_rebuilt(tmp_path, damage):
    paths, _, _ = _corpus(tmp_path / "data")
    good = _prepare(tmp_path, paths)
    pairs = good.pairs("en", "de")
    want_src = pairs.collate(np.arange(len(good)))[0]
    folder = good.folder
    name = {"truncate tokens": "train.en.tokens.npy", "garbage offsets": "train.de.offsets.npy",
            "delete lengths": "train.en.lengths.npy", "bad manifest": "manifest.json",
            "manifest without entries": "manifest.json",
            "swap tokenizer": "tokenizer.model", "offsets do not span": "train.de.offsets.npy"}[damage]
    path = os.path.join(folder, name)
    del pairs, good
    if damage == "truncate tokens":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 6)
    elif damage == "garbage offsets":
        with open(path, "r+b") as f:
            f.write(b"not an npy header at all")
    elif damage == "delete lengths":
        os.unlink(path)
    elif damage == "bad manifest":
        with open(path, "wb") as f:
            f.write(b"{ half a json")
    elif damage == "manifest without entries":
        with open(path, "w") as f:
            json.dump({"format": binarized.FORMAT, "version": binarized.VERSION}, f)
    elif damage == "swap tokenizer":
        with open(path, "ab") as f:
            f.write(b"x")
    else:   # right size and header, wrong values
        a = np.load(path, mmap_mode="r+")
        a[-1] += 1
        a.flush()
        del a
    with pytest.raises(DataError, match=name):
        open_cache(folder)
    log = Log()
    again = _prepare(tmp_path, paths, log)
    errors = [m for m in log if m.startswith("note:") and "rebuilding" in m]   # repaired: a note, not an error
    assert len(errors) == 1 and name in errors[0] and not [m for m in log if m.startswith("error:")]
    assert len(log.built()) == 1
    np.testing.assert_array_equal(again.pairs("en", "de").collate(np.arange(len(again)))[0], want_src)


def test_an_interrupted_build_never_leaves_a_cache_that_looks_whole(tmp_path, monkeypatch):
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    folder = first.folder
    parent = os.path.dirname(folder)
    os.makedirs(os.path.join(parent, f".{os.path.basename(folder)}.tmp-99999"))   # a killed build's leftovers

    _write(paths[0], en[:-1] + ["the dog"])

    def killed(*a, **k):
        raise KeyboardInterrupt   # the user pressed Ctrl-C in the middle of encoding
    monkeypatch.setattr(prepare, "_encode_all", killed)
    with pytest.raises(KeyboardInterrupt):
        _prepare(tmp_path, paths)
    assert _left(parent) == [os.path.basename(folder)]                # no temporary folders left
    assert open_cache(folder).data_id == first.data_id                # the old cache is still whole
    monkeypatch.undo()
    log = Log()
    assert _prepare(tmp_path, paths, log).data_id != first.data_id and "train.en" in log.built()[0]


def _kept_ids(corpus, en, de):
    """What `corpus.pairs("en", "de")` must hold: the sentences its cleaning kept, encoded with its tokenizer."""
    tok = corpus.tokenizer
    src, tgt = tok.encode(en), tok.encode(de)
    kept, _ = clean_pairs(en, de, [len(x) for x in src], [len(x) for x in tgt], 250, 1.5)
    return [src[i] for i in kept], [tgt[i] for i in kept]


def _assert_holds(pairs, src, tgt):
    assert len(pairs) == len(src)
    for got, want in zip(pairs.collate(np.arange(len(src))), collate(src, tgt)):
        np.testing.assert_array_equal(got, want)


def test_a_cache_opened_reads_its_own_data_after_another_run_rebuilds_the_folder(tmp_path):
    """Two runs of one corpus, the second with another vocabulary: it rebuilds the folder while the first
    trains. The first run's rows still come from the files it opened and checked, not from the new
    folder's files under the same names (read against the old lengths, those made a corrupt-cache error)."""
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths, vocab_size=60)
    pairs = first.pairs("en", "de")                   # no row read yet
    log = Log()
    second = _prepare(tmp_path, paths, log, vocab_size=45)
    assert log.built() == [f"cache: building {first.folder} (vocabulary size 60 -> 45)"]
    assert second.tokenizer.sha256 != first.tokenizer.sha256
    _assert_holds(pairs, *_kept_ids(first, en, de))
    _assert_holds(first.pairs("en", "de"), *_kept_ids(first, en, de))   # pairs made after the rebuild too
    _assert_holds(second.pairs("en", "de"), *_kept_ids(second, en, de))


def test_a_run_waits_for_the_cache_another_process_holds(tmp_path):
    import threading
    paths, en, de = _corpus(tmp_path / "data")
    folder = cache_folder(tmp_path / "cache", "toy", ("en", "de"))
    log, done = Log(), []
    with prepare.cache_lock(folder, Log()):
        t = threading.Thread(target=lambda: done.append(_prepare(tmp_path, paths, log)))
        t.start()
        for _ in range(500):
            if log:
                break
            t.join(0.01)
        assert log == [f"cache: waiting for process {os.getpid()} on {platform.node()}, which is preparing or "
                       f"opening {folder}"]
        t.join(0.2)
        assert t.is_alive() and not done and not os.path.exists(folder)
    t.join(60)
    assert not t.is_alive() and log.built() == [f"cache: building {folder} (no cache yet)"]
    _assert_holds(done[0].pairs("en", "de"), *_kept_ids(done[0], en, de))


def test_runs_started_together_with_different_vocabularies_each_get_their_own(tmp_path):
    """Three processes prepare one corpus's cache at once, two vocabulary sizes, and read their rows
    2 s later, after the others rebuilt the folder: each one's rows are its own tokenizer's ids (they
    take turns at the folder's lock and keep the files they opened)."""
    paths, en, de = _corpus(tmp_path / "data")
    script = (
        "import sys, numpy as np\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from minitf.data.prepare import prepare_cache, cache_folder\n"
        "c = prepare_cache(cache_folder(sys.argv[2], 'toy', ('en', 'de')), [(sys.argv[3], sys.argv[4])], ('en', 'de'),\n"
        "                  vocab_size=int(sys.argv[5]), progress=False, log=lambda m: print(m, file=sys.stderr))\n"
        "import time; time.sleep(2)   # the others rebuild the folder meanwhile: one run's batches, later\n"
        "p = c.pairs('en', 'de')\n"
        "src, tgt_in, _ = p.collate(np.arange(len(p)))\n"
        "print(c.tokenizer.sha256, src.tolist(), tgt_in.tolist())\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, ROOT, str(tmp_path / "cache"), *map(str, paths), str(v)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in (60, 45, 60)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    alone = {v: prepare_cache(cache_folder(tmp_path / f"alone{v}", "toy", ("en", "de")), [paths], ("en", "de"),
                              vocab_size=v, progress=False, log=Log()) for v in (60, 45)}
    assert alone[60].tokenizer.sha256 != alone[45].tokenizer.sha256
    for (out, err), v in zip(outs, (60, 45, 60)):
        sha, rows = out.split(" ", 1)
        want_src, want_tgt, _ = collate(*_kept_ids(alone[v], en, de))
        assert sha == alone[v].tokenizer.sha256 and rows.strip() == f"{want_src.tolist()} {want_tgt.tolist()}"


def test_misaligned_files_and_no_text_are_one_line_errors(tmp_path):
    paths, en, de = _corpus(tmp_path / "data")
    _write(paths[1], de[:-2])
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, paths)
    assert "differ in length" in str(e.value) and f"{paths[0]} has {len(en)}" in str(e.value)
    assert f"{paths[1]} has {len(de) - 2}" in str(e.value)
    _write(paths[0], ["", " "])
    _write(paths[1], ["", ""])
    with pytest.raises(DataError, match="no non-empty text"):
        _prepare(tmp_path, paths)
    assert not [p for p in _left(tmp_path / "cache") if p.startswith(".")]


# ------------------------------------------------------------------------------ through the CLIs
def _run(args, cache, module=None):
    env = dict(os.environ, MINITF_CACHE=str(cache), PYTHONHASHSEED="0")
    cmd = [sys.executable] + (["-m", module] if module else [os.path.join(ROOT, "train_wmt.py")]) + list(map(str, args))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def _own(tmp_path):
    d = tmp_path / "own"
    _corpus(d, 300, 0, "train", gz=(True, True))
    _corpus(d, 20, 1, "dev", gz=(False, False))
    _corpus(d, 12, 2, "news", gz=(True, False))
    return d


TRAIN = ["--preset", "tiny", "--vocab-size", 60, "--device", "cpu", "--quiet", "--log-every", 1, "--beam", 1,
         "--valid-every", 0, "--average-last", 1]


def test_own_files_prepare_then_train_and_score(tmp_path):
    d = _own(tmp_path)
    own = ["--train", d / "train", "--valid", d / "dev", "--test", f"news={d / 'news'}"]
    r = _run(["prepare", *own, "--vocab-size", 60, "--quiet"], tmp_path / "cache", module="minitf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cache: building" in r.stderr and "data_id" in r.stdout and "tests: news" in r.stdout
    built = re.search(r"cache: (\d+) of 300 pairs kept", r.stderr)
    dropped = f"{built.group(1)} pairs (of 300: the cleaning rules dropped {300 - int(built.group(1))} when the cache " \
              f"was built)"
    assert int(built.group(1)) < 300 and dropped in r.stdout

    out = tmp_path / "run"
    r = _run([*own, *TRAIN, "--max-steps", 4, "--save-every", 2, "--out", out], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cache: building" not in r.stderr                     # prepared once, memory-mapped since
    assert f"train: {dropped} in " in r.stderr                   # what the build dropped, said again by a reuse
    res = json.loads((out / "results.json").read_text())
    assert set(res["bleu"]) == {"valid", "news"}
    assert len((out / "news.hyp.de").read_text().splitlines()) == 12

    r = _run(["--train", d / "nowhere", "--valid", d / "dev", *TRAIN, "--out", tmp_path / "r2"], tmp_path / "cache")
    assert r.returncode == 2 and "--train" in r.stderr and "nowhere.en" in r.stderr and "Traceback" not in r.stderr
    r = _run(["--train", d / "train", *TRAIN, "--out", tmp_path / "r3"], tmp_path / "cache")
    assert r.returncode == 2 and "--valid" in r.stderr
    r = _run(["--train", d / "train", "--valid", d / "dev", "--test", "oops", *TRAIN, "--out", tmp_path / "r4"],
             tmp_path / "cache")
    assert r.returncode == 2 and "NAME=PREFIX" in r.stderr


def test_resume_refuses_a_cache_that_no_longer_matches_its_checkpoint(tmp_path):
    d = _own(tmp_path)
    own = ["--train", d / "train", "--valid", d / "dev"]
    out = tmp_path / "run"
    r = _run([*own, *TRAIN, "--max-steps", 2, "--save-every", 2, "--out", out], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([*own, *TRAIN, "--max-steps", 4, "--save-every", 2, "--out", out, "--max-len", 6, "--resume"],
             tmp_path / "cache")
    # the flag against the run's record, before the data is read
    assert r.returncode == 2 and "--max-len 6: the run in --out" in r.stderr and "Traceback" not in r.stderr
    assert "cache: building" not in r.stderr and "checkpoint_0000004.npz" not in os.listdir(out)
    # without the record (config.json gone, the data flags given), the checkpoint's data against the cache's
    os.replace(out / "config.json", tmp_path / "config.json")
    r = _run([*own, *TRAIN, "--max-steps", 4, "--save-every", 2, "--out", out, "--max-len", 6, "--resume"],
             tmp_path / "cache")
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    assert "cleaning rule max_len 250 -> 6" in r.stderr and "cache: building" not in r.stderr   # said before any rebuild
    assert "checkpoint_0000004.npz" not in os.listdir(out)
    os.replace(tmp_path / "config.json", out / "config.json")
    r = _run([*own, *TRAIN, "--max-steps", 4, "--save-every", 2, "--out", out, "--resume"], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "checkpoint_0000004.npz" in os.listdir(out)


def test_a_resumed_runs_data_is_checked_before_any_rebuild(tmp_path):
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    os.unlink(os.path.join(first.folder, "train.de.lengths.npy"))     # a defect: rebuilt, same data
    assert _prepare(tmp_path, paths, expect_data_id=first.data_id).data_id == first.data_id
    _write(paths[0], en[:-1] + ["the red dog"])                        # other data: refused, cache kept
    log = Log()
    with pytest.raises(binarized.StaleData, match="train.en.gz changed"):
        _prepare(tmp_path, paths, log, expect_data_id=first.data_id)
    assert not log.built() and open_cache(first.folder).data_id == first.data_id


def test_a_resume_whose_cache_another_run_rebuilt_for_other_data_is_refused_before_building(tmp_path):
    # the corpus edited and prepared anew for another run (another tokenizer, another data_id): a resume of the first
    # run had rebuilt the whole cache with its own tokenizer, then been refused, and the next start rebuilt it again.
    # The checkpoint's record of the corpus files' SHA-256 refuses it first
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    hashes = [f["sha256"] for f in first.manifest["corpus"]]
    _write(paths[0], en[:-1] + ["the red dog"])
    other = _prepare(tmp_path, paths, vocab_size=50)                     # another run's cache, in the same folder
    log = Log()
    with pytest.raises(binarized.StaleData, match=r"changed since this run started: .*train.en.gz \(its SHA-256\); "
                                                  r"nothing was rebuilt"):
        _prepare(tmp_path, paths, log, tokenizer=first.tokenizer, expect_data_id=first.data_id, expect_corpus=hashes)
    assert not log.built() and open_cache(other.folder).data_id == other.data_id
    _write(paths[0], en)                                                  # the files put back: rebuilt and taken
    again = _prepare(tmp_path, paths, tokenizer=first.tokenizer, expect_data_id=first.data_id, expect_corpus=hashes)
    assert again.data_id == first.data_id


# ------------------------------------------------------------------------------ corrupt contents
def _poke(path, index, value):
    """Set element `index` of a cache array in place (its header and size stay right)."""
    a = np.load(path, mmap_mode="r+")
    a[index] = value
    a.flush()
    del a


def test_every_array_has_a_checksum_that_verify_checks(tmp_path):
    paths, _, _ = _corpus(tmp_path / "data")
    good = _prepare(tmp_path, paths)
    files = good.manifest["files"]
    assert all(len(f["sha256"]) == 64 for f in files.values()) and len(files) == 6
    assert binarized.verify_cache(good.folder, good.manifest) == sum(f["bytes"] for f in files.values())
    want = good.pairs("en", "de").collate(np.arange(len(good)))
    tokens = os.path.join(good.folder, "train.en.tokens.npy")
    a = np.load(tokens, mmap_mode="r")
    _poke(tokens, 17, (int(a[17]) + 1) % good.tokenizer.vocab_size or 4)   # another id, still a valid one
    del a
    log = Log()
    assert _prepare(tmp_path, paths, log) and not log.built()        # a start scans no tokens: not seen
    log = Log()
    again = _prepare(tmp_path, paths, log, verify=True)
    errors = [m for m in log if m.startswith("note:") and "rebuilding" in m]
    assert len(errors) == 1 and "train.en.tokens.npy" in errors[0] and "SHA-256" in errors[0] and len(log.built()) == 1
    for g, w in zip(again.pairs("en", "de").collate(np.arange(len(again))), want):
        np.testing.assert_array_equal(g, w)
    log = Log()
    _prepare(tmp_path, paths, log, verify=True)
    assert not log.built() and any("6 arrays" in m and "match their SHA-256" in m for m in log)


def test_verify_hashes_a_corpus_file_edited_without_a_change_of_size_or_time(tmp_path):
    # two lines of the German side swapped, its mtime put back: a start trusts size and mtime (documented), and
    # prepare --verify had said the cache matched, training on misaligned pairs
    paths, en, de = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    st = os.stat(paths[1])
    _write(paths[1], [de[1], de[0]] + de[2:])
    os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(paths[1]).st_size == st.st_size
    log = Log()
    assert _prepare(tmp_path, paths, log).data_id == first.data_id and not log.built()
    log = Log()
    again = _prepare(tmp_path, paths, log, verify=True)
    assert log.built() == [f"cache: building {first.folder} ({paths[1]} changed (same size, different content))"]
    assert again.data_id != first.data_id


def test_a_build_that_reads_back_different_is_refused_and_the_old_cache_kept(tmp_path, monkeypatch):
    paths, en, _ = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    _write(paths[0], en[:-1] + ["the dog"])
    monkeypatch.setattr(binarized, "_content_sha256", lambda path, entry: "0" * 64)   # what a failing disk does
    with pytest.raises(DataError, match="reads back different"):
        _prepare(tmp_path, paths)
    assert _left(os.path.dirname(first.folder)) == [os.path.basename(first.folder)]
    assert open_cache(first.folder).data_id == first.data_id


@pytest.mark.parametrize("damage", ["length beyond max_len", "lengths do not add up"])
def test_lengths_that_break_an_invariant_are_seen_at_start_and_rebuilt(tmp_path, damage):
    paths, _, _ = _corpus(tmp_path / "data")
    good = _prepare(tmp_path, paths)
    lengths = os.path.join(good.folder, "train.de.lengths.npy")
    _poke(lengths, 5, 65524 if damage == "length beyond max_len" else int(good.pairs("en", "de").tgt_lens[5]) + 1)
    with pytest.raises(DataError, match="train.de.lengths.npy is corrupt"):
        open_cache(good.folder)
    log = Log()
    again = _prepare(tmp_path, paths, log)
    errors = [m for m in log if m.startswith("note:") and "rebuilding" in m]
    assert len(errors) == 1 and "train.de.lengths.npy is corrupt" in errors[0]
    assert again.data_id == good.data_id


@pytest.mark.parametrize("damage", ["a middle offset", "two lengths swapped", "an id beyond the vocabulary"])
def test_a_corrupt_row_is_a_one_line_error_when_its_batch_is_read(tmp_path, damage):
    paths, _, _ = _corpus(tmp_path / "data")
    good = _prepare(tmp_path, paths)
    n = len(good)
    name = {"a middle offset": "train.en.offsets.npy", "two lengths swapped": "train.en.lengths.npy",
            "an id beyond the vocabulary": "train.en.tokens.npy"}[damage]
    path = os.path.join(good.folder, name)
    a = np.load(path, mmap_mode="r")
    if damage == "a middle offset":
        _poke(path, n // 2, -(2**40))                  # what made os.pread fail with EINVAL
    elif damage == "two lengths swapped":
        i = int(np.flatnonzero(a[:-1] != a[1:])[0])  # the sum stays: the start cannot tell
        x, y = int(a[i]), int(a[i + 1])
        _poke(path, i, y)
        _poke(path, i + 1, x)
    else:
        _poke(path, 3, 65000)
    del a
    pairs = open_cache(good.folder).pairs("en", "de")   # cheap invariants hold
    with pytest.raises(DataError) as e:
        for idx in token_batches(pairs.src_lens, pairs.tgt_lens, 64, seed=0, epoch=0):
            pairs.collate(idx)
    msg = str(e.value)
    assert name in msg and "corrupt" in msg and "prepare --verify" in msg and "\n" not in msg


def test_a_full_disk_while_writing_the_cache_is_one_line(tmp_path, monkeypatch):
    import errno
    from minitf import fileio
    paths, _, _ = _corpus(tmp_path / "data")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(_NpyWriter, "append", full)
    with pytest.raises(MinitfError) as e:
        _prepare(tmp_path, paths)
    msg = str(e.value)
    folder = cache_folder(tmp_path / "cache", "toy", ("en", "de"))
    assert folder in msg and "disk is full" in msg and "--cache-dir" in msg and "--keep-last" not in msg
    assert "\n" not in msg and not _left(tmp_path / "cache")         # no temporary folder left
    monkeypatch.undo()

    def full_tokenizer(path, data):   # the tokenizer is written first, through fileio.atomic_write
        fileio.atomic_write(path, lambda f: full())
    monkeypatch.setattr("minitf.data.tokenizer.atomic_write_bytes", full_tokenizer)
    with pytest.raises(MinitfError) as e:
        _prepare(tmp_path, paths)
    assert folder in str(e.value) and "disk is full" in str(e.value) and "--keep-last" not in str(e.value)

    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))   # and through the CLI: one line, exit 2
    monkeypatch.setattr(_NpyWriter, "append", full)
    from minitf import cli
    d = _own(tmp_path)
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["prepare", "--train", str(d / "train"), "--valid", str(d / "dev"), "--vocab-size", "60",
                         "--quiet"])
    lines = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "disk is full" in lines[0] and "Traceback" not in err.getvalue()


def test_prepare_verify_through_the_cli(tmp_path):
    d = _own(tmp_path)
    own = ["--train", d / "train", "--valid", d / "dev", "--vocab-size", 60, "--quiet"]
    assert _run(["prepare", *own], tmp_path / "cache", module="minitf").returncode == 0
    folder = next(p for p in (tmp_path / "cache" / "bin").iterdir() if p.is_dir())
    r = _run(["prepare", *own, "--verify"], tmp_path / "cache", module="minitf")
    assert r.returncode == 0 and "match their SHA-256" in r.stderr and "building" not in r.stderr
    tokens = folder / "train.de.tokens.npy"
    a = np.load(tokens, mmap_mode="r")
    _poke(tokens, 0, 4 if int(a[0]) != 4 else 5)
    del a
    r = _run(["prepare", *own, "--verify"], tmp_path / "cache", module="minitf")
    assert r.returncode == 0, r.stderr
    assert [m for m in r.stderr.splitlines() if m.startswith(("error:", "note: cache file"))] == [
        f"note: cache file {tokens} is corrupt (its contents fail the SHA-256 recorded when it was built); rebuilding it"]


def test_a_ratio_rule_that_drops_many_short_pairs_says_how_to_keep_them(tmp_path):
    short = ["a cat", "the red house", "a dog runs", "the man", "a big tree"] * 20
    longer = ["ein kleiner roter kater sieht", "das haus", "ein hund rennt schnell weg", "der mann", "ein baum"] * 20
    paths = (tmp_path / "s.en", tmp_path / "s.de")
    _write(paths[0], short)
    _write(paths[1], longer)
    log = Log()
    _prepare(tmp_path, paths, log)
    note = [m for m in log if m.startswith("note: the length-ratio rule")]
    assert len(note) == 1 and "--max-ratio" in note[0] and "%" in note[0], log
    log = Log()
    _prepare(tmp_path, paths, log, max_ratio=None)
    assert not [m for m in log if m.startswith("note:")]


def test_the_cache_folder_names_the_direction_and_serves_the_reverse_one(tmp_path):
    """`<name>.<src>-<tgt>`: an en -> de run's cache is `toy.en-de` (not the sorted `de-en`); a
    de -> en run then reuses that folder rather than building a second cache of the same pairs."""
    paths, en, de = _corpus(tmp_path / "data")
    assert cache_folder(tmp_path / "cache", "toy", ("en", "de")).endswith("toy.en-de")
    assert cache_folder(tmp_path / "cache", "toy", ("de", "en")).endswith("toy.de-en")
    first = _prepare(tmp_path, paths)
    assert os.path.basename(first.folder) == "toy.en-de"
    folder = cache_folder(tmp_path / "cache", "toy", ("de", "en"))
    assert os.path.basename(folder) == "toy.en-de"
    log = Log()
    back = prepare_cache(folder, [paths[::-1]], ("de", "en"), vocab_size=60, progress=False, log=log)
    assert log.built() == [] and back.pairs("de", "en").src_lens.tolist() == first.pairs("en", "de").tgt_lens.tolist()
    assert _left(tmp_path / "cache") == ["toy.en-de"]


def test_the_pipeline_reads_data_settings_not_the_parsed_flags():
    """load_data takes DataSettings: the fields the data needs, read-only, made from parsed flags
    (DataSettings.of); handing it the flags themselves is refused."""
    import argparse
    from minitf.data.pipeline import DataSettings, load_data
    s = DataSettings.of(argparse.Namespace(src="en", tgt="fr", dataset="multi30k", out="runs/x", max_len=100))
    assert (s.src, s.tgt, s.dataset, s.max_len, s.quiet) == ("en", "fr", "multi30k", 100, False)
    assert not hasattr(s, "out")
    with pytest.raises(Exception, match="frozen|cannot assign"):
        s.src = "de"
    with pytest.raises(TypeError, match="DataSettings"):
        load_data(argparse.Namespace(src="en"))


def test_a_cache_dir_that_is_a_file_or_cannot_be_made_is_one_clear_error(tmp_path):
    """--cache-dir naming a file, or a folder that cannot be made (here: below a file), is a DataError naming it, not
    an OSError's traceback."""
    from minitf.data.pipeline import DataSettings, load_data
    for split in ("tr", "va"):
        for lang in ("en", "de"):
            (tmp_path / f"{split}.{lang}").write_text("a cat sits\nthe dog runs\n")
    a_file = tmp_path / "tr.en"
    own = dict(train=str(tmp_path / "tr"), valid=str(tmp_path / "va"), test=(), vocab_size=20, quiet=True)
    with pytest.raises(DataError, match=f"^--cache-dir {a_file} is a file: name the folder"):
        load_data(DataSettings(cache_dir=str(a_file), **own))
    with pytest.raises(DataError, match=f"^cannot make the cache folder {a_file}/sub \\(Not a directory\\): name "
                                        f"another \\(--cache-dir\\)"):
        load_data(DataSettings(cache_dir=str(a_file / "sub"), **own))


def test_own_sets_that_cannot_work_are_refused_at_the_start(tmp_path):
    # an empty --valid or --test set had trained the whole run and then failed in sacreBLEU (an IndexError) before
    # results.json was written; a --vocab-size below the corpus's characters had been SentencePiece's INTERNAL error
    # naming a deleted temporary file and an option minitf does not have
    from minitf.data.datasets import user_dataset
    d = _own(tmp_path)
    for stem in ("empty.en", "empty.de"):
        (d / stem).write_text("")
    with pytest.raises(DataError, match=r"^--valid .*empty: .*empty.en and .*empty.de hold no lines: there is nothing "
                                        r"to validate on$"):
        user_dataset(d / "train", d / "empty")
    with pytest.raises(DataError, match=r"^--test news=.*empty: .* hold no lines: there is nothing to score$"):
        user_dataset(d / "train", d / "dev", tests=[("news", d / "empty")])
    paths, _, _ = _corpus(tmp_path / "data")
    with pytest.raises(DataError, match=r"^--vocab-size 8 is too small for this corpus: it needs at least \d+ pieces "
                                        r"\(its characters and the special pieces\)$") as e:
        _prepare(tmp_path, paths, vocab_size=8)
    need = re.search(r"at least (\d+) pieces", str(e.value)).group(1)
    for tiny in (3, 4):   # no room for eos or unk: SentencePiece's INTERNAL error naming insert_id had come through,
        # and then a message without the figure
        with pytest.raises(DataError, match=rf"^--vocab-size {tiny} is too small for this corpus: it needs at least "
                                            rf"{need} pieces"):
            _prepare(tmp_path, paths, vocab_size=tiny)
    with pytest.raises(DataError, match=r"^--test news=\S*nothing: expected"):   # (it had read '--test news= PATH')
        user_dataset(d / "train", d / "dev", tests=[("news", d / "nothing")])
    # a set of blank lines (or one whose every pair has a blank side) had trained to the end, choosing the best
    # checkpoint on BLEU 0.00 of empty sentences
    (d / "blank.en").write_text("\n  \nword\n")
    (d / "blank.de").write_text("\nWort\n\n")
    with pytest.raises(DataError, match=r"^--valid .*blank: .*blank.en and .*blank.de hold 3 lines, and in none do both "
                                        r"sides hold text: there is nothing to validate on$"):
        user_dataset(d / "train", d / "blank")
    with pytest.raises(DataError, match=r"^--test news=.*blank: .* hold 3 lines, and in none do both sides hold text: "
                                        r"there is nothing to score$"):
        user_dataset(d / "train", d / "dev", tests=[("news", d / "blank")])
    (d / "dir.de").mkdir()                                  # a folder where a file is expected is said to be one
    (d / "dir.en").write_text("x\n")
    with pytest.raises(DataError, match=r"^--valid \S*dir: expected .*; missing \S*dir\.de \(a folder\)$"):
        user_dataset(d / "train", d / "dir")


def test_a_corpus_still_being_written_is_not_cached_cut_short(tmp_path, monkeypatch):
    # with a given tokenizer (as --resume and --tokenizer give) the corpus is read once: a file that grows meanwhile
    # (a `zcat ... >>` still running) had left a cache of its first part, trusted by size and mtime ever after
    paths, en, de = _corpus(tmp_path / "data", gz=(False, False))
    tok = _prepare(tmp_path / "first", paths).tokenizer
    real = prepare._fingerprint

    def grown_after_reading(*args, **kwargs):    # more lines written once minitf had read to the end
        for path, lines in zip(paths, (en, de)):
            with open(path, "a") as f:
                f.write("".join(line + "\n" for line in lines[:5]))
        return real(*args, **kwargs)
    monkeypatch.setattr(prepare, "_fingerprint", grown_after_reading)
    with pytest.raises(DataError, match=r"the corpus changed while it was being prepared \(.*train\.(en|de): [\d,]+ bytes "
                                        r"read, [\d,]+ now\); run again once it is complete"):
        _prepare(tmp_path, paths, tokenizer=tok)
    assert not [p for p in _left(tmp_path / "cache") if not p.startswith(".")]   # nothing cached


def test_a_validation_sentence_longer_than_a_batch_is_a_batch_of_its_own(tmp_path):
    # validation sets are not cleaned: a sentence past --max-tokens had stopped the run with "example 40 needs ...
    # raise --max-tokens or lower --max-len", which the --valid file could not be told from
    from minitf.validation import valid_batches
    paths, en, de = _corpus(tmp_path / "data")
    tok = _prepare(tmp_path, paths).tokenizer
    src, tgt = en[:6] + [" ".join(en[:40])], de[:6] + [" ".join(de[:40])]
    batches = valid_batches((src, tgt), tok, max_tokens=64)
    sizes = sorted(len(b[0]) for b in batches)
    assert sum(sizes) == 7 and 1 in sizes and max(b[0].shape[1] for b in batches) > 64
    whole = [b for b in batches if len(b[0]) == 1 and b[0].shape[1] > 64]
    assert len(whole) == 1


def test_a_resume_on_another_validation_set_says_that_its_best_compares_two_sets(tmp_path):
    d = _own(tmp_path)
    args = ["--train", d / "train", *TRAIN, "--save-every", 1, "--valid-every", 1, "--out", tmp_path / "run"]
    r = _run([*args, "--valid", d / "dev", "--max-steps", 2], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([*args, "--valid", d / "dev", "--max-steps", 3, "--resume"], tmp_path / "cache")
    assert r.returncode == 0 and "the validation set is not the one" not in r.stderr, r.stderr[-2000:]
    r = _run([*args, "--valid", d / "news", "--max-steps", 4, "--resume"], tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: the validation set is not the one this run validated on before step 3: the best so far (step " \
           in r.stderr and "and --patience compare scores of the two sets" in r.stderr


def test_a_cleaning_rule_that_keeps_no_pair_leaves_the_cache_as_it_was(tmp_path):
    # a --max-len typo (1 for 100) had replaced a good cache with an empty one before the "no pairs left" error
    paths, en, de = _corpus(tmp_path / "data")
    _write(paths[0], [line + " the man sees the dog" for line in en])   # every sentence some pieces long
    _write(paths[1], [line + " der mann sieht den hund" for line in de])
    good = _prepare(tmp_path, paths)
    folder, before = good.folder, sorted(os.listdir(good.folder))
    with pytest.raises(DataError, match=r"no training pairs left after cleaning .*; check .*train\.(de|en\.gz) and "
                                        r".*train\.(de|en\.gz) and the cleaning limits \(--max-len, --max-ratio\)"):
        _prepare(tmp_path, paths, max_len=2)
    assert sorted(os.listdir(folder)) == before and len(_prepare(tmp_path, paths)) == len(good)
    assert not [p for p in _left(tmp_path / "cache") if p.startswith(".") and "tmp" in p]


@pytest.mark.parametrize("text", ["null", "[1, 2]", '"a string"', "{"])
def test_a_manifest_that_is_not_an_object_is_rebuilt_with_a_note(tmp_path, text):
    # JSON that is not an object had been an AttributeError on every start, until the folder was deleted
    paths, _, _ = _corpus(tmp_path / "data")
    first = _prepare(tmp_path, paths)
    with open(os.path.join(first.folder, "manifest.json"), "w") as f:
        f.write(text)
    log = Log()
    again = _prepare(tmp_path, paths, log)
    notes = [m for m in log if m.startswith("note: cache file") and "is unreadable" in m and "rebuilding it" in m]
    assert len(notes) == 1 and len(log.built()) == 1 and again.data_id == first.data_id


def test_a_cache_folder_that_cannot_be_written_names_itself_not_a_temporary(tmp_path, monkeypatch):
    # a read-only --cache-dir had said "error: DIR/.own.c9ddad0a.en-de.tmp-17415: Permission denied"; the file-size
    # limit while the arrays were written had been blamed on stdout
    import errno
    from minitf.fileio import WriteFailed
    paths, _, _ = _corpus(tmp_path / "data")
    folder = cache_folder(tmp_path / "cache", "toy", ("en", "de"))
    real = os.makedirs

    def read_only(path, *args, **kwargs):
        if ".tmp-" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(prepare.os, "makedirs", read_only)
    with pytest.raises(DataError) as e:
        _prepare(tmp_path, paths)
    assert str(e.value) == (f"cache {folder}: cannot write in {os.path.dirname(folder)} (Permission denied); name a "
                            f"folder you can write with --cache-dir")
    monkeypatch.setattr(prepare.os, "makedirs", real)

    def too_large(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(prepare._NpyWriter, "append", too_large)
    with pytest.raises(WriteFailed, match=rf"^cache {re.escape(folder)}: cannot write it \(File too large\)$"):
        _prepare(tmp_path, paths)
    assert not [p for p in os.listdir(os.path.dirname(folder)) if ".tmp-" in p]   # the temporary folder went
    monkeypatch.undo()
    # a corpus file moved away while the cache was built is its own error, not the cache's write
    real_stat = prepare._stat

    def moved(path):
        raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
    monkeypatch.setattr(prepare, "_stat", moved)
    with pytest.raises(FileNotFoundError) as e:
        _prepare(tmp_path, paths)
    assert e.value.filename in map(str, paths)
    monkeypatch.setattr(prepare, "_stat", real_stat)


def test_a_tokenizer_that_does_not_cover_the_corpus_is_said_at_the_build_and_each_start(tmp_path):
    """A --tokenizer trained on other text (here: Greek, for an English-German corpus) turns the corpus into <unk>s;
    it had trained to chrF 0 without a word. More than 1% <unk> on a side is a note when the cache is built and each
    time it is opened; the corpus's own tokenizer says nothing."""
    paths, _, _ = _corpus(tmp_path / "data")
    log = Log()
    _prepare(tmp_path, paths, log)
    assert not [m for m in log if "<unk>" in m]
    greek = Tokenizer.train(["Καλημέρα κόσμε", "Το σπίτι είναι μεγάλο", "Ο σκύλος τρέχει"] * 10,
                            tmp_path / "greek.model", vocab_size=30)
    for _ in range(2):   # built, then opened again
        log = Log()
        corpus = _prepare(tmp_path / "g", paths, log, tokenizer=greek)
        notes = [m for m in log if "<unk>" in m]
        assert len(notes) == 2 and all(re.match(r"note: \d+\.\d% of the (en|de) side's [\d,]+ pieces are <unk>: the "
                                                r"tokenizer does not cover this corpus's characters", m) for m in notes)
        assert corpus.manifest["unknown"]["en"] > 0.01 * corpus.manifest["tokens"]["en"]
