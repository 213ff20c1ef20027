"""Incremental decoding, greedy and beam search."""
import itertools

import numpy as np
import pytest

import minitf
from minitf.incremental import IncrementalDecoder
from minitf.decode import beam_search, greedy_search, length_penalty, top_candidates
from minitf.loss import log_softmax
from plain_beam import mixed_length_sources, plain_beam_search


def model_and_src(vocab=13, seed=0, dtype="float64", n_decoder_layers=None, norm_position="post"):
    cfg = minitf.Config(vocab_size=vocab, d_model=16, n_heads=2, d_ff=24, n_layers=2,
                                   n_decoder_layers=n_decoder_layers, dropout=0.1, max_len=64,
                                   norm_position=norm_position)
    model = minitf.Transformer(cfg, dtype=dtype, seed=seed)
    src = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 5, 6, 7, 3], [4, 3, 0, 0, 0, 0]])
    return model, src


@pytest.mark.parametrize("n_decoder_layers,norm_position", [(None, "post"), (1, "post"), (3, "post"), (None, "pre")])
@pytest.mark.parametrize("use_cache", [True, False])
def test_incremental_logits_equal_full_forward_at_every_step(use_cache, n_decoder_layers, norm_position):
    model, src = model_and_src(n_decoder_layers=n_decoder_layers, norm_position=norm_position)
    if norm_position == "pre":   # a final LayerNorm that is not the identity, so leaving it out would show
        model.decoder.norm.params["weight"][:] = np.linspace(0.5, 1.5, 16)
    tgt = np.array([[2, 4, 6, 8, 9, 5, 3], [2, 7, 5, 11, 12, 4, 4], [2, 9, 9, 9, 1, 4, 5]])
    model.eval()
    full = log_softmax(model.forward(src, tgt))
    dec = IncrementalDecoder(model, src, tgt.shape[1], use_cache=use_cache)
    for t in range(tgt.shape[1]):
        step = dec.step(tgt[:, t])
        np.testing.assert_allclose(step, full[:, t], rtol=1e-10, atol=1e-10)


def test_reorder_keeps_rows_consistent():
    model, src = model_and_src()
    tgt = np.array([[2, 4, 6, 8], [2, 7, 5, 11], [2, 9, 9, 9]])
    model.eval()
    full = log_softmax(model.forward(src, tgt))
    dec = IncrementalDecoder(model, src, 4)
    dec.step(tgt[:, 0])
    dec.step(tgt[:, 1])
    dec.reorder(np.array([2, 0]))
    np.testing.assert_allclose(dec.step(tgt[[2, 0], 2]), full[[2, 0], 2], rtol=1e-10, atol=1e-10)


def test_beams_share_their_sentence_state_and_follow_reordering():
    # 3 sentences x 2 beams: each sentence starts with one row (its beams would all be BOS),
    # the first reorder gives it 2; after two steps sentence 1 finishes and the beams of
    # sentences 0 and 2 take new parents: every row's logits still equal the full forward of its prefix
    model, src = model_and_src()
    model.eval()
    k = 2
    rng = np.random.default_rng(7)
    tgt = np.concatenate([np.full((6, 1), 2), rng.integers(4, 13, (6, 3))], axis=1)
    dec = IncrementalDecoder(model, src, 4, beam=k)
    full = log_softmax(model.forward(np.repeat(src, k, axis=0), tgt))
    np.testing.assert_allclose(dec.step(tgt[::k, 0]), full[::k, 0], rtol=1e-10, atol=1e-10)
    dec.reorder(np.repeat(np.arange(3), k))
    np.testing.assert_allclose(dec.step(tgt[:, 1]), full[:, 1], rtol=1e-10, atol=1e-10)
    rows = np.array([1, 1, 5, 4])
    dec.reorder(rows)
    tgt2 = tgt[rows]
    full2 = log_softmax(model.forward(src[[0, 0, 2, 2]], tgt2))
    for t in range(2, 4):
        np.testing.assert_allclose(dec.step(tgt2[:, t]), full2[:, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("use_cache", [True, False])
def test_first_reorder_expands_one_row_to_the_beams_and_drops_sentences(use_cache):
    # a group admitted mid-way starts with one row a sentence beside older beams; its first
    # reorder drops sentence 0 of it and gives the others their k rows
    model, src = model_and_src()
    model.eval()
    k = 3
    dec = IncrementalDecoder(model, src[:1], 5, use_cache=use_cache, beam=k)
    dec.step(np.array([2]))
    dec.reorder(np.zeros(k, dtype=int))
    dec.step(np.array([4, 5, 6]))
    dec.reorder(np.array([0, 0, 2]))
    dec.admit(src[1:])                                        # two more sentences, one row each
    got = dec.step(np.array([7, 7, 8, 2, 2]))
    assert got.shape[0] == k + 2
    dec.reorder(np.array([1, 0, 2, 4, 4, 4]))                 # new sentence 0 (row 3) leaves
    got = dec.step(np.array([9, 9, 9, 10, 11, 12]))
    for row, (sent, tokens) in enumerate([(0, [2, 4, 7, 9]), (0, [2, 4, 7, 9]), (0, [2, 6, 8, 9]),
                                          (2, [2, 10]), (2, [2, 11]), (2, [2, 12])]):
        want = log_softmax(model.forward(src[sent:sent + 1], np.array([tokens])))[0, -1]
        np.testing.assert_allclose(got[row], want, rtol=1e-10, atol=1e-10)


def test_a_step_fed_the_wrong_number_of_rows_says_so():
    model, src = model_and_src()
    dec = IncrementalDecoder(model, src, 4, beam=2)
    with pytest.raises(ValueError, match="3 rows"):
        dec.step(np.full(6, 2))                                # one row a sentence at first, not beam


def test_beam_size_one_equals_greedy():
    model, src = model_and_src(seed=3)
    g = greedy_search(model, src, max_len_b=8)
    b = beam_search(model, src, beam_size=1, max_len_b=8)
    assert g == b
    assert any(len(x) > 0 for x in g)


def test_greedy_cached_equals_uncached():
    model, src = model_and_src(seed=4)
    assert greedy_search(model, src, max_len_b=6) == greedy_search(model, src, max_len_b=6, use_cache=False)


def test_batched_beam_equals_one_sentence_at_a_time():
    model, src = model_and_src(seed=5)
    batched = beam_search(model, src, beam_size=3, max_len_b=6)
    single = [beam_search(model, src[i:i + 1], beam_size=3, max_len_b=6)[0] for i in range(len(src))]
    assert batched == single


@pytest.mark.parametrize("vocab,beam,max_len_b,seed", [(13, 4, 6, 0), (13, 1, 8, 1), (40, 3, 3, 2), (64, 5, 10, 3),
                                                      (7, 4, 4, 4), (13, 2, 0, 5)])
def test_beam_search_equals_the_plain_loop(vocab, beam, max_len_b, seed):
    # the vectorized search (block maxima, arrays of beams) returns what the plain loop does,
    # with length limits, early EOS, short beams (vocab 7, beam 4) and a limit of 0 extra steps
    model, src = model_and_src(vocab=vocab, seed=seed)
    src = np.minimum(src, vocab - 1)
    want = plain_beam_search(model, src, beam_size=beam, max_len_b=max_len_b)
    assert beam_search(model, src, beam_size=beam, max_len_b=max_len_b) == want
    assert any(len(h) for h in want)


@pytest.mark.parametrize("vocab,beam,max_len_b,seed", [(13, 4, 6, 0), (40, 3, 5, 2), (7, 4, 4, 4), (13, 2, 8, 6)])
def test_the_bound_stopping_rule_equals_the_plain_loop(vocab, beam, max_len_b, seed):
    model, src = model_and_src(vocab=vocab, seed=seed)
    src = np.minimum(src, vocab - 1)
    want = plain_beam_search(model, src, beam_size=beam, max_len_b=max_len_b, stop="bound")
    assert beam_search(model, src, beam_size=beam, max_len_b=max_len_b, stop="bound", batch_size=2) == want


def test_the_bound_rule_never_scores_below_the_fairseq_rule():
    # it searches on past the fairseq stop and keeps every EOS of the 2k best: its best
    # finished hypothesis scores at least as well (normalized), often strictly better
    from plain_beam import length_penalty as lp
    better = 0
    for seed in range(4):
        model, src = model_and_src(vocab=13, seed=seed)
        model.eval()
        a = beam_search(model, src, beam_size=3, max_len_b=10, stop="fairseq")
        b = beam_search(model, src, beam_size=3, max_len_b=10, stop="bound")
        for i, (ha, hb) in enumerate(zip(a, b)):
            sa, sb = (_normalized(model, src[i], h, lp) for h in (ha, hb))
            assert sb >= sa - 1e-12      # the same beams, and a superset of finished hypotheses
            better += sb > sa + 1e-12
    assert better > 0


def _normalized(model, src_row, hyp, lp, alpha=0.6):
    tgt = np.array([[2] + hyp + [3]])
    logp = log_softmax(model.forward(src_row[None], tgt[:, :-1]))[0]
    return logp[np.arange(len(hyp) + 1), tgt[0, 1:]].sum() / lp(len(hyp) + 1, alpha)


@pytest.mark.parametrize("use_cache", [True, False])
def test_continuous_batching_gives_each_sentence_its_own_search(use_cache):
    # 7 sentences of different lengths through 3 places: sentences enter while others are
    # mid-way (rows at different steps), and each gets what it gets decoded alone
    model, _ = model_and_src(vocab=13, seed=8)
    src = mixed_length_sources(vocab=13)
    want = plain_beam_search(model, src, beam_size=3, max_len_b=4)
    done = []

    class Bar:
        def update(self, n):
            done.append(n)
    got = beam_search(model, src, beam_size=3, max_len_b=4, batch_size=3, use_cache=use_cache, progress=Bar())
    assert got == want
    assert sum(done) == len(src) and len(done) > 1
    assert len({len(h) for h in want}) > 1                   # sentences finish at different steps
    greedy = greedy_search(model, src, max_len_b=4, use_cache=use_cache)
    assert greedy_search(model, src, max_len_b=4, batch_size=3, use_cache=use_cache) == greedy
    assert greedy == [greedy_search(model, src[i: i + 1], max_len_b=4)[0] for i in range(len(src))]


def test_translate_ids_keeps_the_input_order_and_takes_nothing():
    from minitf.translate import translate_ids
    model, src = model_and_src(seed=9)
    ids = [list(row[row != 0]) for row in src]
    for beam in (1, 3):
        want = [beam_search(model, src[i: i + 1, : len(ids[i])], beam, max_len_b=5)[0] for i in range(len(ids))]
        assert translate_ids(model, ids, beam, max_len_b=5, batch_size=2) == want
    assert translate_ids(model, [], 4) == []


@pytest.mark.parametrize("beam", [1, 3])
def test_streams_side_by_side_decode_each_sentence_as_alone(beam):
    # translate_ids' threads split the sorted list; every sentence decodes as it does alone,
    # the model comes back in training mode, and the shared progress counts every sentence
    from minitf.translate import translate_ids
    model, _ = model_and_src(seed=11)
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(4, 13, rng.integers(1, 9))) + [3] for _ in range(40)]
    want = translate_ids(model, ids, beam, max_len_b=5, batch_size=4, threads=1)
    model.train()

    class Count:
        n = 0

        def update(self, n):
            self.n += n

    count = Count()
    assert translate_ids(model, ids, beam, max_len_b=5, batch_size=4, threads=3, progress=count) == want
    assert count.n == len(ids) and model.training


def test_an_error_in_one_stream_reaches_the_caller():
    from minitf.translate import translate_ids
    model, _ = model_and_src()
    ids = [[5, 6, 3]] * 20 + [[5, 99, 3]]                       # 99 is outside the vocabulary of 13
    with pytest.raises(Exception, match="99"):
        translate_ids(model, ids, 2, max_len_b=3, threads=2)


def test_default_threads_one_search_per_core_with_enough_sentences(monkeypatch):
    from minitf import translate
    model, _ = model_and_src()
    monkeypatch.setattr(translate, "can_limit_blas_threads", lambda: True)
    monkeypatch.setattr(translate, "usable_cores", lambda: 4)
    assert translate.search_threads(model, 1000) == 4
    assert translate.search_threads(model, 2 * translate.MIN_THREAD_SENTENCES) == 2
    assert translate.search_threads(model, 5) == 1
    monkeypatch.setattr(translate, "can_limit_blas_threads", lambda: False)   # BLAS threads not ours to set
    assert translate.search_threads(model, 1000) == 1


def test_blas_threads_are_set_per_thread_and_restored():
    from minitf import backend
    a = np.random.default_rng(0).standard_normal((64, 64))
    want = a @ a
    with backend.blas_threads(1):
        np.testing.assert_allclose(a @ a, want, rtol=1e-12)
    fn = backend._openblas_local_threads()
    if fn is None:                         # not OpenBLAS: nothing to set, and it says so
        assert not backend.can_limit_blas_threads() and not backend.set_blas_threads(1)
        return
    before = fn(1)
    fn(before)
    with backend.blas_threads(1):
        assert fn(1) == 1
    assert fn(before) == before            # given back
    with backend.blas_threads(2):          # nested: the inner block gives back the outer's count
        with backend.blas_threads(1):
            assert fn(1) == 1
        assert fn(2) == 2
    assert fn(before) == before
    assert backend.set_blas_threads(1) and fn(before) == 1


@pytest.mark.parametrize("stop", ["bound", "ctranslate2"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_nbest_is_n_long_and_led_by_the_one_best(stop, alpha):
    """nbest=n under a rule that ends a sentence early gives n hypotheses (the search goes on past the rule's end;
    with "bound" it had given as few as 1), and its first is the search's one best at any alpha (longer hypotheses
    found after the rule's end had outranked it at alpha 2)."""
    from minitf.translate import translate_ids
    rng = np.random.default_rng(5)
    src = [list(rng.integers(4, 13, rng.integers(1, 8))) + [3] for _ in range(12)]
    for seed in (0, 1, 2):
        model, _ = model_and_src(seed=seed)
        one = translate_ids(model, src, 4, alpha, max_len_b=6, stop=stop, threads=1)
        many = translate_ids(model, src, 4, alpha, max_len_b=6, stop=stop, threads=1, nbest=4)
        assert [len(h) for h in many] == [4] * len(src)
        assert [h[0][0] for h in many] == one


def test_a_long_sentence_does_not_make_its_group_as_wide():
    """Sentences that start together are cut to the widest: a group stops before a sentence that would make padding
    more than half its positions, and that sentence starts later, alone (60 short lines beside one of 3,000 pieces
    had taken 19 GB); translations are those of each sentence alone."""
    from minitf.decode import _Waiting
    widths = np.array([3, 3, 4, 4, 40, 41])
    w = _Waiting(np.zeros((6, 41), dtype=np.int64), widths, capacity=10)
    first, src = w.admit(0)
    assert first.tolist() == [0, 1, 2, 3] and src.shape == (4, 4)
    second, src = w.admit(0)
    assert second.tolist() == [4, 5] and src.shape == (2, 41)
    model, _ = model_and_src()
    short, long = [5, 6, 7, 3], [5, 6, 7, 8, 9] * 12 + [3]
    from minitf.translate import translate_ids
    mixed = translate_ids(model, [short] * 6 + [long], 2, max_len_b=4, threads=1)
    assert mixed == translate_ids(model, [short] * 6, 2, max_len_b=4, threads=1) + translate_ids(
        model, [long], 2, max_len_b=4, threads=1)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_each_group_s_cache_is_as_long_as_its_own_sentences_may_go(search, monkeypatch):
    """One long line among short ones had sized every group's step cache (and beam search's per-row arrays) by its
    own length limit: a file of 1,000 short lines and one of 8,000 pieces took 2.7 GB where each alone took ~0.1 GB.
    Each group's cache now has room for its own sentences' limits; the results are those of each sentence alone."""
    from minitf import incremental
    from minitf.decode import _max_lengths
    model, _ = model_and_src()
    short, long = [5, 6, 7, 3, 0, 0], [5, 6, 7, 8, 9, 3]
    src = np.array([short] * 5 + [long] + [short] * 3)
    lengths = []
    real = incremental.StepCache

    def recorded(layers, memory, rows, max_steps):
        lengths.append((memory.shape[1], max_steps))     # (the group's source width: 6 with the long one, else 4)
        return real(layers, memory, rows, max_steps)
    monkeypatch.setattr(incremental, "StepCache", recorded)
    kw = dict(max_len_a=3.0, max_len_b=2, batch_size=4)   # limits: 4 * 3 + 2 = 14 short, 6 * 3 + 2 = 20 long
    got = greedy_search(model, src, **kw) if search == "greedy" else beam_search(model, src, 3, **kw)
    limits = _max_lengths(model, np.array([4, 6]), 3.0, 2)
    assert lengths[0] == (4, limits[0] + 1)                          # the first four, short: not the long one's room
    assert sorted(set(lengths)) == [(4, limits[0] + 1), (6, limits[1] + 1)]
    monkeypatch.setattr(incremental, "StepCache", real)
    alone = [(greedy_search(model, row[None], **kw) if search == "greedy" else beam_search(model, row[None], 3, **kw))[0]
             for row in src]
    assert got == alone


def test_searches_side_by_side_give_back_the_callers_blas_threads():
    """Each search thread asks for one BLAS thread; the OpenBLAS NumPy ships applies that to the whole process, so the
    caller's count is set back once, after the threads (threads that each put back what they found raced: training
    after a validation then went on with 1 or 2 BLAS threads by chance, and its sums rounded differently)."""
    from minitf import backend
    from minitf.translate import translate_ids
    fn = backend._openblas_local_threads()
    if fn is None:                         # not OpenBLAS: one search at a time, nothing set
        assert not backend.can_limit_blas_threads()
        return
    model, _ = model_and_src()
    before = fn(3)
    try:
        for _ in range(30):
            translate_ids(model, [[5, 6, 7, 3]] * 8, 2, max_len_b=4, threads=2)
            assert fn(3) == 3
    finally:
        fn(before)


@pytest.mark.parametrize("other", ["score", "translate"])
def test_two_threads_sharing_a_model_translate_and_score_as_alone_and_give_back_its_mode_and_blas_threads(other):
    """Two threads using one model at once (a Translator shared by a server's threads): each call has the model to
    itself (its decode_lock), in eval mode, and the caller's training mode and BLAS thread count come back after both
    (a translation that ended while the other thread scored had switched dropout on under it, and the scoring then
    left the model in eval mode; their BLAS blocks had put back each other's count, leaving the process on 1 BLAS
    thread). The progress callbacks make the calls overlap that way on every run: the first's first step starts the
    second and waits (up to 1 s: with the lock the second cannot start) until the second is searching, which then
    waits until the first has returned."""
    import threading
    from minitf import backend
    from minitf.translate import score_ids, translate_ids
    model, _ = model_and_src()
    rng = np.random.default_rng(3)
    src = [list(rng.integers(4, 13, rng.integers(1, 8))) + [3] for _ in range(40)]
    tgt = [list(rng.integers(4, 13, rng.integers(1, 6))) for _ in range(40)]
    inside, first_done = threading.Event(), threading.Event()

    class Second:
        def update(self, n):
            inside.set()
            first_done.wait(10)
    calls = {"score": lambda progress=None: score_ids(model, src, tgt, batch_size=4, progress=progress),
             "translate": lambda progress=None: translate_ids(model, src[::-1], 2, max_len_b=5, threads=2,
                                                              progress=progress)}
    want_t, want_o = translate_ids(model, src, 2, max_len_b=5, threads=2), calls[other]()
    fn = backend._openblas_local_threads()
    before = fn(3) if fn is not None else None
    got, started = {}, threading.Lock()
    second = threading.Thread(target=lambda: got.update(o=calls[other](Second())))

    class First:
        def update(self, n):
            if started.acquire(blocking=False):
                second.start()
                inside.wait(1.0)
    try:
        model.train()
        got["t"] = translate_ids(model, src, 2, max_len_b=5, threads=2, progress=First())
        first_done.set()
        second.join()
        assert got["t"] == want_t and got["o"] == want_o
        assert model.training                               # the caller's mode, given back
        if fn is not None:
            assert fn(3) == 3                               # the caller's BLAS threads, given back
    finally:
        first_done.set()
        if fn is not None:
            fn(before)


def test_a_backward_after_a_translation_says_its_forward_is_gone():
    # forward_loss, a translation, then backward had run on the decoding's caches: a shape error, gradients half added
    from minitf.translate import translate_ids
    model, _ = model_and_src()
    src = np.array([[5, 6, 7, 3], [8, 9, 3, 0]])
    tgt_in, tgt_out = np.array([[2, 5, 6], [2, 7, 0]]), np.array([[5, 6, 3], [7, 3, 0]])
    model.train()
    model.forward_loss(src, tgt_in, tgt_out)
    translate_ids(model, [[5, 6, 7, 3], [8, 3], [9, 10, 11, 12, 3]], 2, max_len_b=4)
    grads = model.flat_grads.copy()
    with pytest.raises(RuntimeError, match="a translation or scoring call in between takes the layers' caches"):
        model.backward()
    assert np.array_equal(model.flat_grads, grads) and model.training


@pytest.mark.parametrize("v,k", [(640, 4), (13, 4), (148, 2), (96, 3), (8000, 4), (4, 4)])
def test_top_candidates_equal_a_full_sort(v, k):
    rng = np.random.default_rng(v + k)
    n = 5
    logits = rng.standard_normal((n * k, v))
    logits[:, 1] = -np.inf                                    # a banned token
    offset = rng.standard_normal(n * k) - 3.0
    offset[1::k] = -np.inf                                    # dead beams
    n_best = min(2 * k, k * v)
    values, beam, tok = top_candidates(logits, offset, k, n_best)
    cand = (offset[:, None] + logits).reshape(n, k * v)
    want = np.sort(cand, axis=1)[:, ::-1][:, :n_best]
    np.testing.assert_array_equal(values, want)
    np.testing.assert_array_equal(cand[np.arange(n)[:, None], beam * v + tok], values)   # they are those candidates
    finite = np.isfinite(values)
    flat = (beam * v + tok)[finite]
    assert len(set(zip(np.nonzero(finite)[0], flat))) == finite.sum()                # no candidate twice


def test_wide_beam_finds_the_best_sequence_under_the_length_penalty():
    # vocabulary: pad 0, unk 1, bos 2, eos 3, and 4, 5 -> outputs from {1, 4, 5}, length 1..3
    model, _ = model_and_src(vocab=6, seed=11)
    model.eval()
    src = np.array([[4, 5, 4, 3]])
    alpha, max_len = 0.6, 3
    best, best_score = None, -np.inf
    for n in range(1, max_len + 1):   # no empty output: EOS is not allowed first
        for seq in itertools.product([1, 4, 5], repeat=n):
            tgt_in = np.array([[2, *seq]])
            logp = log_softmax(model.forward(src, tgt_in))[0]
            total = sum(logp[i, tok] for i, tok in enumerate(list(seq) + [3]))
            score = total / length_penalty(n + 1, alpha)
            if score > best_score:
                best, best_score = list(seq), score
    found = beam_search(model, src, beam_size=40, alpha=alpha, max_len_a=0.0, max_len_b=max_len)[0]
    assert found == best, (found, best, best_score)


def test_length_penalty_formula():
    assert length_penalty(1, 0.6) == 1.0
    assert np.isclose(length_penalty(7, 0.6), 2.0 ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


def test_max_length_is_input_plus_b():
    model, src = model_and_src(seed=2)
    for hyp, row in zip(greedy_search(model, src, max_len_b=2), src):
        assert len(hyp) <= (row != 0).sum() + 2


def test_no_empty_translations():
    # EOS is made the most likely first token: the search must still emit at least one token
    model, src = model_and_src(seed=6)
    model.eval()
    model.embedding.params["weight"][3] = 5.0 * model.embedding.params["weight"][3] / np.linalg.norm(
        model.embedding.params["weight"][3]) + 3.0
    for out in (greedy_search(model, src, max_len_b=8), beam_search(model, src, beam_size=4, max_len_b=8)):
        assert all(len(hyp) >= 1 for hyp in out)


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_decoding_gives_the_model_back_in_the_callers_mode(search):
    model, src = model_and_src()
    model.train()
    search(model, src)
    assert model.training            # a loop that translates between training steps keeps its dropout
    model.eval()
    search(model, src)
    assert not model.training


def test_a_source_longer_than_the_sinusoid_table_is_translated_whole():
    cfg = dict(vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_layers=2, dropout=0.0)
    short = minitf.Transformer(minitf.Config(max_len=8, **cfg), dtype="float64", seed=3)
    long = minitf.Transformer(minitf.Config(max_len=256, **cfg), dtype="float64", seed=3)
    src = np.array([[4 + i % 9 for i in range(20)] + [3]])                  # 21 positions > 8
    want = greedy_search(long, src, max_len_b=5)
    assert greedy_search(short, src, max_len_b=5) == want                   # the table grew, nothing was cut
    assert beam_search(short, src, max_len_b=5) == beam_search(long, src, max_len_b=5)


def test_learned_positions_name_their_limit():
    from minitf.errors import ConfigError
    cfg = minitf.Config(vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_layers=1, max_len=8,
                                   positional="learned")
    model = minitf.Transformer(cfg, dtype="float64")
    with pytest.raises(ConfigError, match="learned positions cover max_len 8"):
        greedy_search(model, np.array([[5] * 12 + [3]]))


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_positions_per_row_for_rows_at_different_steps(positional):
    # continuous batching feeds rows at different positions: row b gets position offset[b]
    from minitf.errors import ConfigError
    cfg = minitf.Config(vocab_size=13, d_model=8, n_heads=2, d_ff=8, n_layers=1, max_len=8,
                                   positional=positional)
    pos = minitf.Transformer(cfg, dtype="float64").positional
    x = np.random.default_rng(0).standard_normal((3, 1, 8))
    per_row = pos.forward(x, offset=np.array([0, 5, 2]))
    for b, t in enumerate([0, 5, 2]):
        np.testing.assert_array_equal(per_row[b], pos.forward(x[b: b + 1], offset=t)[0])
    if positional == "learned":
        with pytest.raises(ConfigError, match="learned positions cover 8 positions"):
            pos.forward(x, offset=np.array([0, 8, 2]))


@pytest.mark.parametrize("beam,nbest,stop", [(1, None, "fairseq"), (1, 1, "fairseq"), (3, None, "fairseq"),
                                             (3, 2, "fairseq"), (3, 2, "bound"), (3, None, "ctranslate2")])
def test_done_hears_each_sentence_once_as_it_finishes_with_what_the_search_returns(beam, nbest, stop):
    # done(i, result) keeps a long translation's finished lines (minitf translate --output): called once a sentence,
    # with the result the search returns for it, before the search's end (a sentence that finishes early is heard
    # while others still decode), and on more sentences than fit in one batch (continuous batching)
    from minitf.translate import translate_ids
    model, _ = model_and_src(seed=5)
    rng = np.random.default_rng(1)
    ids = [list(rng.integers(4, 13, rng.integers(1, 9))) + [3] for _ in range(30)]
    heard, steps = [], []
    done = lambda i, result: heard.append((i, result, len(steps)))   # noqa: E731

    class Steps:
        def update(self, n):
            steps.append(n)

    out = translate_ids(model, ids, beam, max_len_b=5, batch_size=4, threads=2, nbest=nbest, stop=stop,
                        done=done, progress=Steps())
    assert sorted(i for i, _, _ in heard) == list(range(len(ids)))
    assert all(out[i] == result for i, result, _ in heard)
    assert min(at for _, _, at in heard) < len(steps) - 1   # heard as they finish, not all at the end


def test_an_error_in_one_search_thread_stops_the_others():
    # done raising in one thread (a full disk where translate --output keeps its lines, Ctrl-C): the other threads
    # stop at their next finished sentence, instead of decoding their whole share first
    from minitf.translate import translate_ids
    model, _ = model_and_src(seed=5)
    rng = np.random.default_rng(2)
    ids = [list(rng.integers(4, 13, rng.integers(1, 9))) + [3] for _ in range(200)]
    second = set(np.argsort([len(s) for s in ids], kind="stable")[1::2].tolist())   # the second thread's sentences
    calls, raised = [], []

    def done(i, result):
        calls.append(i)
        if i in second and not raised:
            raised.append(len(calls))
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        translate_ids(model, ids, 2, max_len_b=5, batch_size=4, threads=2, done=done)
    assert len(calls) - raised[0] <= 8, (len(calls), raised)   # the first thread's whole share: ~95 more
