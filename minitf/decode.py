"""Greedy and beam search (paper 6.1: beam 4, length penalty alpha 0.6, max length input + 50).

Decoding is incremental: the encoder runs once per sentence, every decoder layer's
cross-attention keys/values are computed once, and each step feeds only the newest token,
reusing cached self-attention keys/values of the earlier positions (`IncrementalDecoder`).
`use_cache=False` recomputes the whole prefix each step instead (for bench/decode.py).
Both searches are batched over many sentences; a finished sentence leaves the batch. The
beams of a sentence share its encoder output: they are the queries of one cross-attention.
"""
import functools

import numpy as np

from .backend import to_numpy, xp_of
from .blocks import StepCache, decoder_layer_step
from .functional import as_float32_if_half
from .loss import log_softmax
from .model import causal_bias


def length_penalty(length, alpha):
    """GNMT (Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6) ^ alpha; |Y| counts the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


class IncrementalDecoder:
    """Decoder state for N = n sentences x `beam` rows (sentence-major: row r belongs to
    sentence r // beam); `logits` feeds one token per row and returns the next position's
    logits."""

    def __init__(self, model, src, max_steps, use_cache=True, beam=1):
        self.model, self.use_cache, self.beam, self.t = model, use_cache, beam, 0
        xp = model.xp
        model.eval()
        self.memory, self.src_bias, _ = model.encode(src)           # once per sentence, not per beam
        rows = src.shape[0] * beam
        self.caches = [StepCache(layer, self.memory, rows, max_steps, xp, model.dtype)
                       for layer in model.decoder.layers_] if use_cache else []
        self.prefix = xp.zeros((rows, 0), dtype=src.dtype)          # the tokens so far (uncached only)

    def step(self, tokens):
        """tokens [N] (the token at position t) -> log-probabilities [N, V] for position t + 1."""
        return log_softmax(self.logits(tokens))

    def logits(self, tokens):
        """tokens [N] (the token at position t) -> logits [N, V] for position t + 1."""
        m, xp, t = self.model, self.model.xp, self.t
        if self.use_cache:
            x = m.positional.forward(m.embedding.lookup(tokens[:, None])[0], offset=t)    # [N, 1, D]
            for layer, cache in zip(m.decoder.layers_, self.caches):
                x = decoder_layer_step(layer, x, cache, t, self.src_bias, self.beam)
            h = x[:, 0]
        else:  # the whole prefix again, causal mask and all
            self.prefix = xp.concatenate([self.prefix, tokens[:, None].astype(self.prefix.dtype)], axis=1)
            tgt_bias = causal_bias(t + 1, xp, m.dtype)[None, None]
            y = m.positional.forward(m.embedding.lookup(self.prefix)[0])
            memory, src_bias = (xp.repeat(a, self.beam, axis=0) for a in (self.memory, self.src_bias))
            h = m.decoder.forward(y, memory, src_bias, tgt_bias)[:, -1]
        self.t += 1
        return m.embedding.project(h)[0]

    def reorder(self, rows):
        """Keep rows `rows` (an int array into the current rows), in that order.

        With beam > 1 the rows come in groups of `beam` from one sentence each (a sentence's
        beams reordered among themselves, or a finished sentence dropped): the per-sentence
        encoder state follows the sentences rows[::beam] // beam; only the self-attention
        caches move row by row, and only their first t positions (the rest is unwritten).
        """
        xp, t = self.model.xp, self.t
        rows = np.asarray(to_numpy(rows))
        sentences = rows[:: self.beam] // self.beam
        if len(sentences) != self.memory.shape[0] or (sentences != np.arange(len(sentences))).any():
            idx = xp.asarray(sentences)
            self.memory, self.src_bias = self.memory[idx], self.src_bias[idx]
            for cache in self.caches:
                cache.ck, cache.cv = cache.ck[idx], cache.cv[idx]
        if not self.use_cache:
            self.prefix = self.prefix[xp.asarray(rows)]
            return
        # row j takes row rows[j]'s history; rows that keep their own (often most) are not copied,
        # and a shorter batch is compacted in place: the caches become views of their first rows
        moved = np.flatnonzero(rows != np.arange(len(rows)))
        if len(moved):
            dst, src = xp.asarray(moved), xp.asarray(rows[moved])
        for cache in self.caches:
            for name in ("k", "v"):
                buf = getattr(cache, name)
                if len(moved):
                    buf[dst, :, :t] = buf[src, :, :t]      # the right side is a copy: no aliasing
                if len(rows) != buf.shape[0]:
                    setattr(cache, name, buf[: len(rows)])


def _restores_mode(search):
    """Decode in eval mode (no dropout), then give the model back in the caller's mode: a loop that
    translates between training steps keeps training with dropout."""
    @functools.wraps(search)
    def wrapper(model, *args, **kwargs):
        was_training = model.training
        try:
            return search(model, *args, **kwargs)
        finally:
            model.train(was_training)
    return wrapper


def _max_lengths(model, src, max_len_a, max_len_b):
    src_len = to_numpy((src != model.cfg.pad_id).sum(axis=1))
    lengths = (max_len_a * src_len + max_len_b).astype(int)
    # learned positions end at max_len; sinusoidal ones extend to any length (layers/positional.py)
    return np.minimum(lengths, model.cfg.max_len - 1) if model.cfg.positional == "learned" else lengths


@_restores_mode
def greedy_search(model, src, max_len_a=1.0, max_len_b=50, use_cache=True):
    """src [B, S] -> list of B token-id lists (no BOS, no EOS); the argmax at every step."""
    cfg, xp = model.cfg, model.xp
    src = model._check_ids("src", src)
    max_lens = _max_lengths(model, src, max_len_a, max_len_b)
    steps = int(max_lens.max()) + 1
    dec = IncrementalDecoder(model, src, steps, use_cache)
    out = [[] for _ in range(src.shape[0])]
    alive = np.arange(src.shape[0])
    tokens = xp.full(src.shape[0], cfg.bos_id, dtype=src.dtype)
    for t in range(steps):
        logits = dec.logits(tokens)            # argmax log p = argmax logits: no softmax needed
        _ban(logits, cfg, t)
        best = to_numpy(logits.argmax(axis=1))
        keep = np.flatnonzero((best != cfg.eos_id) & (t < max_lens[alive]))   # EOS, or the length limit: done
        for row in keep:
            out[alive[row]].append(int(best[row]))
        if not len(keep):
            break
        alive = alive[keep]
        dec.reorder(keep)
        tokens = xp.asarray(best[keep]).astype(src.dtype)
    return out


def _ban(logits, cfg, t):
    """Never emit padding or BOS; no EOS first (at least one token: fairseq's min_len 1)."""
    logits[:, cfg.pad_id] = -np.inf
    logits[:, cfg.bos_id] = -np.inf
    if t == 0:
        logits[:, cfg.eos_id] = -np.inf


def _group_size(v):
    """Tokens per group in `top_candidates`: the largest divisor of V in [32, 128], else V."""
    return next((w for w in range(128, 31, -1) if v % w == 0), v)


def top_candidates(logits, offset, k, n_best):
    """The n_best best (beam, token) continuations of each sentence, best first.

    logits [n * k, V]: the rows of n sentences x k beams, sentence-major; offset [n * k]; a
    continuation's score is offset[row] + logits[row, token]. Returns host arrays (values,
    beams, tokens), each [n, n_best].

    Plain equivalent: cand = (offset[:, None] + logits).reshape(n, k * V), then the n_best
    largest of each row of cand, sorted. Ranking all k * V candidates is the costly part,
    so it runs on group maxima instead: a row's V tokens are split into G groups of W
    (token i * G + g is the i-th of group g: the maxima are then an elementwise maximum of
    W rows of G, a fast pass); every one of the n_best best candidates lies in one of the
    n_best groups with the largest maxima (were its group not among them, n_best groups
    would each hold a better candidate). Only those n_best * W values are ranked.
    """
    xp = xp_of(logits)
    rows, v = logits.shape
    n = rows // k
    w = _group_size(v)
    g = v // w
    grouped = logits.reshape(rows, w, g)                                        # [n * k, W, G]
    group_max = grouped.max(axis=1) + offset[:, None]                           # [n * k, G]
    group_max = group_max.reshape(n, k * g)
    if n_best < k * g:
        chosen = xp.argpartition(-group_max, n_best - 1, axis=1)[:, :n_best]    # [n, m]: beam * G + group
    else:
        chosen = xp.broadcast_to(xp.arange(k * g), (n, k * g))
    row = xp.arange(n)[:, None] * k + chosen // g                               # [n, m]
    vals = grouped[row, :, chosen % g] + offset[row][..., None]                  # [n, m, W]
    vals = vals.reshape(n, -1)
    part = xp.argpartition(-vals, n_best - 1, axis=1)[:, :n_best] if n_best < vals.shape[1] else xp.broadcast_to(
        xp.arange(vals.shape[1]), vals.shape)
    part = xp.take_along_axis(part, xp.argsort(-xp.take_along_axis(vals, part, axis=1), axis=1), axis=1)
    values = to_numpy(xp.take_along_axis(vals, part, axis=1))                   # [n, n_best], best first
    part = to_numpy(part)
    chosen = to_numpy(chosen)[np.arange(n)[:, None], part // w]                  # beam * G + group of each
    return values, chosen // g, (part % w) * g + chosen % g                      # token = i * G + group


@_restores_mode
def beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50, use_cache=True):
    """src [B, S] -> list of B token-id lists: the best finished hypothesis of each sentence
    by score / length_penalty. Each step ranks the 2k best continuations of a sentence
    (k = beam_size; a continuation: a live beam plus one token); an EOS among the k best
    finishes its hypothesis while fewer than k have finished (a weak early EOS must not fill
    the finished list and stop the search: fairseq's rule), and the first k others are the
    next beams. A sentence stops when k hypotheses have finished, or at its maximum length,
    where every live beam ends (EOS forced)."""
    cfg, xp = model.cfg, model.xp
    src = model._check_ids("src", src)
    b, k = src.shape[0], beam_size
    max_lens = _max_lengths(model, src, max_len_a, max_len_b)
    steps = int(max_lens.max()) + 1
    dec = IncrementalDecoder(model, src, steps, use_cache, beam=k)
    alive = np.arange(b)                          # sentences still decoding, in row-block order
    hyps = np.zeros((b * k, 0), dtype=np.int64)   # [rows, t] the tokens of every live beam
    scores = np.full((b, k), -np.inf)             # [n, k] their log-probabilities
    scores[:, 0] = 0.0                            # only one live beam at the start (all k are BOS)
    n_done = np.zeros(b, dtype=int)               # finished hypotheses per sentence
    best, best_score = [[] for _ in range(b)], np.full(b, -np.inf)
    tokens = xp.full(b * k, cfg.bos_id, dtype=src.dtype)
    for t in range(steps):
        logits = as_float32_if_half(dec.logits(tokens))                       # [n * k, V]
        n, v = len(alive), logits.shape[1]
        lse = _logsumexp(logits)                                              # log p = logits - lse
        _ban(logits, cfg, t)
        offset = xp.asarray(scores.reshape(-1), dtype=logits.dtype) - lse   # [n * k]: score + log p - logits
        n_best = min(2 * k, k * v)
        values, beam, tok = top_candidates(logits, offset, k, n_best)         # [n, 2k], best first
        at_limit = t >= max_lens[alive]
        if at_limit.any():   # the length limit: every beam ends with EOS, in beam order
            ends = to_numpy(offset + logits[:, cfg.eos_id]).reshape(n, k)
            values, beam, tok = values.copy(), beam.copy(), tok.copy()
            values[at_limit] = -np.inf
            values[at_limit, :k] = ends[at_limit]
            beam[at_limit], tok[at_limit] = np.arange(n_best) % k, cfg.eos_id
        finite = np.isfinite(values)
        is_eos = tok == cfg.eos_id
        # finished: an EOS among the k best; looped in rank order (rare: at most k per sentence)
        for i, r in zip(*np.nonzero(is_eos & finite & (np.arange(n_best) < k))):
            sent = alive[i]
            if n_done[sent] < k:
                n_done[sent] += 1
                s = values[i, r] / length_penalty(t + 1, alpha)
                if s > best_score[sent]:
                    best_score[sent], best[sent] = s, hyps[i * k + beam[i, r]].tolist()
        # the next beams: the first k continuations that are not EOS, in rank order
        cont = ~is_eos & finite
        pick = np.argsort(~cont, axis=1, kind="stable")[:, :k]               # continuations first
        live = np.take_along_axis(cont, pick, axis=1)                          # False: a dead (-inf) slot
        still = np.flatnonzero((n_done[alive] < k) & ~at_limit & live[:, 0])
        if not len(still):
            break
        pick, live = pick[still], live[still]
        pick = np.where(live, pick, pick[:, :1])        # a dead slot repeats the first beam, score -inf
        new_beam = np.take_along_axis(beam[still], pick, axis=1)
        new_tok = np.take_along_axis(tok[still], pick, axis=1)
        rows = (still[:, None] * k + new_beam).reshape(-1)                     # parent row of each new beam
        hyps = np.concatenate([hyps[rows], new_tok.reshape(-1, 1)], axis=1)
        scores = np.where(live, np.take_along_axis(values[still], pick, axis=1), -np.inf)
        dec.reorder(rows)
        alive = alive[still]
        tokens = xp.asarray(new_tok.reshape(-1)).astype(src.dtype)
    return best


def _logsumexp(x):
    """x [N, V] -> [N]: max + log(sum(exp(x - max))) (one pass of exp over every logit: on a
    CPU the costliest part of a search step after the matmuls)."""
    xp = xp_of(x)
    m = x.max(axis=1)
    e = x - m[:, None]
    xp.exp(e, out=e)
    return m + xp.log(e.sum(axis=1))


def translate_ids(model, src_ids, beam_size=4, alpha=0.6, batch_size=64, max_len_b=50, progress=None):
    """Decode lists of source ids (with EOS) in length-sorted batches; returns id lists in input order."""
    order = np.argsort([len(s) for s in src_ids], kind="stable")
    out = [None] * len(src_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        width = max(len(src_ids[i]) for i in idx)
        src = np.full((len(idx), width), model.cfg.pad_id, dtype=np.int64)
        for r, i in enumerate(idx):
            src[r, : len(src_ids[i])] = src_ids[i]
        if beam_size == 1:
            res = greedy_search(model, src, max_len_b=max_len_b)
        else:
            res = beam_search(model, src, beam_size, alpha, max_len_b=max_len_b)
        for r, i in enumerate(idx):
            out[i] = res[r]
        if progress is not None:
            progress.update(len(idx))
    return out
