"""Filtering a parallel training corpus, as Moses' clean-corpus-n.perl does.

fairseq's WMT14 en-de recipe runs ``clean-corpus-n.perl -ratio 1.5 ... 1 250`` on
BPE pieces; `clean_pairs` applies the same rules to lengths in tokenizer pieces.
"""


def clean_pairs(src_lines, tgt_lines, src_lens, tgt_lens, max_len=250, max_ratio=1.5):
    """Indices of the sentence pairs to keep, and why the others were dropped.

    A pair is dropped (the first matching reason counts) when
      - "empty":    either side is blank or has 0 pieces,
      - "too_long": either side has more than `max_len` pieces,
      - "ratio":    one side has more than `max_ratio` times the pieces of the other.
    `src_lens`/`tgt_lens` are lengths in tokenizer pieces (without BOS/EOS).

    Returns ``(kept, stats)``: `kept` a list of int indices in increasing order;
    `stats` a dict with keys total, kept, empty, too_long, ratio (pair counts).
    """
    n = len(src_lines)
    if not (len(tgt_lines) == len(src_lens) == len(tgt_lens) == n):
        raise ValueError(f"clean_pairs: lengths differ: {n} src lines, "
                         f"{len(tgt_lines)} tgt lines, {len(src_lens)} src lens, "
                         f"{len(tgt_lens)} tgt lens")
    stats = {"total": n, "kept": 0, "empty": 0, "too_long": 0, "ratio": 0}
    kept = []
    for i in range(n):
        s, t = int(src_lens[i]), int(tgt_lens[i])
        if s == 0 or t == 0 or not src_lines[i].strip() or not tgt_lines[i].strip():
            stats["empty"] += 1
        elif s > max_len or t > max_len:
            stats["too_long"] += 1
        elif s > max_ratio * t or t > max_ratio * s:
            stats["ratio"] += 1
        else:
            kept.append(i)
    stats["kept"] = len(kept)
    return kept, stats
