"""The binarized corpus: a training set tokenized and cleaned ONCE, then memory-mapped at every start.

fairseq's `fairseq-preprocess` does this for fairseq; this module does it with NumPy alone.
`prepare_cache` streams the parallel text (never the whole corpus in memory), trains or reuses
the joint SentencePiece model on a random sample, encodes chunk by chunk with all cores,
cleans each chunk (`clean_mask`: empty, > max_len pieces, length ratio) and appends the kept
pairs to flat token arrays. `open_cache` maps them back with ``np.load(mmap_mode="r")``: a
start reads the manifest and the per-sentence lengths (2 bytes a sentence) and nothing else,
and a batch reads only its own rows (`TokenPairs.collate`).

A cache folder (one per corpus and unordered language pair; each side is stored under its
language, so en->de and de->en share it)::

    manifest.json               written last: a folder without it is not a cache
    tokenizer.model             the joint SentencePiece model the ids come from
    train.<lang>.tokens.npy     uint16 [n_tokens] (int32 when the vocabulary has > 65536 pieces):
                                the pieces of every kept sentence, concatenated (no BOS/EOS)
    train.<lang>.offsets.npy    int64 [n + 1]: sentence i is tokens[offsets[i]:offsets[i + 1]]
    train.<lang>.lengths.npy    uint16 [n] (int32 past 65535): offsets[i + 1] - offsets[i]

The manifest holds the format version, the corpus fingerprint (per file: size, mtime and the
SHA-256 of its bytes, hashed while reading), the tokenizer's SHA-256 and vocabulary size (and
the subword model it was trained as, or that it was given), the cleaning parameters, the pair
counts, every array's dtype, shape, byte size and the SHA-256 of its contents, and `data_id`: a hash of everything the arrays depend on, which checkpoints record
so that `--resume` never continues on other data. The folder is built under a temporary name,
read back against those checksums, and renamed into place, so a kill -9 at any moment leaves
either the old cache, no cache, or the new one. One process at a time checks, builds and opens a
folder (`cache_lock`); an opened cache keeps its files open, so a rebuild that renames a new
folder into place afterwards does not change what a running process reads.

Corrupt contents are caught in three places, by cost: every start checks invariants that need
no scan of the tokens (`open_cache`: each sentence's length in [1, max_len], the lengths adding
up to the tokens); every batch read checks its own rows (`TokenPairs.collate`: offsets in order,
within the token array and matching the lengths; ids below the vocabulary); `python -m minitf
prepare --verify` reads everything back against the checksums (`verify_cache`).
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

from minitf.errors import DataError, one_line
from minitf.fileio import atomic_write_bytes, disk_full, folder_lock, is_disk_full
from minitf.progress import bar as progress_bar
from minitf.data.clean import clean_mask, clean_stats
from minitf.data.readers import LineStream
from minitf.data.tokenizer import Tokenizer

FORMAT, VERSION = "minitf-binarized-corpus", 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
_HEADER = 128   # bytes reserved for a streamed .npy header (the dict needs < 100)


# ------------------------------------------------------------------------------ reading
class TokenPairs:
    """Parallel sentences as flat token arrays (memory-mapped or in memory), with the batcher's view.

    `src_lens` / `tgt_lens` [n] are what `token_batches` plans with; `collate(idx)` builds one
    batch exactly as `batching.collate` does from id lists, reading only the rows in `idx`.

    From memory-mapped arrays the rows are read with `os.pread` from the arrays' files rather
    than through the maps: a batch picks rows all over the corpus, and the kernel maps a whole
    page-cache folio around every page fault (64 KB; up to MBs for a file written in one go), so
    reading through the maps put 548 MB in the process's resident set for one 83-row batch of a
    36M-pair cache. pread copies just the row's bytes out of the page cache: the process maps
    none of the corpus (docs/data.md)."""

    def __init__(self, src, tgt, vocab_size=None, files=None):
        (self.src_tokens, self.src_offsets, self.src_lens), (self.tgt_tokens, self.tgt_offsets, self.tgt_lens) = src, tgt
        if self.src_lens.shape != self.tgt_lens.shape:
            raise DataError(f"TokenPairs: {self.src_lens.size} source but {self.tgt_lens.size} target sentences")
        self.vocab_size = vocab_size   # rows read from disk are checked against it (None: not checked)
        self.files = files if files is not None else _OpenFiles()   # the maps' files, by name (see _OpenFiles)

    @classmethod
    def from_lists(cls, src_ids, tgt_ids):
        """In-memory TokenPairs from lists of id lists (a validation set, or a test's reference)."""
        return cls(_flatten(src_ids), _flatten(tgt_ids))

    def __len__(self):
        return int(self.src_lens.size)

    def pieces(self, vocab_size, side="target", chunk=1 << 24):
        """The sorted distinct piece ids [K] of one side, "target" or "source" (read in chunks: a
        memory-mapped side is never loaded whole)."""
        tokens = self.tgt_tokens if side == "target" else self.src_tokens
        seen = np.zeros(vocab_size, dtype=bool)
        for start in range(0, tokens.size, chunk):
            seen[np.unique(np.asarray(tokens[start: start + chunk]))] = True
        return np.flatnonzero(seen)

    def ids(self, i):
        """(source ids, target ids) of pair i, as int64 arrays."""
        return tuple(self._rows(*side, np.array([i]))[0] for side in self._sides())

    def collate(self, idx, pad_id=0, bos_id=2, eos_id=3):
        """(src [B, S], tgt_in [B, T], tgt_out [B, T]) int64 for the pairs `idx`: src = ids + EOS,
        tgt_in = BOS + ids, tgt_out = ids + EOS, right-padded with `pad_id` (see batching.collate)."""
        idx = np.asarray(idx, dtype=np.int64)
        src, tgt = (self._rows(*side, idx) for side in self._sides())
        rows = np.arange(idx.size)
        return (_gather(*src, rows, 0, None, eos_id, pad_id), _gather(*tgt, rows, 1, bos_id, None, pad_id),
                _gather(*tgt, rows, 0, None, eos_id, pad_id))

    def _sides(self):
        return (self.src_tokens, self.src_offsets, self.src_lens), (self.tgt_tokens, self.tgt_offsets, self.tgt_lens)

    def _rows(self, tokens, offsets, lens, idx):
        """(tokens, offsets) of just the rows `idx`, in memory: fancy indexing for in-memory arrays,
        one pread per row (its two offsets, then its tokens) for memory-mapped ones, checked
        (`_check_rows`) before and after the tokens are read."""
        if not isinstance(tokens, np.memmap):
            starts, ends = offsets[idx], offsets[idx + 1]
            lens = ends - starts
            local = np.zeros(idx.size + 1, dtype=np.int64)
            np.cumsum(lens, out=local[1:])
            pos = np.repeat(starts - local[:-1], lens) + np.arange(int(local[-1]))
            return tokens[pos], local
        fo, fo_base = self.files.open(offsets)
        ft, ft_base = self.files.open(tokens)
        item = tokens.dtype.itemsize
        bounds = np.frombuffer(b"".join(os.pread(fo, 16, fo_base + 8 * int(i)) for i in idx),
                               dtype=offsets.dtype).reshape(-1, 2).astype(np.int64)
        _check_rows(offsets.filename, idx, bounds, lens, tokens.size)
        data = b"".join(os.pread(ft, item * int(e - b), ft_base + item * int(b)) for b, e in bounds)
        local = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(bounds[:, 1] - bounds[:, 0], out=local[1:])
        if len(data) != item * local[-1]:
            raise DataError(f"{tokens.filename}: rows end before the file does: truncated while in use")
        ids = np.frombuffer(data, dtype=tokens.dtype)
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            row = idx[np.searchsorted(local, int(np.argmax(ids >= self.vocab_size)), side="right") - 1]
            raise _corrupt(tokens.filename, f"sentence {row} holds id {int(ids.max())}, beyond the vocabulary of "
                                            f"{self.vocab_size}")
        return ids, local


class _OpenFiles:
    """File descriptors of memory-mapped arrays, by file name, closed when the last holder goes.

    `open_cache` opens them together with the maps, under the cache's lock: a process that rebuilds
    the cache afterwards renames a new folder into place, and a descriptor opened by name later would
    read the new folder's files against the old folder's lengths. Opened then, the descriptors and
    the maps keep reading the files this process checked, whatever happens to their names."""

    def __init__(self):
        self.fds = {}

    def open(self, a):
        """(file descriptor, byte offset of element 0) of the memory-mapped array `a`."""
        if a.filename not in self.fds:
            self.fds[a.filename] = (os.open(a.filename, os.O_RDONLY), a.offset)
        return self.fds[a.filename]

    def __del__(self):
        for fd, _ in self.fds.values():
            os.close(fd)


def _check_rows(path, idx, bounds, lens, n_tokens):
    """DataError unless the offsets read for rows `idx` ([B, 2] start, end) are in order, within the
    token array and `lens[idx]` apart: a corrupt offsets or lengths file, found mid-training."""
    starts, ends = bounds[:, 0], bounds[:, 1]
    bad = (starts < 0) | (ends < starts) | (ends > n_tokens) | (ends - starts != lens[idx])
    if bad.any():
        i = int(np.argmax(bad))
        raise _corrupt(path, f"sentence {idx[i]} spans tokens {starts[i]}..{ends[i]} of {n_tokens}, its length "
                             f"says {int(lens[idx[i]])}", also=os.path.basename(path).replace(".offsets.", ".lengths."))


def _corrupt(path, what, also=None):
    """The error for a defect found while training, when the cache cannot be rebuilt in place
    (`also`: the other file that may be the corrupt one)."""
    return CacheDefect(f"cache file {path}{f' (or {also})' if also else ''} is corrupt ({what}); check the cache "
                       f"with `python -m minitf prepare --verify` and the same data flags (it rebuilds a corrupt "
                       f"cache), or delete {os.path.dirname(path)}; then run again (with --resume, a run continues "
                       f"where it stopped)")


def _flatten(id_lists):
    lens = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    offsets = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(offsets[-1]))
    return tokens, offsets, lens


def _gather(tokens, offsets, idx, shift, prefix, suffix, pad_id):
    """[B, longest + 1] int64: row b = (prefix) tokens of sentence idx[b] (suffix), padded."""
    starts = np.asarray(offsets[idx], dtype=np.int64)
    lens = np.asarray(offsets[idx + 1], dtype=np.int64) - starts
    width = int(lens.max(initial=0)) + 1
    pos = np.arange(width, dtype=np.int64)[None, :] - shift
    inside = (pos >= 0) & (pos < lens[:, None])
    out = np.full((idx.size, width), pad_id, dtype=np.int64)
    out[inside] = tokens[(starts[:, None] + pos)[inside]]
    if prefix is not None:
        out[:, 0] = prefix
    if suffix is not None:
        out[np.arange(idx.size), lens + shift] = suffix
    return out


class BinarizedCorpus:
    """An opened cache folder: `manifest`, `tokenizer`, `data_id`, and `pairs(src, tgt)`."""

    def __init__(self, folder, manifest, tokenizer):
        self.folder, self.manifest, self.tokenizer = folder, manifest, tokenizer
        self._maps, self._files = {}, _OpenFiles()   # lang -> (tokens, offsets, lengths) maps, and their files

    @property
    def data_id(self):
        return self.manifest["data_id"]

    def __len__(self):
        return self.manifest["counts"]["kept"]

    def pairs(self, src, tgt):
        """TokenPairs of the direction src -> tgt (the arrays memory-mapped, lengths in memory)."""
        sides = [self._side(lang) for lang in (src, tgt)]
        return TokenPairs(*((tokens, offsets, np.array(lens)) for tokens, offsets, lens in sides),
                          vocab_size=self.manifest["tokenizer"]["vocab_size"], files=self._files)

    def _side(self, lang):
        """(tokens, offsets, lengths) of one language, memory-mapped: mapped once (by `open_cache`), with
        the tokens' and offsets' files opened for reading then too."""
        if lang not in self.manifest["languages"]:
            raise DataError(f"{self.folder}: the cache holds {'-'.join(self.manifest['languages'])}, not {lang}")
        if lang not in self._maps:
            self._maps[lang] = tuple(_load(self.folder, self.manifest, f"train.{lang}.{kind}.npy", mmap=True)
                                     for kind in ("tokens", "offsets", "lengths"))
            for a in self._maps[lang][:2]:
                self._files.open(a)
        return self._maps[lang]


def _load(folder, manifest, name, mmap):
    """np.load one array of the cache, checked against the manifest; DataError naming the file."""
    path = os.path.join(folder, name)
    want = manifest["files"].get(name)
    try:
        if want is None:
            raise ValueError("not listed in the manifest")
        if os.path.getsize(path) != want["bytes"]:
            raise ValueError(f"{os.path.getsize(path)} bytes, the manifest says {want['bytes']}")
        a = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        if a.dtype.str != want["dtype"] or list(a.shape) != want["shape"]:
            raise ValueError(f"{a.dtype.str} {list(a.shape)}, the manifest says {want['dtype']} {want['shape']}")
    except Exception as e:   # NumPy's header parser raises ValueError, SyntaxError, tokenize errors, ...
        raise CacheDefect(f"cache file {path} is truncated or corrupt ({one_line(e, 200)})") from None
    return a


class CacheDefect(DataError):
    """A cache file does not match its manifest: `prepare_cache` rebuilds the cache."""


class StaleData(DataError):
    """The inputs of a cache that a resumed run was trained on have changed."""


def _read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read().decode())
        if m.get("format") != FORMAT:
            raise ValueError(f"format {m.get('format')!r}")
        return m
    except (OSError, ValueError) as e:
        raise CacheDefect(f"cache file {path} is unreadable ({e})") from None


def open_cache(folder):
    """Open a cache folder written by `prepare_cache` and check it: sizes, dtypes, shapes and the
    offsets' ends against the manifest, and the lengths (every one in [1, max_len], adding up to
    the tokens; the lengths are what a start reads anyway, the tokens are never scanned).
    CacheDefect (a DataError) naming the bad file otherwise."""
    manifest = _read_manifest(folder)
    if manifest is None:
        raise CacheDefect(f"{folder} holds no {MANIFEST}: not a (complete) cache")
    if manifest.get("version") != VERSION:
        raise CacheDefect(f"cache {folder} has format version {manifest.get('version')}, this minitf writes {VERSION}")
    corpus = BinarizedCorpus(folder, manifest, None)
    try:
        for lang in manifest["languages"]:   # checked through maps: `pairs` reads the lengths once, later
            tokens, offsets, lens = corpus._side(lang)
            if int(offsets[0]) != 0 or int(offsets[-1]) != tokens.size or lens.size != manifest["counts"]["kept"]:
                raise CacheDefect(f"cache file {os.path.join(folder, f'train.{lang}.offsets.npy')} is corrupt "
                                  f"(its offsets do not span train.{lang}.tokens.npy)")
            _check_lengths(os.path.join(folder, f"train.{lang}.lengths.npy"), lens, tokens.size,
                           manifest["cleaning"]["max_len"])
        want_sha, _ = manifest["tokenizer"]["sha256"], manifest["data_id"]
    except (KeyError, TypeError, IndexError) as e:
        raise CacheDefect(f"cache file {os.path.join(folder, MANIFEST)} lacks an entry ({e!r})") from None
    path = os.path.join(folder, TOKENIZER)
    try:
        with open(path, "rb") as f:
            proto = f.read()
    except OSError as e:
        raise CacheDefect(f"cache file {path} is unreadable ({e})") from None
    if hashlib.sha256(proto).hexdigest() != want_sha:
        raise CacheDefect(f"cache file {path} does not match the manifest's tokenizer hash")
    corpus.tokenizer = Tokenizer.from_bytes(proto)
    return corpus


def _check_lengths(path, lens, n_tokens, max_len):
    """CacheDefect unless every length is in [1, max_len] (what cleaning kept) and they add up to
    the tokens: one pass over the lengths, read in blocks from the map."""
    total, block = 0, 1 << 22
    for i in range(0, lens.size, block):
        part = np.asarray(lens[i:i + block])
        if part.size and (int(part.min()) < 1 or int(part.max()) > max_len):
            j = i + int(np.argmax((part < 1) | (part > max_len)))
            raise CacheDefect(f"cache file {path} is corrupt (sentence {j} has {int(lens[j])} pieces; the cache "
                              f"kept only 1 to {max_len})")
        total += int(part.sum(dtype=np.int64))
    if total != n_tokens:
        raise CacheDefect(f"cache file {path} is corrupt (its lengths add up to {total:,} tokens, the token "
                          f"array holds {n_tokens:,})")


def _content_sha256(path, entry):
    """SHA-256 of the array's data in a cache file (the bytes after its .npy header), read in blocks."""
    start = entry["bytes"] - entry["shape"][0] * np.dtype(entry["dtype"]).itemsize
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def verify_cache(folder, manifest):
    """Read every array of a cache back and compare it with the SHA-256 the manifest recorded when
    it was written; CacheDefect naming the first that differs. Returns the bytes read."""
    done = 0
    for name, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        if "sha256" not in entry:
            raise CacheDefect(f"cache file {os.path.join(folder, MANIFEST)} records no checksum of {name} "
                              f"(written by an earlier minitf), so it cannot be verified")
        try:
            got = _content_sha256(path, entry)
        except OSError as e:
            raise CacheDefect(f"cache file {path} is unreadable ({one_line(e, 200)})") from None
        if got != entry["sha256"]:
            raise CacheDefect(f"cache file {path} is corrupt (its contents fail the SHA-256 recorded when it "
                              f"was built)")
        done += entry["bytes"]
    return done


# ------------------------------------------------------------------------------ deciding
def _stat(path):
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _corpus_changes(recorded, files):
    """Why the corpus differs from the manifest's record (None if it does not). A file whose size
    and mtime match is trusted; one whose size matches but mtime does not is hashed again."""
    if len(recorded) != len(files):
        return f"the corpus has {len(files)} files, the cache was built from {len(recorded)}"
    for rec, path in zip(recorded, files):
        now = _stat(path)
        if now["size"] != rec["size"]:
            return f"{path} changed (size {rec['size']} -> {now['size']} bytes)"
        if now["mtime_ns"] != rec["mtime_ns"] or now["path"] != rec["path"]:
            stream = LineStream(path)
            for _ in stream:
                pass
            if stream.sha256 != rec["sha256"]:
                return f"{path} changed (same size, different content)"
            rec.update(now)   # same content: remember the new stat, so the next start need not hash it
    return None


def _why_stale(manifest, files, languages, wanted):
    """None if `manifest` describes the cache we want, else a short reason."""
    if manifest.get("version") != VERSION:
        return f"format version {manifest.get('version')} -> {VERSION}"
    if manifest["languages"] != languages:
        return f"language pair {'-'.join(manifest['languages'])} -> {'-'.join(languages)}"
    for key, label in (("max_len", "cleaning rule max_len"), ("max_ratio", "cleaning rule max_ratio")):
        if manifest["cleaning"][key] != wanted["cleaning"][key]:
            return f"{label} {manifest['cleaning'][key]} -> {wanted['cleaning'][key]}"
    tok = wanted["tokenizer"]
    if tok.get("sha256") and manifest["tokenizer"]["sha256"] != tok["sha256"]:
        return "another tokenizer was given"
    if not tok.get("sha256"):
        trained = manifest["tokenizer"].get("trained", "bpe")   # caches before the field: BPE trained here
        if trained is None:
            return "its tokenizer was given then (--tokenizer); training one"
        if trained != tok["trained"]:
            return f"subword model {trained} -> {tok['trained']}"
        if manifest["tokenizer"]["requested_vocab_size"] != tok["requested_vocab_size"]:
            return f"vocabulary size {manifest['tokenizer']['requested_vocab_size']} -> {tok['requested_vocab_size']}"
    return _corpus_changes(manifest["corpus"], files)


@contextlib.contextmanager
def cache_lock(folder, log):
    """Hold `folder`'s lock (fileio.folder_lock: an exclusive `flock` on `.<name>.lock` beside it)
    for the block.

    `prepare_cache` checks, (re)builds and opens a cache under it, so runs started together that
    want different caches of one corpus (another --vocab-size, --subword or --max-len) take turns:
    each opens the cache it asked for (its maps and files stay valid when the next one renames a
    rebuilt folder into place) instead of reading half of one and half of another. A process that
    has to wait says so, naming the holder. Where the file system cannot lock (no `fcntl`, a
    read-only or lockless mount) the block runs unlocked, as before locks existed."""
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
                  expect_data_id=None, verify=False):
    """The binarized training corpus in `folder`: reused if it matches, (re)built otherwise.

    `files`: [(path_lang0, path_lang1), ...] line-aligned text files (plain or .gz), in the order
    of `languages` (two codes; stored sorted). `tokenizer`: a Tokenizer to encode with (e.g. a
    resumed checkpoint's); None trains a joint SentencePiece model of `vocab_size` pieces
    (`model_type` "bpe" or "unigram") on a sample of `sample_size` sentences, or reuses the previous
    cache's when the corpus, subword model and vocabulary did not change. `max_ratio` None disables
    the ratio rule. One log line says why a cache is (re)built.
    `expect_data_id` (a resumed checkpoint's): when the cache holds exactly that data but its
    inputs changed, StaleData is raised BEFORE rebuilding, naming the change (a defective cache
    is rebuilt: the same inputs give the same data). `verify`: a cache that is reused is first read
    back against its checksums (`verify_cache`; a new one always is). Returns the opened
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
            manifest = _read_manifest(folder)
            try:
                reason = "no cache yet" if manifest is None else _why_stale(manifest, flat_files, languages, wanted)
            except (KeyError, TypeError, IndexError, AttributeError) as e:
                raise CacheDefect(f"cache file {os.path.join(folder, MANIFEST)} lacks an entry ({e!r})") from None
            if reason is not None and expect_data_id is not None and manifest is not None \
                    and manifest.get("data_id") == expect_data_id:
                raise StaleData(f"the training data changed since it was cached for this run: {reason}")
            if reason is None:
                corpus = open_cache(folder)
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
        if tokenizer is None and manifest is not None and reason.startswith("cleaning rule"):
            try:   # the corpus and vocabulary did not change: keep the tokenizer (and its ids)
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
    return [{**_stat(s.path), "sha256": s.sha256} for pair in streams for s in pair]


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


def _build(folder, files, languages, wanted, tokenizer, vocab_size, progress, log, sample_size, seed,
           chunk_lines, threads):
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(folder)
    for stale in os.listdir(parent):   # leftovers of a killed build
        if stale.startswith(f".{base}.tmp-") or stale.startswith(f".{base}.old-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}")
    os.makedirs(tmp)
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
            raise disk_full(f"cache {folder}", parent, advice="free some space, or put the cache on another disk "
                                                                "with --cache-dir, and run again") from None
        raise
    c = manifest["counts"]
    ratio = wanted["cleaning"]["max_ratio"]
    log(f"cache: {c['kept']:,} of {c['total']:,} pairs kept (dropped: {c['empty']:,} empty, {c['too_long']:,} "
        f"> {wanted['cleaning']['max_len']} pieces, " + (f"{c['ratio']:,} length ratio > {ratio}" if ratio else
                                                          "no ratio rule") + f") in {manifest['prepare_s']:.0f}s -> {folder}")
    if ratio and c["ratio"] > 0.01 * c["total"]:   # short sentences: 3 pieces against 5 already break 1.5
        log(f"note: the length-ratio rule (--max-ratio {ratio:g}, the WMT recipe's) dropped {c['ratio'] / c['total']:.1%} "
            f"of the pairs; for a corpus of short sentences a larger --max-ratio (e.g. 3), or 0 (no rule), keeps them")
    return open_cache(folder)


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
    codes_total = np.zeros(4, dtype=np.int64)
    streams, chunks = _stream_pass(files, progress, "encode", chunk_lines)
    for chunk in chunks:
        ids = [tokenizer.encode([pair[k] for pair in chunk], num_threads=threads) for k in range(2)]
        lens = [np.fromiter(map(len, side), dtype=np.int64, count=len(side)) for side in ids]
        codes = clean_mask(lens[0], lens[1], cleaning["max_len"], cleaning["max_ratio"])
        codes_total += np.bincount(codes, minlength=4)
        keep = codes == 0
        for k, lang in enumerate(languages):
            flat = np.fromiter(itertools.chain.from_iterable(ids[k]), dtype=tok_dtype, count=int(lens[k].sum()))
            kept_lens = lens[k][keep]
            writers[lang, "tokens"].append(flat[np.repeat(keep, lens[k])])
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
            "counts": counts, "tokens": {lang: ends[lang] for lang in languages}, "files": info,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
