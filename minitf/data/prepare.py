"""Building the binarized corpus (minitf.data.binarized describes the folder and reads it): a
training set tokenized and cleaned ONCE.

`prepare_cache` reuses a matching cache or builds one: it streams the parallel text (never the
whole corpus in memory), trains or reuses the joint SentencePiece model on a random sample,
encodes chunk by chunk with all cores, cleans each chunk (`clean_mask`: empty, > max_len pieces,
length ratio) and appends the kept pairs to flat token arrays, under a temporary name, read back
against the manifest's checksums and renamed into place. One process at a time checks, builds and
opens a folder (`cache_lock`).
"""
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import struct
import sys
import time

import numpy as np

from minitf.errors import DataError
from minitf.fileio import WriteFailed, atomic_write_bytes, disk_full, folder_lock, is_disk_full, make_folder
from minitf.progress import bar as progress_bar
from minitf.data.binarized import (FORMAT, MANIFEST, TOKENIZER, VERSION, CacheDefect, StaleData, open_cache,
                                   read_manifest, verify_cache)
from minitf.data.clean import clean_mask, clean_stats
from minitf.data.readers import LineStream
from minitf.data.tokenizer import UNK_ID, Tokenizer

_HEADER = 128   # bytes reserved for a streamed .npy header (the dict needs < 100)


# ------------------------------------------------------------------------------ deciding
def _stat(path):
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _file_sha256(path):
    """The SHA-256 of a corpus file's bytes on disk (LineStream's, as the cache records them)."""
    stream = LineStream(path)
    for _ in stream:
        pass
    return stream.sha256


def _corpus_changes(recorded, files, rehash=False):
    """Why the corpus differs from the manifest's record (None if it does not). A file whose size
    and mtime match is trusted (unless `rehash`: prepare --verify); one whose size matches but mtime does not is
    hashed again."""
    if len(recorded) != len(files):
        return f"the corpus has {len(files)} files, the cache was built from {len(recorded)}"
    for rec, path in zip(recorded, files):
        now = _stat(path)
        if now["size"] != rec["size"]:
            return f"{path} changed (size {rec['size']} -> {now['size']} bytes)"
        if rehash or now["mtime_ns"] != rec["mtime_ns"] or now["path"] != rec["path"]:
            if _file_sha256(path) != rec["sha256"]:
                return f"{path} changed (same size, different content)"
            rec.update(now)   # same content: remember the new stat, so the next start need not hash it
    return None


def _corpus_hashes(manifest, files):
    """The SHA-256 of each corpus file now: the manifest's record where the file's path, size and mtime are the
    record's, else read again."""
    records = {r.get("path"): r for r in (manifest or {}).get("corpus", ()) if isinstance(r, dict)}
    out = []
    for path in files:
        now, rec = _stat(path), records.get(os.path.abspath(path))
        trusted = rec and rec.get("size") == now["size"] and rec.get("mtime_ns") == now["mtime_ns"] and rec.get("sha256")
        out.append(rec["sha256"] if trusted else _file_sha256(path))
    return out


def _why_stale(manifest, files, languages, wanted, rehash=False):
    """None if `manifest` describes the cache we want, else a short reason: every difference, "; "-joined (a start
    that changed the cleaning rule and the tokenizer says both)."""
    if manifest.get("version") != VERSION:
        return f"format version {manifest.get('version')} -> {VERSION}"   # the other fields may be spelled otherwise
    reasons = []
    if manifest["languages"] != languages:
        reasons.append(f"language pair {'-'.join(manifest['languages'])} -> {'-'.join(languages)}")
    for key, label in (("max_len", "cleaning rule max_len"), ("max_ratio", "cleaning rule max_ratio")):
        if manifest["cleaning"][key] != wanted["cleaning"][key]:
            reasons.append(f"{label} {manifest['cleaning'][key]} -> {wanted['cleaning'][key]}")
    tok = wanted["tokenizer"]
    if tok.get("sha256") and manifest["tokenizer"]["sha256"] != tok["sha256"]:
        reasons.append("another tokenizer than the cache's: --tokenizer, or a resumed or --init-from model's")
    if not tok.get("sha256"):
        trained = manifest["tokenizer"].get("trained", "bpe")   # caches before the field: BPE trained here
        if trained is None:
            reasons.append("its tokenizer was given then (--tokenizer, or a resumed or --init-from model's); "
                           "training one")
        elif trained != tok["trained"]:
            reasons.append(f"subword model {trained} -> {tok['trained']}")
        if manifest["tokenizer"]["requested_vocab_size"] != tok["requested_vocab_size"]:
            reasons.append(f"vocabulary size {manifest['tokenizer']['requested_vocab_size']} -> "
                           f"{tok['requested_vocab_size']}")
    changed = _corpus_changes(manifest["corpus"], files, rehash)
    if changed:
        reasons.append(changed)
    return "; ".join(reasons) or None


@contextlib.contextmanager
def cache_lock(folder, log):
    """Hold `folder`'s lock (fileio.folder_lock: an exclusive `flock` on `.<name>.lock` beside it)
    for the block.

    `prepare_cache` checks, (re)builds and opens a cache under it, so runs started together that
    want different caches of one corpus (another --vocab-size, --subword or --max-len) take turns:
    each opens the cache it asked for (its maps and files stay valid when the next one renames a
    rebuilt folder into place) instead of reading half of one and half of another. A process that
    has to wait says so, naming the holder. Where the file system cannot lock (no `fcntl`, a
    read-only or lockless mount) the block runs unlocked."""
    def wait(holder, path):
        log(f"cache: waiting for {holder}, which is preparing or opening {folder}")
    with folder_lock(folder, wait):
        yield



def cache_folder(cache_root, name, languages):
    """Where the cache of corpus `name` for the direction `languages` (source, target) lives:
    `<name>.<src>-<tgt>`, so the folder names the direction it was built for. One cache serves
    both directions (the pairs are read either way round): where only the reverse direction's
    folder exists, that one."""
    root = os.fspath(cache_root)
    here = os.path.join(root, f"{name}.{'-'.join(languages)}")
    reverse = os.path.join(root, f"{name}.{'-'.join(reversed(tuple(languages)))}")
    return reverse if not os.path.exists(here) and os.path.exists(reverse) else here


def prepare_cache(folder, files, languages, vocab_size=8000, tokenizer=None, max_len=250, max_ratio=1.5, model_type="bpe",
                  progress=True, log=None, sample_size=2_000_000, seed=0, chunk_lines=20_000, threads=None,
                  expect_data_id=None, expect_corpus=None, verify=False):
    """The binarized training corpus in `folder`: reused if it matches, (re)built otherwise.

    `files`: [(path_lang0, path_lang1), ...] line-aligned text files (plain or .gz), in the order
    of `languages` (two codes; stored sorted). `tokenizer`: a Tokenizer to encode with (e.g. a
    resumed checkpoint's); None trains a joint SentencePiece model of `vocab_size` pieces
    (`model_type` "bpe" or "unigram") on a sample of `sample_size` sentences, or reuses the previous
    cache's when the corpus, subword model and vocabulary did not change. `max_ratio` None disables
    the ratio rule. One log line says why a cache is (re)built.
    `expect_data_id` (a resumed checkpoint's): when the cache holds exactly that data but its
    inputs changed, StaleData is raised BEFORE rebuilding, naming the change (a defective cache
    is rebuilt: the same inputs give the same data). `expect_corpus` (a resumed checkpoint's [SHA-256 of each corpus
    file], in `files`' order): where the cache has to be built, StaleData BEFORE building if the files are not those
    (a cache built since for other data would otherwise be rebuilt first, then refused). `verify`: the corpus files are hashed again (an edit that kept
    a file's size and modification time) and a cache that is reused is read back against its checksums
    (`verify_cache`; a new one always is). Returns the opened
    `BinarizedCorpus`."""
    if log is None:
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    order = sorted(range(2), key=lambda k: languages[k])
    languages = [languages[k] for k in order]
    files = [tuple(os.fspath(pair[k]) for k in order) for pair in files]
    flat_files = [p for pair in files for p in pair]
    wanted = {"cleaning": {"max_len": int(max_len), "max_ratio": None if max_ratio in (None, float("inf")) else float(max_ratio)},
              "tokenizer": {"sha256": tokenizer.sha256 if tokenizer else None,
                            "requested_vocab_size": int(vocab_size),
                            "trained": None if tokenizer else model_type}}
    with cache_lock(folder, log):   # one process at a time checks, builds and opens a cache folder
        try:
            manifest = read_manifest(folder)
            try:
                reason = "no cache yet" if manifest is None else _why_stale(manifest, flat_files, languages, wanted,
                                                                            rehash=verify)
            except (KeyError, TypeError, IndexError, AttributeError) as e:
                raise CacheDefect(f"cache file {os.path.join(folder, MANIFEST)} lacks an entry ({e!r})") from None
            if reason is not None and expect_data_id is not None and manifest is not None \
                    and manifest.get("data_id") == expect_data_id:
                raise StaleData(f"the training data changed since it was cached for this run: {reason}")
            if reason is not None and expect_corpus is not None:   # the cache is another's: the files themselves
                changed = [p for p, now, then in zip(flat_files, _corpus_hashes(manifest, flat_files), expect_corpus)
                           if now != then]
                if changed or len(expect_corpus) != len(flat_files):
                    raise StaleData(f"the training data changed since this run started: "
                                    f"{', '.join(changed) or 'another number of files'} (its SHA-256); nothing was "
                                    f"rebuilt")
            if reason is None:
                corpus = open_cache(folder)
                _note_unknown(manifest, log)   # said at each start, as the cache's build said it
                if verify:
                    t0, n = time.time(), verify_cache(folder, manifest)
                    log(f"cache: {len(manifest['files'])} arrays ({n / 1e6:,.1f} MB) match their SHA-256 "
                        f"({time.time() - t0:.1f}s): {folder}")
                if manifest["corpus"] != corpus.manifest["corpus"]:   # a touched file, content unchanged
                    atomic_write_bytes(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
                return corpus
        except CacheDefect as e:
            manifest, reason = None, str(e)
            log(f"note: {e}; rebuilding it")   # repaired, not a failure: the run goes on
        log(f"cache: building {folder} ({reason})")
        if tokenizer is None and manifest is not None and reason.startswith("cleaning rule") and \
                _why_stale(manifest, flat_files, languages, dict(wanted, cleaning=manifest["cleaning"])) is None:
            try:   # only the cleaning rule changed (not the corpus, subword model or vocabulary): keep the tokenizer
                tokenizer = Tokenizer(os.path.join(folder, TOKENIZER))
            except DataError:
                tokenizer = None
        return _build(folder, files, languages, wanted, tokenizer, vocab_size, progress, log, sample_size, seed,
                      chunk_lines, threads)


# ------------------------------------------------------------------------------ building
class _NpyWriter:
    """Append-only 1-D .npy file: data streams in, the header (with the final length) is written
    at close into the 128 bytes reserved for it, so nothing is copied or held in memory."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self.sha256 = hashlib.sha256()   # of the data as it is written: what verify_cache reads back
        self.f = open(path, "wb")
        self.f.write(b"\0" * _HEADER)

    def append(self, a):
        data = np.ascontiguousarray(a, dtype=self.dtype).tobytes()
        self.sha256.update(data)
        self.f.write(data)
        self.count += len(data) // self.dtype.itemsize

    def close(self):
        d = repr({"descr": self.dtype.str, "fortran_order": False, "shape": (self.count,)})
        header = b"\x93NUMPY\x01\x00" + struct.pack("<H", _HEADER - 10) + d.encode().ljust(_HEADER - 11) + b"\n"
        self.f.seek(0)
        self.f.write(header)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": _HEADER + self.count * self.dtype.itemsize, "dtype": self.dtype.str, "shape": [self.count],
                "sha256": self.sha256.hexdigest()}


def _pairs_of(files, streams):
    """Yield (line_a, line_b) over all corpora; DataError when two aligned files differ in length."""
    for (pa, pb), streams_ab in zip(files, streams):
        sa, sb = map(iter, streams_ab)
        n = 0
        for a, b in itertools.zip_longest(sa, sb):
            if a is None or b is None:
                longer = n + 1 + sum(1 for _ in (sb if a is None else sa))
                na, nb = (n, longer) if a is None else (longer, n)
                raise DataError(f"parallel files differ in length: {pa} has {na} lines but {pb} has "
                                f"{nb}; they must be line-aligned translations, re-download or fix them")
            n += 1
            yield a, b


def _chunks(it, n):
    while True:
        chunk = list(itertools.islice(it, n))
        if not chunk:
            return
        yield chunk


def _progress_bar(files, progress, desc):
    total = sum(os.path.getsize(p) for pair in files for p in pair)
    return progress_bar(total, desc, progress, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                        mininterval=0.5)


def _stream_pass(files, progress, desc, chunk_lines):
    """(streams, chunks of (a, b) line pairs) over the corpus, with a bytes bar and lines/s."""
    streams = [(LineStream(a), LineStream(b)) for a, b in files]
    bar = _progress_bar(files, progress, desc)
    t0, done = time.time(), 0

    def gen():
        nonlocal done
        try:
            for chunk in _chunks(_pairs_of(files, streams), chunk_lines):
                yield chunk
                done += len(chunk)
                bar.update(sum(s.bytes_read for pair in streams for s in pair) - bar.n)
                bar.set_postfix_str(f"{done / max(time.time() - t0, 1e-9):,.0f} lines/s", refresh=False)
        finally:   # also when reading fails: the bar ends its line, so the error starts a line of its own
            bar.close()
    return streams, gen()


def _fingerprint(files, streams):
    """Each file's path, size, mtime and the SHA-256 of the bytes read; DataError where the file's size now is not the
    bytes read (a file still being written, as by a `zcat ... >>` still running): the cache would hold a cut corpus
    that every later start trusts by its size and mtime."""
    out = []
    for pair in streams:
        for s in pair:
            now = _stat(s.path)
            if now["size"] != s.bytes_read:
                raise DataError(f"the corpus changed while it was being prepared ({s.path}: {s.bytes_read:,} bytes "
                                f"read, {now['size']:,} now); run again once it is complete")
            out.append({**now, "sha256": s.sha256})
    return out


def _sample_for_tokenizer(files, progress, sample_size, seed, chunk_lines):
    """Pass 1: a uniform random sample (reservoir) of the non-blank lines of both sides, and the
    corpus fingerprint (the files are hashed while read)."""
    rng = np.random.default_rng(seed)
    sample, seen = [], 0
    streams, chunks = _stream_pass(files, progress, "sample", chunk_lines)
    for chunk in chunks:
        lines = [x for pair in chunk for x in pair if x.strip()]
        fill = min(len(lines), sample_size - len(sample))
        sample += lines[:fill]
        seen += fill
        rest = lines[fill:]
        if rest:
            j = rng.integers(0, seen + np.arange(1, len(rest) + 1))
            for i in np.flatnonzero(j < sample_size):
                sample[j[i]] = rest[i]
            seen += len(rest)
    return sample, _fingerprint(files, streams)


def _data_id(manifest):
    key = {k: manifest[k] for k in ("languages", "cleaning", "counts")}
    key["corpus"] = [f["sha256"] for f in manifest["corpus"]]
    key["tokenizer"] = manifest["tokenizer"]["sha256"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def no_pairs_left(counts, files):
    """The DataError for a corpus whose cleaning kept no pair: its counts, its files (pairs), the flags to look at."""
    return DataError(f"no training pairs left after cleaning ({counts}); check "
                     f"{' and '.join(p for pair in files for p in pair)} and the cleaning limits (--max-len, "
                     f"--max-ratio)")


def _build(folder, files, languages, wanted, tokenizer, vocab_size, progress, log, sample_size, seed,
           chunk_lines, threads):
    parent = os.path.dirname(os.path.abspath(folder))
    make_folder(parent, "the cache folder", "--cache-dir")
    base = os.path.basename(folder)
    for stale in os.listdir(parent):   # leftovers of a killed build
        if stale.startswith(f".{base}.tmp-") or stale.startswith(f".{base}.old-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}")
    try:
        os.makedirs(tmp)
    except OSError as e:   # a read-only --cache-dir: its folder named, not the temporary one
        if is_disk_full(e):
            raise _cache_disk_full(folder, parent) from None
        raise DataError(f"cache {folder}: cannot write in {parent} ({e.strerror or e}); name a folder you can write "
                        f"with --cache-dir") from None
    t0 = time.time()
    try:
        fingerprint = None
        if tokenizer is None:
            sample, fingerprint = _sample_for_tokenizer(files, progress, sample_size, seed, chunk_lines)
            if not sample:
                raise DataError(f"{files[0][0]}: no non-empty text to train the tokenizer on; check the training files")
            model_type = wanted["tokenizer"]["trained"]   # the model asked for (no tokenizer was given)
            log(f"tokenizer: training a joint SentencePiece {'BPE' if model_type == 'bpe' else model_type} model of "
                f"{vocab_size} pieces on {len(sample):,} sampled sentences")
            tokenizer = Tokenizer.train(sample, os.path.join(tmp, TOKENIZER), vocab_size, model_type=model_type,
                                        sample_size=sample_size, seed=seed)
            del sample
        else:
            atomic_write_bytes(os.path.join(tmp, TOKENIZER), tokenizer.to_bytes())
        manifest = _encode_all(tmp, files, languages, wanted, tokenizer, progress, chunk_lines, threads)
        if fingerprint is not None and [f["sha256"] for f in fingerprint] != [f["sha256"] for f in manifest["corpus"]]:
            raise DataError(f"the corpus changed while it was being prepared ({', '.join(p for pair in files for p in pair)}); "
                            f"run again once it is complete")
        try:
            verify_cache(tmp, manifest)
        except CacheDefect as e:
            raise DataError(f"the cache just written reads back different from what was written ({e}); "
                            f"the disk or the memory of this machine may be failing") from None
        if not manifest["counts"]["kept"]:   # before a good cache is replaced by an empty one (a --max-len typo)
            raise no_pairs_left(manifest["counts"], files)
        manifest["prepare_s"] = round(time.time() - t0, 1)
        manifest["data_id"] = _data_id(manifest)
        atomic_write_bytes(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode())
        old = os.path.join(parent, f".{base}.old-{os.getpid()}")
        if os.path.exists(folder):
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:   # Ctrl-C included: the temporary folder goes, the old cache stays
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise _cache_disk_full(folder, parent) from None
        if isinstance(e, WriteFailed) or isinstance(e, OSError) and _written(e, tmp):   # the file-size limit, ...
            raise WriteFailed(f"cache {folder}", e) from None   # ... the cache named, not a temporary file in it
        raise
    c = manifest["counts"]
    ratio = wanted["cleaning"]["max_ratio"]
    log(f"cache: {c['kept']:,} of {c['total']:,} pairs kept (dropped: {c['empty']:,} empty, {c['too_long']:,} "
        f"> {wanted['cleaning']['max_len']} pieces, " + (f"{c['ratio']:,} length ratio > {ratio}" if ratio else
                                                          "no ratio rule") + f") in {manifest['prepare_s']:.0f}s -> {folder}")
    _note_unknown(manifest, log)
    if ratio and c["ratio"] > 0.01 * c["total"]:   # short sentences: 3 pieces against 5 already break 1.5
        log(f"note: the length-ratio rule (--max-ratio {ratio:g}, the WMT recipe's) dropped {c['ratio'] / c['total']:.1%} "
            f"of the pairs; for a corpus of short sentences a larger --max-ratio (e.g. 3), or 0 (no rule), keeps them")
    return open_cache(folder)


def _note_unknown(manifest, log):
    """A note where more than 1% of a side's kept pieces are <unk>: a tokenizer that does not cover the corpus (one
    trained on other text or another language, given with --tokenizer) had trained on <unk>s without a word (a Greek
    model on English and German: every word one <unk>, chrF 0)."""
    for lang, n in manifest.get("unknown", {}).items():
        total = manifest["tokens"][lang]
        if total and n > 0.01 * total:
            log(f"note: {n / total:.1%} of the {lang} side's {total:,} pieces are <unk>: the tokenizer does not "
                f"cover this corpus's characters (one trained on other text or another language?); the model reads "
                f"<unk> for them, and writes <unk> where a translation needs them")


def _cache_disk_full(folder, parent):
    """The full disk's one-line error for the cache `folder` built in `parent`."""
    return disk_full(f"cache {folder}", parent, advice="free some space, or put the cache on another disk with "
                                                       "--cache-dir, and run again")


def dropped_note(manifest):
    """" (of TOTAL: the cleaning rules dropped N when the cache was built)" where they dropped pairs, else "": said on
    every start, since a start that reuses the cache does not repeat the build's line of what it dropped."""
    c = manifest["counts"]
    gone = c["total"] - c["kept"]
    return f" (of {c['total']:,}: the cleaning rules dropped {gone:,} when the cache was built)" if gone else ""


def _written(e, tmp):
    """Whether the OSError `e` came from writing the cache being built in `tmp`: a write names no file, or names one
    there (a corpus file moved away while it was read stays its own error)."""
    return e.filename is None or os.path.abspath(os.fspath(e.filename)).startswith(os.path.abspath(tmp) + os.sep)


def _encode_all(tmp, files, languages, wanted, tokenizer, progress, chunk_lines, threads):
    """Pass 2: encode, clean and append every chunk; returns the manifest (without data_id)."""
    cleaning = wanted["cleaning"]
    vocab = tokenizer.vocab_size
    tok_dtype = np.uint16 if vocab <= 2**16 else np.int32
    len_dtype = np.uint16 if cleaning["max_len"] < 2**16 else np.int32
    threads = threads or os.cpu_count() or 1
    writers = {}
    for lang in languages:
        for kind, dtype in (("tokens", tok_dtype), ("offsets", np.int64), ("lengths", len_dtype)):
            writers[lang, kind] = _NpyWriter(os.path.join(tmp, f"train.{lang}.{kind}.npy"), dtype)
    for lang in languages:
        writers[lang, "offsets"].append(np.zeros(1, dtype=np.int64))
    ends = {lang: 0 for lang in languages}
    unknown = {lang: 0 for lang in languages}   # kept pieces that are <unk>: the tokenizer does not cover the text
    codes_total = np.zeros(4, dtype=np.int64)
    streams, chunks = _stream_pass(files, progress, "encode", chunk_lines)
    for chunk in chunks:
        sides = [tokenizer.encoder_for(lang) for lang in languages]   # one model, or a Marian model's two
        ids = [encode([pair[k] for pair in chunk], num_threads=threads) for k, encode in enumerate(sides)]
        lens = [np.fromiter(map(len, side), dtype=np.int64, count=len(side)) for side in ids]
        codes = clean_mask(lens[0], lens[1], cleaning["max_len"], cleaning["max_ratio"])
        codes_total += np.bincount(codes, minlength=4)
        keep = codes == 0
        for k, lang in enumerate(languages):
            flat = np.fromiter(itertools.chain.from_iterable(ids[k]), dtype=tok_dtype, count=int(lens[k].sum()))
            kept_lens = lens[k][keep]
            kept = flat[np.repeat(keep, lens[k])]
            unknown[lang] += int(np.count_nonzero(kept == UNK_ID))
            writers[lang, "tokens"].append(kept)
            writers[lang, "lengths"].append(kept_lens)
            writers[lang, "offsets"].append(ends[lang] + np.cumsum(kept_lens))
            ends[lang] += int(kept_lens.sum())
    info = {name: w.close() for name, w in ((f"train.{lang}.{kind}.npy", w) for (lang, kind), w in writers.items())}
    counts = clean_stats(counts=codes_total)
    return {"format": FORMAT, "version": VERSION, "languages": languages,
            "corpus": _fingerprint(files, streams), "cleaning": cleaning,
            "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": vocab,
                          "requested_vocab_size": wanted["tokenizer"]["requested_vocab_size"],
                          "trained": wanted["tokenizer"]["trained"]},
            "counts": counts, "tokens": {lang: ends[lang] for lang in languages}, "unknown": unknown, "files": info,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
