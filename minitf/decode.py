"""Greedy and beam search (paper 6.1: beam 4, length penalty alpha 0.6, max length input + 50).

Decoding is incremental: the searches step through `model.incremental_decoder(src, ...)`, an
object with the three methods of `StepDecoder` below. The Transformer's keeps KV caches
(incremental.py); the recurrent model's keeps its LSTM states (rnn.py). The searches know
nothing else of the model.
Both searches are batched over many sentences; a finished sentence leaves the batch, and
waiting ones take its place (continuous batching: `_Waiting`, `_admit`). The beams of a sentence
share its encoder output: they are the queries of one attention. Several searches side by side
in threads (`translate_ids`) live with the text in and out, in translate.py.
"""
import contextlib
import functools
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from .backend import is_gpu, to_device, to_numpy, to_numpy_all, xp_of
from .errors import ConfigError
from .functional import as_float32_if_half


class StepDecoder(Protocol):
    """What a model's `incremental_decoder(src, max_steps, use_cache=True, beam=1)` returns (the recurrent
    model's ignores max_steps and use_cache): the decoder
    state of sentences x rows, sentence-major (a sentence has one row until its first reorder, then
    one a beam). Both architectures implement it (incremental.IncrementalDecoder,
    rnn.RecurrentDecoder)."""

    def logits(self, tokens):
        """Feed one token per row ([rows] ids; check_step_rows); the logits of each row's next position."""

    def reorder(self, rows):
        """Keep these rows, in this order (beams taking new parents, finished sentences leaving)."""

    def admit(self, src, max_steps=None):
        """Start the sentences of src [n, S] while others are mid-way (one row each, appended); max_steps: the
        positions they may take (their cache's length; default the decoder's)."""


ADMIT_WHEN_FREE = 0.5    # continuous batching: waiting sentences start once this share of places is free


def check_step_rows(tokens, rows):
    """A decoding step takes one token per row (both decoders' rule)."""
    if len(tokens) != rows:
        raise ValueError(f"{len(tokens)} tokens for {rows} rows: one token a row (a sentence has one row "
                         "until its first reorder, then one a beam)")


def length_penalty(length, alpha):
    """GNMT (Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6) ^ alpha; |Y| counts the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def restores_mode(search):
    """Decode in eval mode (no dropout), then give the model back in the caller's mode: a loop that
    translates between training steps keeps training with dropout. No lock: translate_ids' searches run
    side by side in threads, inside the call that holds it (decodes)."""
    return _in_decoding(search, lock=False)


def decodes(call):
    """call(model, ...) inside decoding(model): translate_ids' and score_ids' way in."""
    return _in_decoding(call, lock=True)


def _in_decoding(call, lock):
    @functools.wraps(call)
    def wrapper(model, *args, **kwargs):
        with decoding(model, lock):
            return call(model, *args, **kwargs)
    return wrapper


@contextlib.contextmanager
def decoding(model, lock=True):
    """One decoding or scoring call of the model at a time (with `lock`: translate.translate_ids, score_ids; another
    thread's waits for the model's decode_lock), in eval mode, the caller's mode given back at the end: two threads
    that shared a model had switched its mode under each other (dropout on while scoring; training mode lost). A
    decoding forward overwrites the layers' caches, so the last forward_loss's backward can no longer run, and says so
    (seq2seq.BACKWARD_NEEDS) rather than failing on the caches of another batch."""
    with (getattr(model, "decode_lock", None) if lock else None) or contextlib.nullcontext():
        was_training = model.training
        model._cache = model._head = None
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)


def _host_and_device_src(model, src):
    """(src on the device, its non-pad lengths [B] on the host): checked and measured on the host,
    so a search reads nothing back from the GPU but one copy per step (two in greedy search with
    scores=True)."""
    host = model.check_ids("src", src, host=True)
    if 0 in host.shape:
        raise ConfigError(f"src {host.shape}: no sentence to decode (a source is its pieces and EOS, at least one id)")
    return to_device(host, model.xp), (host != model.cfg.pad_id).sum(axis=1)


def _max_lengths(model, src_len, max_len_a, max_len_b):
    lengths = (max_len_a * src_len + max_len_b).astype(int)
    # learned positions end at max_len; sinusoidal ones extend to any length (layers/positional.py)
    return np.minimum(lengths, model.cfg.max_len - 1) if model.cfg.positional == "learned" else lengths


class _Waiting:
    """Continuous batching: the sentences of src [B, S] not started yet, in order. At most
    `capacity` are decoded at once; the waiting ones start (`admit`) once ADMIT_WHEN_FREE
    of the places are free, so a batch never runs on for a few long sentences. The sentences that
    start together are cut to the widest of them, so a group stops before a sentence that would make
    padding more than half of its positions (one long line among short ones waits and starts on its
    own: it had made every sentence of its group as wide, ~60 short lines beside a 3,000-piece one took
    19 GB and 20x the time). Each group's step cache has room for its own sentences' length limits (_admit),
    not the longest line's."""

    def __init__(self, src, widths, capacity):
        self.src, self.widths, self.next = src, widths, 0
        self.capacity = min(capacity or src.shape[0], src.shape[0])

    def admit(self, n_alive):
        """The sentence ids to start now (none if too few places are free), and their src."""
        free = self.capacity - n_alive
        if self.next >= self.src.shape[0] or (free < max(1, int(self.capacity * ADMIT_WHEN_FREE)) and n_alive):
            return np.arange(0), None
        new = np.arange(self.next, min(self.src.shape[0], self.next + free))
        widths = self.widths[new]
        padded = np.arange(1, len(new) + 1) * np.maximum.accumulate(widths)   # positions if cut after each
        new = new[: max(1, int(np.sum(np.cumprod(padded <= 2 * np.cumsum(widths)))))]
        self.next = int(new[-1]) + 1
        return new, self.src[xp_of(self.src).asarray(new), : int(self.widths[new].max())]   # cut to the widest


def _admit(waiting, dec, alive, steps, cohort, max_lens):
    """Continuous batching's admission, for both searches: the waiting sentences that start now join
    the decoder (`dec.admit`) as a new cohort at step 0, after the live ones, with room for the steps of their own
    length limits (max_lens [B]: one long line had sized every group's cache, and a file of short lines beside it
    took 20x the memory). Returns (how many started, alive, steps, cohort); the caller extends its own per-row
    arrays by that many."""
    new, new_src = waiting.admit(len(alive))
    if not len(new):
        return 0, alive, steps, cohort
    dec.admit(new_src, int(max_lens[new].max()) + 1)
    cohort = np.concatenate([cohort, np.full(len(new), cohort.max(initial=0) + 1)])
    return len(new), np.concatenate([alive, new]), np.concatenate([steps, np.zeros(len(new), dtype=np.int64)]), cohort


@restores_mode
def greedy_search(model, src, max_len_a=1.0, max_len_b=50, use_cache=True, batch_size=None, progress=None,
                  scores=False, done=None):
    """src [B, S] -> list of B token-id lists (no BOS, no EOS); the argmax at every step. At
    most `batch_size` sentences (default: all) at once, with continuous batching (_Waiting).
    scores=True: each sentence's [(tokens, logprobs)] instead, logprobs the log-probability
    of each token and of the EOS that ends it (at the length limit, the EOS's there).
    done(b, result): called as sentence b finishes, with what the list returns for it."""
    cfg, xp = model.cfg, model.xp
    src, src_len = _host_and_device_src(model, src)
    max_lens = _max_lengths(model, src_len, max_len_a, max_len_b)
    waiting = _Waiting(src, src_len, batch_size)
    alive, first = waiting.admit(0)
    dec = model.incremental_decoder(first, int(max_lens[alive].max()) + 1, use_cache)
    steps = np.zeros(len(alive), dtype=np.int64)   # [n] the step each sentence is at
    cohort = np.zeros(len(alive), dtype=np.int64)  # [n] which admission (decoder group) each came in
    out = [[] for _ in range(src.shape[0])]
    logp = [[] for _ in range(src.shape[0])] if scores else None
    tokens = np.full(len(alive), cfg.bos_id)
    while len(alive):
        logits = dec.logits(xp.asarray(tokens, dtype=src.dtype))   # argmax log p = argmax logits: no softmax
        lse = _logsumexp(as_float32_if_half(logits)) if scores else None
        _ban(logits, cfg, steps == 0)
        if scores:   # the argmax with its log p and the EOS's, in ONE copy (the EOS's ends a sentence at its limit)
            best = logits.argmax(axis=1)
            best, best_logp, eos_logp = to_numpy_all(best, logits[xp.arange(len(alive)), best] - lse,
                                                     logits[:, cfg.eos_id] - lse)
        else:
            best = to_numpy(logits.argmax(axis=1))
        ends = (best == cfg.eos_id) | (steps >= max_lens[alive])
        keep = _compact(~ends, cohort)   # EOS, or the length limit: done
        if scores:   # the chosen token's log p, or the EOS's where the sentence ends
            step_logp = np.where(ends, eos_logp, best_logp)
            for row, sent in enumerate(alive):
                logp[sent].append(float(step_logp[row]))
        for row in keep:
            out[alive[row]].append(int(best[row]))
        if done is not None:
            for sent in alive[ends]:
                done(int(sent), [(out[sent], logp[sent])] if scores else out[sent])
        if progress is not None and len(keep) < len(alive):
            progress.update(len(alive) - len(keep))
        dec.reorder(keep)
        alive, steps, tokens, cohort = alive[keep], steps[keep] + 1, best[keep], cohort[keep]
        n_new, alive, steps, cohort = _admit(waiting, dec, alive, steps, cohort, max_lens)
        if n_new:
            tokens = np.concatenate([tokens, np.full(n_new, cfg.bos_id)])
    return [[(o, p)] for o, p in zip(out, logp)] if scores else out


def _ban(logits, cfg, first):
    """Never emit padding or BOS; no EOS first (at least one token: fairseq's min_len 1).
    `first`: whether the rows are at their first step (a bool, or a host bool array [rows])."""
    logits[:, cfg.pad_id] = -np.inf
    logits[:, cfg.bos_id] = -np.inf
    if np.ndim(first):
        rows = np.flatnonzero(first)
        if len(rows):
            logits[xp_of(logits).asarray(rows), cfg.eos_id] = -np.inf
    elif first:
        logits[:, cfg.eos_id] = -np.inf


def _compact(keep, cohort):
    """The sentences to keep (keep [n] bool), as indices into the current ones, in their new
    order: within each cohort (sentences admitted together, consecutive: one decoder group),
    a kept sentence that is still inside its cohort's new length stays where it is and the
    last ones fill the places of those that finished. Shifting every later sentence down
    instead would make the decoder move their caches at nearly every step."""
    order = []
    for _, start, size in zip(*np.unique(cohort, return_index=True, return_counts=True)):
        kept = np.flatnonzero(keep[start: start + size])
        places = np.arange(len(kept))
        stay = kept < len(kept)
        places[np.setdiff1d(places, kept[stay])] = kept[~stay]   # holes, in order, get the last ones
        order.append(start + places)
    return np.concatenate(order) if order else np.arange(0)


def _stay_with_parents(parent):
    """parent [m, k]: the beam (0..k-1) each of a sentence's next k beams extends -> an order
    [m, k] of those beams that puts as many as possible in their parent's place (place j
    takes the first beam extending beam j, if any; the others fill the remaining places in
    rank order). A beam in its parent's place keeps its cached keys/values where they are;
    the others are copied (IncrementalDecoder.reorder). Which place a beam has changes no
    score: beams are ranked by score, not by place."""
    m, k = parent.shape
    order = np.full((m, k), -1)
    used = np.zeros((m, k), dtype=bool)
    for j in range(k):
        extend_j = (parent == j) & ~used
        first = np.argmax(extend_j, axis=1)                        # the first unused beam extending j
        found = np.flatnonzero(extend_j[np.arange(m), first])
        order[found, j] = first[found]
        used[found, first[found]] = True
    places = np.argsort(order >= 0, axis=1, kind="stable")         # free places first, in order
    rest = np.argsort(used, axis=1, kind="stable")                 # unused beams first, in rank order
    free = np.arange(k) < (~used).sum(axis=1, keepdims=True)
    rows = np.nonzero(free)[0]
    order[rows, places[free]] = rest[free]
    return order


def _group_size(v):
    """Tokens per group in `top_candidates`: the largest divisor of V in [32, 128], else V."""
    return next((w for w in range(128, 31, -1) if v % w == 0), v)


def _largest(x, n):
    """The columns of the n largest values of each row of x [rows, m] (n < m), in no particular order: NumPy's
    argpartition; on a GPU a sort (CuPy 14's argpartition reads its indices back on the host twice, in
    cupy.unravel_index: two synchronisations a call)."""
    xp = xp_of(x)
    if is_gpu(xp):
        return xp.argsort(-x, axis=1)[:, :n]
    return xp.argpartition(-x, n - 1, axis=1)[:, :n]


def _top_on_device(logits, offset, k, n_best):
    """The n_best best (beam, token) continuations of each sentence, best first, on the device.

    logits [n * k, V]: the rows of n sentences x k beams, sentence-major; offset [n * k]; a
    continuation's score is offset[row] + logits[row, token]. Returns (values, cand), each
    [n, n_best], cand = beam * V + token.

    Plain equivalent: cand = (offset[:, None] + logits).reshape(n, k * V), then the n_best
    largest of each row of cand, sorted. Ranking all k * V candidates is the costly part,
    so it runs on group maxima instead: a row's V tokens are split into g groups of w
    (token i * g + j is the i-th of group j: the maxima are then an elementwise maximum of
    w rows of g, a fast pass); every one of the n_best best candidates lies in one of the
    n_best groups with the largest maxima (were its group not among them, n_best groups
    would each hold a better candidate). Only those n_best * w values are ranked.
    """
    xp = xp_of(logits)
    rows, v = logits.shape
    n = rows // k
    w = _group_size(v)
    g = v // w
    grouped = logits.reshape(rows, w, g)                                        # [n * k, w, g]
    group_max = grouped.max(axis=1) + offset[:, None]                           # [n * k, g]
    group_max = group_max.reshape(n, k * g)
    if n_best < k * g:
        chosen = _largest(group_max, n_best)                                    # [n, n_best]: beam * g + group
    else:
        chosen = xp.broadcast_to(xp.arange(k * g), (n, k * g))
    row = xp.arange(n)[:, None] * k + chosen // g                               # [n, n_best]
    vals = grouped[row, :, chosen % g] + offset[row][..., None]                  # [n, n_best, w]
    vals = vals.reshape(n, -1)
    part = _largest(vals, n_best) if n_best < vals.shape[1] else xp.broadcast_to(xp.arange(vals.shape[1]), vals.shape)
    part = xp.take_along_axis(part, xp.argsort(-xp.take_along_axis(vals, part, axis=1), axis=1), axis=1)
    return _candidates(xp.take_along_axis(vals, part, axis=1), xp.take_along_axis(chosen, part // w, axis=1), part,
                       w, g, v)


def _candidates(values, chosen, part, w, g, v):
    """values [n, n_best] best first; chosen: the beam * g + group of each, part: its place in the
    group's w values -> (values, cand), cand = beam * V + token with token = i * g + group. Still on
    the device: the caller copies everything a step needs to the host at once (to_numpy_all)."""
    return values, (chosen // g) * v + (part % w) * g + chosen % g


def top_candidates(logits, offset, k, n_best):
    """The n_best best (beam, token) continuations of each sentence, best first: host arrays
    (values, beams, tokens), each [n, n_best]. See _top_on_device."""
    values, cand = to_numpy_all(*_top_on_device(logits, offset, k, n_best))
    v = logits.shape[1]
    return values, cand // v, cand % v


@restores_mode
def beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50, use_cache=True, batch_size=None,
                progress=None, stop="fairseq", nbest=None, done=None):
    """src [B, S] -> list of B token-id lists: the best finished hypothesis of each sentence
    by score / length_penalty. Each step ranks the 2k best continuations of a sentence
    (k = beam_size; a continuation: a live beam plus one token); an EOS among the k best
    finishes its hypothesis while fewer than k have finished (a weak early EOS must not fill
    the finished list and stop the search: fairseq's rule), and the first k others are the
    next beams. A sentence stops when k hypotheses have finished, or at its maximum length,
    where every live beam ends (EOS forced). tests/plain_beam.py is the same search written
    plainly, one sentence and one candidate at a time.

    stop="bound" ends a sentence when no live beam can still beat the best
    finished hypothesis (its score can only fall and its length penalty is at most
    lp(max length + 1), |Y| counting the EOS: tensor2tensor's "terminate early when possible"), and every EOS among
    the 2k best may finish (not only the k best, not only k of them).

    stop="ctranslate2" is CTranslate2's rule with its length penalty at 0 (docs/interop.md): every
    EOS among the k best finishes (not only k of them), and a sentence ends at the first step
    whose best candidate is an EOS (with alpha 0 no live beam can beat it then). A model exported
    there searches the same way.

    With nbest=n and stop "ctranslate2" or "bound", the search goes on past the step its rule ends a sentence at
    until n hypotheses have finished (or the length limit), so the n-best list is n long; the hypotheses finished
    after that step rank below those finished before it, so its first is the search's one best whatever alpha.

    At most `batch_size` sentences (default: all) are decoded at once, in the order given;
    as they finish, the next ones take their places (continuous batching, _Waiting).
    `progress.update(n)` is called as sentences finish, and done(b, result) (when given) as sentence b
    finishes, with what the list returns for it.

    nbest=n: each sentence's n best finished hypotheses instead, best first, as (tokens,
    logprobs): logprobs the log-probability of each token and of the EOS (their sum over
    length_penalty is the search's score).
    """
    cfg = model.cfg
    src, src_len = _host_and_device_src(model, src)
    k = beam_size
    max_lens = _max_lengths(model, src_len, max_len_a, max_len_b)
    waiting = _Waiting(src, src_len, batch_size)
    alive, first = waiting.admit(0)               # sentences being decoded, in row order
    width = int(max_lens[alive].max()) + 1        # the positions the live sentences may take (their own limits)
    dec = model.incremental_decoder(first, width, use_cache, beam=k)
    steps, cohort = np.zeros(len(alive), dtype=np.int64), np.zeros(len(alive), dtype=np.int64)
    beams = _Beams(alive, steps, cohort, *_new_rows(len(alive), k, width, nbest, cfg.bos_id))
    found = _Found.none(src.shape[0], nbest)
    while len(beams.alive):
        values, beam, tok, at_limit = _rank(model, dec, beams, k, max_lens, src.dtype)   # [n, 2k], best first
        finite, is_eos = np.isfinite(values), tok == cfg.eos_id
        _finish(found, beams, values, beam, is_eos & finite, k, stop, alpha)
        # the next beams: the first k continuations that are not EOS, in rank order
        cont = ~is_eos & finite
        pick = np.argsort(~cont, axis=1, kind="stable")[:, :k]               # continuations first
        live = np.take_along_axis(cont, pick, axis=1)                          # False: a dead (-inf) slot
        going = _going(found, beams, values, pick, is_eos & finite, k, stop, alpha, max_lens)
        still = _compact(going & ~at_limit & live[:, 0], beams.cohort)
        ended = np.delete(beams.alive, still)
        if done is not None:
            for sent in ended:
                done(int(sent), found.result(sent))
        if progress is not None and len(ended):
            progress.update(len(ended))
        beams = _advance(beams, dec, still, pick, live, beam, tok, values, k)
        beams = _admit_beams(beams, waiting, dec, max_lens, k, cfg.bos_id)   # free places to new ones
    return [found.result(sent) for sent in range(src.shape[0])]


@dataclass
class _Beams:
    """beam_search's live sentences between two steps, in row order (those admitted last come last), k beams each.
    The decoder has k rows for a sentence past its first step and one for a sentence at it (its k beams would all
    be BOS): `n_old` sentences of k rows, then the new ones."""
    alive: np.ndarray                # [n] the sentences' numbers in the input
    steps: np.ndarray                # [n] the step each is at
    cohort: np.ndarray               # [n] which admission (decoder group) each came in
    hyps: np.ndarray                 # [n * k, T_max] the tokens of every beam
    scores: np.ndarray               # [n, k] their log-probabilities
    paths: Optional[np.ndarray]      # nbest: [n * k, T_max] the score after each token
    next_tokens: np.ndarray          # [rows] what the decoder reads next: k a sentence, one a new sentence

    @property
    def n_old(self):
        return len(self.alive) - int(np.count_nonzero(self.steps == 0))


def _new_rows(n, k, width, nbest, bos_id):
    """_Beams's hyps, scores, paths and next_tokens for n sentences at their first step."""
    return (np.zeros((n * k, width), dtype=np.int64), _first_scores(n, k),
            np.zeros((n * k, width)) if nbest else None, np.full(n, bos_id))


@dataclass
class _Found:
    """The finished hypotheses of each sentence of the input [B]."""
    n_done: np.ndarray               # [B] how many have finished
    best: list                       # [B] the best one's tokens (score / length penalty)
    best_score: np.ndarray           # [B] its score
    finished: Optional[list]         # nbest: [B] [(after the rule's end, score, tokens, logprobs)]
    ruled: np.ndarray                # [B] nbest: the sentence's stop rule has ended it
    nbest: Optional[int]

    @classmethod
    def none(cls, b, nbest):
        return cls(np.zeros(b, dtype=int), [[] for _ in range(b)], np.full(b, -np.inf),
                   [[] for _ in range(b)] if nbest else None, np.zeros(b, dtype=bool), nbest)

    def result(self, sent):
        """What beam_search returns for the sentence: its best tokens, or its n-best list."""
        return _nbest_list(self.finished[sent], self.nbest) if self.nbest else self.best[sent]


def _rank(model, dec, beams, k, max_lens, dtype):
    """One step of the decoder for every live row, and each sentence's 2k best continuations (a live beam plus one
    token), best first: (values, beam, tok) [n, 2k] and at_limit [n]. A sentence at its maximum length ends every
    beam with EOS instead, in beam order."""
    cfg = model.cfg
    logits = as_float32_if_half(dec.logits(model.xp.asarray(beams.next_tokens, dtype=dtype)))   # [rows, V]
    n_old, v = beams.n_old, logits.shape[1]
    lse = _logsumexp(logits)                                              # log p = logits - lse
    _ban(logits, cfg, np.arange(logits.shape[0]) >= n_old * k)
    row_scores = np.concatenate([beams.scores[:n_old].reshape(-1), beams.scores[n_old:, 0]])
    offset = model.xp.asarray(row_scores, dtype=logits.dtype) - lse       # [rows]: score + log p - logits
    n_best = min(2 * k, k * v)
    at_limit = beams.steps >= max_lens[beams.alive]
    eos = (offset + logits[:, cfg.eos_id],) if at_limit.any() else ()      # the scores of ending now
    values, beam, tok, eos = _top_candidates(logits, offset, k, n_best, n_old, eos)
    if at_limit.any():   # the length limit: every beam ends with EOS, in beam order
        ends = _per_beam(eos[0], k, n_old)
        values[at_limit] = -np.inf
        values[at_limit, :k] = ends[at_limit]
        beam[at_limit], tok[at_limit] = np.arange(n_best) % k, cfg.eos_id
    return values, beam, tok, at_limit


def _finish(found, beams, values, beam, eos, k, stop, alpha):
    """The hypotheses this step finishes (eos [n, 2k]: the finite EOS candidates): an EOS among the k best (the 2k
    best, any number, with stop="bound") while fewer than k have finished (any number, but with stop="fairseq");
    looped in rank order (rare)."""
    n_best = values.shape[1]
    ranked = np.arange(n_best) < (n_best if stop == "bound" else k)
    for i, r in zip(*np.nonzero(eos & ranked)):
        sent, row, length = beams.alive[i], i * k + beam[i, r], beams.steps[i]
        if found.n_done[sent] < k or stop != "fairseq":
            found.n_done[sent] += 1
            s = values[i, r] / length_penalty(length + 1, alpha)
            if s > found.best_score[sent]:
                found.best_score[sent], found.best[sent] = s, beams.hyps[row, :length].tolist()
            if found.nbest:
                path = np.concatenate([[0.0], beams.paths[row, :length], [values[i, r]]])
                found.finished[sent].append((bool(found.ruled[sent]), s, beams.hyps[row, :length].tolist(),
                                             np.diff(path).tolist()))


def _going(found, beams, values, pick, eos, k, stop, alpha, max_lens):
    """[n] whether each sentence's search goes on by its stop rule (pick [n, k]: its next beams' candidates)."""
    alive = beams.alive
    going = found.n_done[alive] < k
    if stop == "bound":   # a live beam could still beat the best finished hypothesis
        best_live = np.take_along_axis(values, pick[:, :1], axis=1)[:, 0]
        going = best_live / length_penalty(max_lens[alive] + 1, alpha) > found.best_score[alive]
    elif stop == "ctranslate2":   # until the best candidate of a step is an EOS
        going = ~eos[:, 0]
    if found.nbest and stop != "fairseq":   # ... and n-best's n have finished: those after the rule's end rank below
        found.ruled[alive[~going]] = True
        going |= found.n_done[alive] < found.nbest
    return going


def _advance(beams, dec, still, pick, live, beam, tok, values, k):
    """The next step's beams of the sentences kept (still: their rows, in their new order): each one's candidates
    `pick` [n, k] (`live` False: a dead slot), each beam in its parent's place where it can be; the decoder's rows
    follow them (dec.reorder)."""
    n, n_old = len(beams.alive), beams.n_old
    pick, live = pick[still], live[still]
    pick = np.where(live, pick, pick[:, :1])        # a dead slot repeats the first beam, score -inf
    new_beam = np.take_along_axis(beam[still], pick, axis=1)
    order = _stay_with_parents(new_beam)             # the beams' order is free: fewer cache rows to move
    pick, live, new_beam = (np.take_along_axis(a, order, axis=1) for a in (pick, live, new_beam))
    parents = (still[:, None] * k + new_beam).reshape(-1)                  # the beam each new beam extends
    next_tokens = np.take_along_axis(tok[still], pick, axis=1).reshape(-1)
    at = (np.arange(len(parents)), np.repeat(beams.steps[still], k))        # each new beam's token's place
    hyps = beams.hyps[parents]
    hyps[at] = next_tokens
    scores = np.where(live, np.take_along_axis(values[still], pick, axis=1), -np.inf)
    paths = None
    if beams.paths is not None:
        paths = beams.paths[parents]
        paths[at] = scores.reshape(-1)
    first_row = np.where(np.arange(n) < n_old, np.arange(n) * k, n_old * (k - 1) + np.arange(n))
    dec.reorder((first_row[still][:, None] + new_beam).reshape(-1))        # ... and its decoder row
    return _Beams(beams.alive[still], beams.steps[still] + 1, beams.cohort[still], hyps, scores, paths, next_tokens)


def _admit_beams(beams, waiting, dec, max_lens, k, bos_id):
    """Waiting sentences take free places (_admit), one row each; the per-row arrays' width becomes the live
    sentences' longest limit."""
    n_new, alive, steps, cohort = _admit(waiting, dec, beams.alive, beams.steps, beams.cohort, max_lens)
    width = int(max_lens[alive].max()) + 1 if len(alive) else 0
    hyps, scores, paths, next_tokens = (_width(beams.hyps, width), beams.scores,
                                        None if beams.paths is None else _width(beams.paths, width), beams.next_tokens)
    if n_new:
        new = _new_rows(n_new, k, width, paths is not None, bos_id)
        hyps, paths, next_tokens = (np.concatenate([hyps, new[0]]), None if paths is None else np.concatenate(
            [paths, new[2]]), np.concatenate([next_tokens, new[3]]))
        scores = np.concatenate([scores, new[1]]).astype(scores.dtype)
    return _Beams(alive, steps, cohort, hyps, scores, paths, next_tokens)


def _nbest_list(finished, n):
    """A sentence's n best finished hypotheses as (tokens, logprobs), best first: those finished before its rule ended
    the sentence, then those after (finished: [(after the rule's end, score, tokens, logprobs)])."""
    return [(tokens, logprobs) for _, _, tokens, logprobs in sorted(finished, key=lambda h: (h[0], -h[1]))[:n]]


def _width(a, columns):
    """a [rows, *] with `columns` columns: cut (the live rows' tokens all lie before it) or padded with zeros."""
    if a.shape[1] >= columns:
        return a[:, :columns]
    return np.pad(a, ((0, 0), (0, columns - a.shape[1])))


def _top_candidates(logits, offset, k, n_best, n_old, extra=()):
    """top_candidates for rows of n_old sentences with k rows each, then sentences with one
    row each (at their first step); those rank only V candidates (padded with -inf). The
    host copies of the device arrays `extra` come back with them, all in ONE copy (the step's
    only synchronisation on a GPU): (values, beams, tokens, [extra on the host])."""
    old, v = n_old * k, logits.shape[1]
    m = min(n_best, v)
    device = [_top_on_device(logits[:old], offset[:old], k, n_best)] if n_old else []
    if logits.shape[0] > old:
        device.append(_top_on_device(logits[old:], offset[old:], 1, m))
    host = to_numpy_all(*[a for pair in device for a in pair], *extra)
    parts = []
    for i, (values, cand) in enumerate(zip(host[0: 2 * len(device): 2], host[1: 2 * len(device): 2])):
        if values.shape[1] < n_best:   # one-row sentences: m candidates, padded
            pad = ((0, 0), (0, n_best - m))
            values, cand = np.pad(values, pad, constant_values=-np.inf), np.pad(cand, pad)
        parts.append((values, cand // v, cand % v))
    return (*(np.concatenate(a) if len(parts) > 1 else a[0] for a in zip(*parts)), host[2 * len(device):])


def _per_beam(x, k, n_old):
    """x [rows] (k rows a sentence for the first n_old sentences, then one) -> [n, k], -inf
    for the beams a one-row sentence does not have yet."""
    old = n_old * k
    out = np.full((n_old + len(x) - old, k), -np.inf, dtype=x.dtype)
    out[:n_old] = x[:old].reshape(n_old, k)
    out[n_old:, 0] = x[old:]
    return out


def _first_scores(n, k):
    """[n, k] the beams of a new sentence: only one is live at first (all k would be BOS)."""
    scores = np.full((n, k), -np.inf)
    scores[:, 0] = 0.0
    return scores


def _logsumexp(x):
    """x [rows, V] -> [rows]: max + log(sum(exp(x - max))) (one pass of exp over every logit: on a
    CPU the costliest part of a search step after the matmuls)."""
    xp = xp_of(x)
    m = x.max(axis=1)
    e = x - m[:, None]
    xp.exp(e, out=e)
    return m + xp.log(e.sum(axis=1))
