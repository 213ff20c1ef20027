"""Filtering a parallel training corpus, as Moses' clean-corpus-n.perl does.

fairseq's WMT14 en-de recipe runs ``clean-corpus-n.perl -ratio 1.5 ... 1 250`` on
BPE pieces; `clean_mask` applies the same rules to lengths in tokenizer pieces, one
NumPy expression per rule (no per-pair Python loop), so a chunk of a 36M-pair corpus
is cleaned as fast as it is encoded.
"""
import numpy as np

REASONS = ("kept", "empty", "too_long", "ratio")   # the codes clean_mask returns


def clean_mask(src_lens, tgt_lens, max_len=250, max_ratio=1.5):
    """Why each pair is dropped, as codes into `REASONS` (0 = kept); the first rule that matches counts:
      1 "empty":    either side has 0 pieces (a blank line encodes to no piece),
      2 "too_long": either side has more than `max_len` pieces,
      3 "ratio":    one side has more than `max_ratio` times the pieces of the other
                    (None or inf: no ratio rule).
    `src_lens`/`tgt_lens` are lengths in tokenizer pieces (without BOS/EOS). Returns uint8 [n]."""
    s = np.asarray(src_lens, dtype=np.int64).ravel()
    t = np.asarray(tgt_lens, dtype=np.int64).ravel()
    if s.shape != t.shape:
        raise ValueError(f"clean_mask: {s.size} src lengths but {t.size} tgt lengths")
    ratio = float("inf") if max_ratio is None else float(max_ratio)
    code = np.zeros(s.shape, dtype=np.uint8)
    if ratio != float("inf"):
        code[(s > ratio * t) | (t > ratio * s)] = 3
    code[(s > max_len) | (t > max_len)] = 2
    code[(s == 0) | (t == 0)] = 1
    return code


def clean_stats(codes=None, counts=None):
    """{"total", "kept", "empty", "too_long", "ratio"}: pair counts of `clean_mask` codes (or of
    their bincount, `counts`, summed over chunks)."""
    if counts is None:
        counts = np.bincount(np.asarray(codes, dtype=np.int64), minlength=len(REASONS))
    return {"total": int(counts.sum()), **{r: int(c) for r, c in zip(REASONS, counts)}}


def clean_pairs(src_lines, tgt_lines, src_lens, tgt_lens, max_len=250, max_ratio=1.5):
    """Indices of the sentence pairs to keep, and why the others were dropped.

    `clean_mask`'s rules, plus: a pair whose text is blank on either side is "empty".
    Returns ``(kept, stats)``: `kept` a list of int indices in increasing order;
    `stats` a dict with keys total, kept, empty, too_long, ratio (pair counts).
    """
    n = len(src_lines)
    if not (len(tgt_lines) == len(src_lens) == len(tgt_lens) == n):
        raise ValueError(f"clean_pairs: lengths differ: {n} src lines, "
                         f"{len(tgt_lines)} tgt lines, {len(src_lens)} src lens, "
                         f"{len(tgt_lens)} tgt lens")
    codes = clean_mask(src_lens, tgt_lens, max_len, max_ratio)
    blank = np.array([not a.strip() or not b.strip() for a, b in zip(src_lines, tgt_lines)], dtype=bool)
    codes[blank.reshape(codes.shape)] = 1
    return np.flatnonzero(codes == 0).tolist(), clean_stats(codes)
