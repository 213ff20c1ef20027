"""Token-budget batching, resumable iteration, and collate."""

import itertools

import numpy as np
import pytest

from minitf.data import collate, iterate_batches, token_batches
from minitf.errors import DataError


def _lens(n=500, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 40, n), rng.integers(1, 45, n)


def test_batches_fit_budget_and_cover_each_example_once():
    src, tgt = _lens()
    for max_tokens in (50, 128, 1000):
        batches = token_batches(src, tgt, max_tokens, seed=3, epoch=0)
        for b in batches:
            assert b.dtype in (np.int32, np.int64) and len(b) > 0
            assert len(b) * (src[b].max() + 1) <= max_tokens  # src + EOS
            assert len(b) * (tgt[b].max() + 1) <= max_tokens  # BOS/EOS + tgt
        allidx = np.concatenate(batches)
        assert np.array_equal(np.sort(allidx), np.arange(len(src)))


def test_deterministic_per_seed_epoch_and_different_across_epochs():
    src, tgt = _lens()
    a = token_batches(src, tgt, 200, seed=7, epoch=2)
    b = token_batches(src, tgt, 200, seed=7, epoch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    c = token_batches(src, tgt, 200, seed=7, epoch=3)
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    d = token_batches(src, tgt, 200, seed=8, epoch=2)
    assert [x.tolist() for x in a] != [x.tolist() for x in d]


def test_no_shuffle_is_sorted_by_length():
    src, tgt = _lens()
    batches = token_batches(src, tgt, 300, seed=0, epoch=0, shuffle=False)
    order = np.concatenate(batches)
    assert np.all(np.diff(src[order]) >= 0)


def test_example_too_long_raises():
    with pytest.raises(DataError, match="max-tokens"):
        token_batches([3, 60], [3, 4], 50, seed=0, epoch=0)
    with pytest.raises(DataError, match="max-tokens"):   # target 49 + BOS = 50 ok,
        token_batches([3], [50], 50, seed=0, epoch=0)    # 50 + 1 is not
    assert len(token_batches([49], [49], 50, seed=0, epoch=0)) == 1


def test_resume_yields_same_sequence():
    src, tgt = _lens(200)
    full = list(itertools.islice(iterate_batches(src, tgt, 150, seed=5), 60))
    epochs = [e for e, _, _ in full]
    assert epochs[0] == 0 and epochs[-1] >= 1       # spans an epoch boundary
    for k in (1, 17, 38):                           # resume at the k-th position
        e, i, _ = full[k]
        resumed = list(itertools.islice(
            iterate_batches(src, tgt, 150, seed=5, start_epoch=e, start_index=i),
            len(full) - k))
        assert [(x[0], x[1]) for x in resumed] == [(x[0], x[1]) for x in full[k:]]
        assert all(np.array_equal(x[2], y[2]) for x, y in zip(resumed, full[k:]))
    # an index past the end of an epoch starts the next one
    n0 = epochs.count(0)
    nxt = next(iterate_batches(src, tgt, 150, seed=5, start_epoch=0, start_index=n0))
    assert nxt[:2] == (1, 0)


def test_collate_shapes_and_special_tokens():
    src_ids = [[5, 6, 7], [8]]
    tgt_ids = [[9, 10], [11, 12, 13, 14]]
    src, tgt_in, tgt_out = collate(src_ids, tgt_ids, pad_id=0, bos_id=2, eos_id=3)
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == np.int64
    assert src.tolist() == [[5, 6, 7, 3], [8, 3, 0, 0]]
    assert tgt_in.tolist() == [[2, 9, 10, 0, 0], [2, 11, 12, 13, 14]]
    assert tgt_out.tolist() == [[9, 10, 3, 0, 0], [11, 12, 13, 14, 3]]
    # the padded sizes are what token_batches budgets for
    assert src.shape[1] == max(map(len, src_ids)) + 1
    assert tgt_in.shape[1] == max(map(len, tgt_ids)) + 1
    s2, _, _ = collate([np.array([4, 4])], [np.array([5])], pad_id=0)
    assert s2.tolist() == [[4, 4, 3]]


def _greedy_reference(s_sorted, t_sorted, max_tokens):
    """The per-example loop token_batches replaced: cut points of a sorted order."""
    bounds, start, max_s, max_t = [0], 0, 0, 0
    for k in range(len(s_sorted)):
        new_s, new_t = max(max_s, s_sorted[k] + 1), max(max_t, t_sorted[k] + 1)
        if (k - start + 1) * max(new_s, new_t) > max_tokens:
            bounds.append(k)
            start, new_s, new_t = k, s_sorted[k] + 1, t_sorted[k] + 1
        max_s, max_t = new_s, new_t
    return bounds + [len(s_sorted)]


def test_vectorized_cut_equals_the_per_example_greedy_loop():
    rng = np.random.default_rng(5)
    for trial in range(40):
        n = int(rng.integers(1, 2000))
        dtype = (np.uint16, np.int64, np.int32)[trial % 3]
        top = 400 if trial % 4 == 0 else 70   # lengths >= 256: the 32-bit key and NumPy's sort
        src, tgt = rng.integers(0, top, n).astype(dtype), rng.integers(0, top + 20, n).astype(dtype)
        max_tokens = int(rng.integers(top + 21, 3000))
        batches = token_batches(src, tgt, max_tokens, seed=trial, epoch=0, shuffle=False)
        order = np.concatenate(batches)
        np.testing.assert_array_equal(order, np.lexsort((np.arange(n), tgt, src)))
        bounds = np.cumsum([0] + [len(b) for b in batches]).tolist()
        assert bounds == _greedy_reference(src[order].tolist(), tgt[order].tolist(), max_tokens)


def test_random_sort_order_is_a_permutation_sorted_by_length_with_random_ties():
    from minitf.data.batching import sort_order
    rng = np.random.default_rng(2)
    for top in (30, 400):
        src, tgt = rng.integers(0, top, 5000).astype(np.uint16), rng.integers(0, top, 5000).astype(np.uint16)
        a = sort_order(src, tgt, np.random.default_rng(1))
        assert np.array_equal(np.sort(a), np.arange(5000))
        key = src[a].astype(np.int64) * 1000 + tgt[a]
        assert np.all(np.diff(key) >= 0)
        b = sort_order(src, tgt, np.random.default_rng(2))
        assert not np.array_equal(a, b)                                # ties broken at random
        assert np.array_equal(a, sort_order(src, tgt, np.random.default_rng(1)))   # reproducibly
