"""The binarized corpus and how it is read: a training set tokenized and cleaned ONCE (by
minitf.data.prepare), then memory-mapped at every start.

`open_cache` maps the arrays back with ``np.load(mmap_mode="r")``: a start reads the manifest,
the per-sentence lengths (2 bytes a sentence), the tokenizer model and the offsets' two ends, and no token (but
a fresh run whose output layer is the target side's pieces scans that side once (both sides with bidirectional
training), `TokenPairs.pieces`, and
BPE-dropout reads the sides it resegments), and a batch reads only its own rows (`TokenPairs.collate`). minitf.data.prepare builds a cache (fairseq's
`fairseq-preprocess` does this for fairseq; minitf with NumPy alone).

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
import hashlib
import itertools
import json
import os

import numpy as np

from minitf.errors import DataError, one_line
from minitf.data.tokenizer import tokenizer_from_bytes

FORMAT, VERSION = "minitf-binarized-corpus", 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"


# ------------------------------------------------------------------------------ reading
class TokenPairs:
    """Parallel sentences as flat token arrays (memory-mapped or in memory), with the batcher's view.

    `src_lens` / `tgt_lens` [n] are what `token_batches` plans with; `collate(idx)` builds one
    batch exactly as `batching.collate` does from id lists, reading only the rows in `idx`.

    From memory-mapped arrays the rows are read with `os.pread` from the arrays' files rather
    than through the maps: a batch picks rows all over the corpus, and the kernel maps a whole
    page-cache folio around every page fault (64 KB; up to MBs for a file written in one go), so
    reading through the maps put 548 MB in the process's resident set for one batch of a fresh
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
        """The sorted distinct piece ids [n_pieces] of one side, "target" or "source" (read in chunks: a
        memory-mapped side is never loaded whole)."""
        tokens = self.tgt_tokens if side == "target" else self.src_tokens
        seen = np.zeros(vocab_size, dtype=bool)
        for start in range(0, tokens.size, chunk):
            seen[np.unique(np.asarray(tokens[start: start + chunk]))] = True
        return np.flatnonzero(seen)

    def ids(self, i):
        """(source ids, target ids) of pair i, as integer arrays (int64 in memory; a cache's own uint16 or
        int32 when read from one)."""
        return tuple(self.rows_of(*side, np.array([i]))[0] for side in self.sides())

    def collate(self, idx, pad_id=0, bos_id=2, eos_id=3):
        """(src [B, S], tgt_in [B, T], tgt_out [B, T]) int64 for the pairs `idx`: src = ids + EOS,
        tgt_in = BOS + ids, tgt_out = ids + EOS, right-padded with `pad_id` (see batching.collate)."""
        idx = np.asarray(idx, dtype=np.int64)
        src, tgt = (self.rows_of(*side, idx) for side in self.sides())
        rows = np.arange(idx.size)
        return (_gather(*src, rows, 0, None, eos_id, pad_id), _gather(*tgt, rows, 1, bos_id, None, pad_id),
                _gather(*tgt, rows, 0, None, eos_id, pad_id))

    def sides(self):
        """((tokens, offsets, lengths) of the source, the same of the target): what rows_of reads."""
        return (self.src_tokens, self.src_offsets, self.src_lens), (self.tgt_tokens, self.tgt_offsets, self.tgt_lens)

    def rows_of(self, tokens, offsets, lens, idx):
        """(tokens, offsets) of just the rows `idx`, in memory: fancy indexing for in-memory arrays,
        two preads per row (its two offsets, then its tokens) for memory-mapped ones, checked
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
        # one pread a row, issued by map over Python ints (no Python frame, no NumPy scalar a row)
        n = int(idx.size)
        at = (fo_base + 8 * np.asarray(idx, dtype=np.int64)).tolist()
        bounds = np.frombuffer(b"".join(map(os.pread, itertools.repeat(fo, n), itertools.repeat(16, n), at)),
                               dtype=offsets.dtype).reshape(-1, 2).astype(np.int64)
        _check_rows(offsets.filename, idx, bounds, lens, tokens.size)
        lengths = bounds[:, 1] - bounds[:, 0]
        sizes, at = (item * lengths).tolist(), (ft_base + item * bounds[:, 0]).tolist()
        data = b"".join(map(os.pread, itertools.repeat(ft, n), sizes, at))
        local = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=local[1:])
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


def read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read().decode())
        if not isinstance(m, dict):   # JSON, but not the manifest's object (null, a list)
            raise ValueError(f"a JSON {type(m).__name__}, not an object")
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
    manifest = read_manifest(folder)
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
    corpus.tokenizer = tokenizer_from_bytes(proto)
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
