"""Token-budget batching, padding, and a resumable stream of batches.

Sizes are counted as the model sees them: the source gets EOS appended (len + 1),
the decoder input gets BOS and its output EOS (len + 1). A batch of B examples
padded to S source / T target positions satisfies B*S <= max_tokens and
B*T <= max_tokens.
"""

import numpy as np

from minitf.errors import DataError


def _check_lens(src_lens, tgt_lens):
    """The lengths as 1-D integer arrays, in their own dtype (a 36M-pair cache's uint16 lengths
    are not copied to int64: that alone would be 576 MB)."""
    src, tgt = np.asarray(src_lens).ravel(), np.asarray(tgt_lens).ravel()
    if not (np.issubdtype(src.dtype, np.integer) and np.issubdtype(tgt.dtype, np.integer)):
        src, tgt = src.astype(np.int64), tgt.astype(np.int64)
    if src.shape != tgt.shape:
        raise ValueError(f"src_lens has {src.size} entries but tgt_lens {tgt.size}")
    if src.size == 0:
        raise DataError("no training examples left to batch; check the data files "
                        "and the cleaning limits (--max-len)")
    return src, tgt


def _length_key(src, tgt):
    """One integer per example ordering by (source, target) length: src * width + tgt, in the
    smallest unsigned dtype that holds it (16 bits while lengths stay below 255)."""
    width = int(tgt.max()) + 1
    key_max = int(src.max()) * width + width
    ktype = np.uint16 if key_max < 2**16 else np.uint32 if key_max < 2**32 else np.int64
    return src.astype(ktype) * ktype(width) + tgt.astype(ktype), width


def sort_order(src_lens, tgt_lens, rng=None):
    """Example indices sorted by (source length, target length); ties in a random order drawn
    from `rng` (a numpy Generator), or by index when `rng` is None.

    Two stable sorts: first by a random 16-bit number per example, then by the length key;
    examples with the same length key AND random number keep their index order. While lengths
    stay below 255 both are counting sorts (`_counting_sort`); int32 indices while they fit."""
    src, tgt = _check_lens(src_lens, tgt_lens)
    return _sort_by_key(_length_key(src, tgt)[0], rng)


def _sort_by_key(key, rng):
    itype = np.int32 if key.size < 2**31 else np.int64
    tie = None if rng is None else rng.integers(0, 1 << 16, key.size, dtype=np.uint16)
    if key.dtype != np.uint16:   # long sentences: NumPy's stable sort (with [n] int64 temporaries)
        first = None if tie is None else np.argsort(tie, kind="stable").astype(itype)
        order = np.argsort(key if first is None else key[first], kind="stable")
        return order.astype(itype) if first is None else first[order]
    first = None if tie is None else _counting_sort(tie, None, itype)
    return _counting_sort(key if first is None else key[first], first, itype)


def _counting_sort(keys, values, itype, chunk=1 << 20):
    """`values` (None: 0..n-1) stably reordered by their 16-bit `keys` ([n], keys[i] is values[i]'s).

    A counting sort, chunk by chunk: each element goes straight to its slot (the next free one
    of its key's bucket), so the only [n] arrays are the result and the input. np.argsort would
    add two int64 [n] arrays (its result and its radix buffer: 576 MB for 36M examples)."""
    n = keys.size
    free = np.zeros(1 << 16, dtype=np.int64)   # next free slot of each key's bucket
    np.cumsum(np.bincount(keys, minlength=1 << 16)[:-1], out=free[1:])
    out = np.empty(n, dtype=itype if values is None else values.dtype)
    for a in range(0, n, chunk):
        k = keys[a:a + chunk]
        o = np.argsort(k, kind="stable")
        ks = k[o]
        rank = np.arange(ks.size) - np.searchsorted(ks, ks)   # place among equal keys of the chunk
        out[free[ks] + rank] = (o + a) if values is None else values[a:a + chunk][o]
        free += np.bincount(k, minlength=1 << 16)
    return out


def _cut(longest, max_tokens):
    """Greedy cut points of examples already sorted by (source, target) length.

    A batch grows while count * (its longest side + 1) fits in max_tokens; `longest` [n] is
    max(source, target) length along the order. Source lengths never decrease along the order,
    so a batch's longest source is its last one and its longest side is the running max of
    `longest`. The loop steps over RUNS of equal `longest` (a few thousand, however many
    examples): the batch in progress takes what fits of the run (count * max <= budget), then
    the rest of the run is cut into batches of exactly max_tokens // (value + 1) examples, an
    arithmetic progression; the last, partial one carries over into the next run. This is
    exactly the cut of a loop over examples (tests/test_data_batching.py checks it)."""
    n = longest.size
    change = np.flatnonzero(longest[1:] != longest[:-1]) + 1
    run_starts = [0] + change.tolist()
    run_ends = change.tolist() + [n]
    values = (longest[run_starts].astype(np.int64) + 1).tolist()
    bounds, start, longest_so_far = [0], 0, 0
    for a, b, value in zip(run_starts, run_ends, values):
        m = max(longest_so_far, value)
        fit = max_tokens // m - (a - start)          # rows of this run the current batch can take
        if fit >= b - a:
            longest_so_far = m
            continue
        bounds.append(a + max(fit, 0))
        bounds.extend(range(bounds[-1] + max_tokens // value, b, max_tokens // value))
        start, longest_so_far = bounds[-1], value
    bounds.append(n)
    return bounds


def token_batches(src_lens, tgt_lens, max_tokens, seed, epoch, shuffle=True):
    """Cut examples into batches of at most `max_tokens` padded tokens per side.

    Examples are sorted by (source length, target length), ties broken at random
    with `np.random.default_rng([seed, epoch])`, cut greedily, and (if `shuffle`)
    the batch order is shuffled with the same generator: the result depends only
    on (seed, epoch). With ``shuffle=False`` the sort is stable by index and the
    batches come shortest first (for evaluation). Vectorized NumPy: no Python loop
    over examples (docs/benchmarks.md, "Data at the paper's scale", has the measured time for 4.5M pairs).

    Returns a list of integer numpy arrays of example indices (views of one
    array); each example appears exactly once. DataError if a single example does
    not fit in `max_tokens`.
    """
    src, tgt = _check_lens(src_lens, tgt_lens)
    max_tokens = int(max_tokens)
    longest = np.maximum(src, tgt)
    too_big = np.flatnonzero(longest >= max_tokens)
    if too_big.size:
        i = int(too_big[0])
        raise DataError(f"example {i} needs {int(src[i]) + 1} source / "
                        f"{int(tgt[i]) + 1} target positions (with EOS/BOS) but "
                        f"max_tokens is {max_tokens} ({too_big.size} such examples); "
                        f"raise --max-tokens or lower --max-len")
    del longest
    rng = np.random.default_rng([int(seed), int(epoch)])
    key, width = _length_key(src, tgt)
    order = _sort_by_key(key, rng if shuffle else None)
    if key.dtype == np.uint16:   # the sorted keys are runs of each value: no gather along `order`
        key = np.repeat(np.arange(1 << 16, dtype=np.uint16), np.bincount(key, minlength=1 << 16))
    else:
        key = key[order]
    bounds = _cut(np.maximum(key // width, key % width), max_tokens)
    batches = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    if shuffle:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return batches


def iterate_batches(src_lens, tgt_lens, max_tokens, seed, start_epoch=0,
                    start_index=0, shuffle=True, first=None, after_plan=None, lengths=None):
    """Yield ``(epoch, index, idx_array)`` forever, epoch after epoch.

    Epoch e uses ``token_batches(..., seed, e)``. To resume exactly, pass the
    position of the next batch to run: after a yielded (epoch, index), that is
    (epoch, index + 1); an index at or past the end of an epoch starts the next.
    `first`: the batches of `start_epoch` if the caller already planned them;
    `after_plan()` is called after each epoch is planned (to free the planning's memory);
    `lengths(epoch)`: that epoch's (src_lens, tgt_lens) when they change from epoch to epoch
    (BPE-dropout, resegment.py), instead of `src_lens, tgt_lens`.
    """
    _check_lens(src_lens, tgt_lens)
    epoch, index = int(start_epoch), int(start_index)
    while True:
        if first is None:
            src, tgt = lengths(epoch) if lengths is not None else (src_lens, tgt_lens)
            batches = token_batches(src, tgt, max_tokens, seed, epoch, shuffle)
            if after_plan is not None:
                after_plan()
        else:
            batches, first = first, None
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


def training_batch(pairs, idx, tok):
    """One batch of the pairs `idx` as a training step and the validation loss take it: (src,
    tgt_in, tgt_out, n_target_tokens) with `tok`'s special ids, host arrays (forward_loss finds the
    non-pad rows on the host, then moves the ids itself). `pairs`: anything with TokenPairs'
    `collate` (an epoch of bidirectional training or BPE-dropout too)."""
    src, tgt_in, tgt_out = pairs.collate(idx, tok.pad_id, tok.bos_id, tok.eos_id)
    return src, tgt_in, tgt_out, int((tgt_out != tok.pad_id).sum())
