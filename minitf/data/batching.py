"""Token-budget batching, padding, and a resumable stream of batches.

Sizes are counted as the model sees them: the source gets EOS appended (len + 1),
the decoder input gets BOS and its output EOS (len + 1). A batch of B examples
padded to S source / T target positions satisfies B*S <= max_tokens and
B*T <= max_tokens.
"""

import numpy as np

from minitf.errors import DataError


def _check_lens(src_lens, tgt_lens):
    src = np.asarray(src_lens, dtype=np.int64).ravel()
    tgt = np.asarray(tgt_lens, dtype=np.int64).ravel()
    if src.shape != tgt.shape:
        raise ValueError(f"src_lens has {src.size} entries but tgt_lens {tgt.size}")
    if src.size == 0:
        raise DataError("no training examples left to batch; check the data files "
                        "and the cleaning limits (--max-len)")
    return src, tgt


def token_batches(src_lens, tgt_lens, max_tokens, seed, epoch, shuffle=True):
    """Cut examples into batches of at most `max_tokens` padded tokens per side.

    Examples are sorted by (source length, target length), ties broken at random
    with `np.random.default_rng([seed, epoch])`, cut greedily, and (if `shuffle`)
    the batch order is shuffled with the same generator: the result depends only
    on (seed, epoch). With ``shuffle=False`` the sort is stable by index and the
    batches come shortest first (for evaluation).

    Returns a list of int64 numpy arrays of example indices; each example appears
    exactly once. DataError if a single example does not fit in `max_tokens`.
    """
    src, tgt = _check_lens(src_lens, tgt_lens)
    max_tokens = int(max_tokens)
    src_pad, tgt_pad = src + 1, tgt + 1
    too_big = np.flatnonzero(np.maximum(src_pad, tgt_pad) > max_tokens)
    if too_big.size:
        i = int(too_big[0])
        raise DataError(f"example {i} needs {int(src_pad[i])} source / "
                        f"{int(tgt_pad[i])} target positions (with EOS/BOS) but "
                        f"max_tokens is {max_tokens} ({too_big.size} such examples); "
                        f"raise --max-tokens or lower --max-len")
    rng = np.random.default_rng([int(seed), int(epoch)])
    if shuffle:
        order = np.lexsort((rng.random(src.size), tgt, src))
    else:
        order = np.lexsort((np.arange(src.size), tgt, src))

    batches, start, max_s, max_t = [], 0, 0, 0
    s_sorted, t_sorted = src_pad[order].tolist(), tgt_pad[order].tolist()
    for k in range(len(s_sorted)):
        new_s = max(max_s, s_sorted[k])
        new_t = max(max_t, t_sorted[k])
        count = k - start + 1
        if count * new_s > max_tokens or count * new_t > max_tokens:
            batches.append(order[start:k])
            start, new_s, new_t = k, s_sorted[k], t_sorted[k]
        max_s, max_t = new_s, new_t
    batches.append(order[start:])

    if shuffle:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return [b.astype(np.int64, copy=False) for b in batches]


def iterate_batches(src_lens, tgt_lens, max_tokens, seed, start_epoch=0,
                    start_index=0, shuffle=True):
    """Yield ``(epoch, index, idx_array)`` forever, epoch after epoch.

    Epoch e uses ``token_batches(..., seed, e)``. To resume exactly, pass the
    position of the next batch to run: after a yielded (epoch, index), that is
    (epoch, index + 1); an index at or past the end of an epoch starts the next.
    """
    _check_lens(src_lens, tgt_lens)
    epoch, index = int(start_epoch), int(start_index)
    while True:
        batches = token_batches(src_lens, tgt_lens, max_tokens, seed, epoch, shuffle)
        for i in range(index, len(batches)):
            yield epoch, i, batches[i]
        epoch, index = epoch + 1, 0


def pad_ids(id_lists, pad_id=0, prefix=None, suffix=None):
    """[B, max_len (+1 per added token)] int64 array, right-padded with `pad_id`."""
    extra = (prefix is not None) + (suffix is not None)
    rows = [np.asarray(ids, dtype=np.int64).ravel() for ids in id_lists]
    width = max((r.size for r in rows), default=0) + extra
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    for b, r in enumerate(rows):
        j = 0
        if prefix is not None:
            out[b, 0] = prefix
            j = 1
        out[b, j:j + r.size] = r
        if suffix is not None:
            out[b, j + r.size] = suffix
    return out


def collate_src(src_ids, pad_id=0, eos_id=3):
    """Source batch for encoding/translation: pieces + EOS, [B, S] int64."""
    return pad_ids(src_ids, pad_id, suffix=eos_id)


def collate(src_ids, tgt_ids, pad_id=0, bos_id=2, eos_id=3):
    """Pad one batch of id lists into ``(src, tgt_in, tgt_out)`` int64 arrays.

    src [B, S] = source + EOS; tgt_in [B, T] = BOS + target; tgt_out [B, T] =
    target + EOS; S and T are the longest lengths + 1; padding is `pad_id` on the
    right.
    """
    if len(src_ids) != len(tgt_ids):
        raise ValueError(f"collate: {len(src_ids)} sources but {len(tgt_ids)} targets")
    src = collate_src(src_ids, pad_id, eos_id)
    tgt_in = pad_ids(tgt_ids, pad_id, prefix=bos_id)
    tgt_out = pad_ids(tgt_ids, pad_id, suffix=eos_id)
    return src, tgt_in, tgt_out
