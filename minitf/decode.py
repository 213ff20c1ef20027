"""Greedy and beam search (paper 6.1: beam 4, length penalty alpha 0.6, max length input + 50).

Decoding is incremental: the encoder runs once per sentence, every decoder layer's
cross-attention keys/values are computed once, and each step feeds only the newest token,
reusing cached self-attention keys/values of the earlier positions (`IncrementalDecoder`).
`use_cache=False` recomputes the whole prefix each step instead (for bench/decode.py).
Both searches are batched over many sentences; a finished sentence leaves the batch.
"""
import functools

import numpy as np

from .backend import to_numpy
from .blocks import decoder_layer_step
from .loss import log_softmax
from .model import causal_bias


def length_penalty(length, alpha):
    """GNMT (Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6) ^ alpha; |Y| counts the EOS."""
    return ((5.0 + length) / 6.0) ** alpha


class IncrementalDecoder:
    """Decoder state for N rows (sentences x beams); `step` feeds one token per row."""

    def __init__(self, model, src, max_steps, use_cache=True):
        self.model, self.use_cache, self.t = model, use_cache, 0
        xp, cfg = model.xp, model.cfg
        model.eval()
        memory, self.src_bias, _ = model.encode(src)
        self.memory = memory
        n, h, k = src.shape[0], cfg.n_heads, cfg.d_k
        self.caches = []
        if use_cache:
            for layer in model.decoder.layers_:
                ck, cv = layer.cross_attn.project_kv(memory)
                self.caches.append({"k": xp.zeros((n, h, max_steps, k), model.dtype),
                                    "v": xp.zeros((n, h, max_steps, k), model.dtype), "ck": ck, "cv": cv})
        self.prefix = xp.zeros((n, 0), dtype=src.dtype)

    def step(self, tokens):
        """tokens [N] (the token at position t) -> log-probabilities [N, V] for position t + 1."""
        m, xp, t = self.model, self.model.xp, self.t
        self.prefix = xp.concatenate([self.prefix, tokens[:, None].astype(self.prefix.dtype)], axis=1)
        if self.use_cache:
            x = m.positional.forward(m.embedding.lookup(tokens[:, None])[0], offset=t)
            for layer, cache in zip(m.decoder.layers_, self.caches):
                x = decoder_layer_step(layer, x, cache, t, self.src_bias)
            h = x[:, 0]
        else:  # the whole prefix again, causal mask and all
            tgt_bias = causal_bias(t + 1, xp, m.dtype)[None, None]
            y = m.positional.forward(m.embedding.lookup(self.prefix)[0])
            h = m.decoder.forward(y, self.memory, self.src_bias, tgt_bias)[:, -1]
        self.t += 1
        return log_softmax(m.embedding.project(h)[0])

    def reorder(self, rows, same_sources=False):
        """Keep rows `rows` (an int array into the current rows), in that order.

        `same_sources=True` promises every row keeps a row of the same source sentence
        (beams reordered within their sentence), so the per-sentence encoder output and
        cross-attention keys/values stay as they are; only the self-attention caches move.
        """
        rows = self.model.xp.asarray(rows)
        self.prefix = self.prefix[rows]
        if not same_sources:
            self.memory, self.src_bias = self.memory[rows], self.src_bias[rows]
        for cache in self.caches:
            for key in ("k", "v") if same_sources else cache:
                cache[key] = cache[key][rows]


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
        logp = dec.step(tokens)
        logp[:, cfg.pad_id] = -xp.inf  # never emit padding or BOS
        logp[:, cfg.bos_id] = -xp.inf
        if t == 0:
            logp[:, cfg.eos_id] = -xp.inf  # at least one token (fairseq's min_len 1)
        best = to_numpy(logp.argmax(axis=1))
        keep = [row for row, (sent, tok) in enumerate(zip(alive, best))
                if tok != cfg.eos_id and t < max_lens[sent]]   # EOS, or the length limit: done
        for row in keep:
            out[alive[row]].append(int(best[row]))
        if not keep:
            break
        alive = alive[keep]
        dec.reorder(np.asarray(keep))
        tokens = xp.asarray(best[keep]).astype(src.dtype)
    return out


@_restores_mode
def beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50, use_cache=True):
    """src [B, S] -> list of B token-id lists: the best finished hypothesis of each sentence
    by score / length_penalty. Each step keeps the k best continuations of the 2k best
    candidates; a candidate ending in EOS is finished if it ranks among the k best. A
    sentence stops when k hypotheses have finished or at its maximum length (EOS forced)."""
    cfg, xp = model.cfg, model.xp
    src = model._check_ids("src", src)
    b, k = src.shape[0], beam_size
    max_lens = _max_lengths(model, src, max_len_a, max_len_b)
    steps = int(max_lens.max()) + 1
    dec = IncrementalDecoder(model, xp.repeat(src, k, axis=0), steps, use_cache)
    finished = [[] for _ in range(b)]             # (normalized score, tokens)
    alive = list(range(b))                        # sentences still decoding, in row-block order
    hyps = [[[] for _ in range(k)] for _ in range(b)]
    scores = np.full((b, k), -np.inf)
    scores[:, 0] = 0.0                            # only one live hypothesis at the start
    tokens = xp.full(b * k, cfg.bos_id, dtype=src.dtype)
    for t in range(steps):
        logp = to_numpy(dec.step(tokens)).astype(np.float64)      # [rows, V]
        v = logp.shape[1]
        logp[:, cfg.pad_id] = -np.inf
        logp[:, cfg.bos_id] = -np.inf
        if t == 0:
            logp[:, cfg.eos_id] = -np.inf  # no empty translation (fairseq's min_len 1)
        n = len(alive)
        cand = (scores[alive][:, :, None] + logp.reshape(n, k, v)).reshape(n, k * v)
        # the 2k best candidates of each sentence: a linear-time partition, then a small sort
        part = (np.argpartition(-cand, 2 * k - 1, axis=1)[:, : 2 * k] if 2 * k < k * v
                else np.broadcast_to(np.arange(k * v), cand.shape))
        top = np.take_along_axis(part, np.argsort(-np.take_along_axis(cand, part, axis=1), axis=1, kind="stable"), axis=1)
        rows, next_tokens, still = [], [], []
        for i, sent in enumerate(alive):
            at_limit = t >= max_lens[sent]
            new_hyps, new_scores = [], []
            order = top[i] if not at_limit else (np.arange(k) * v + cfg.eos_id)  # forced EOS
            for rank, c in enumerate(order):
                beam, tok = divmod(int(c), v)
                s = cand[i, c]
                if not np.isfinite(s):
                    continue
                if tok == cfg.eos_id:
                    # an ending counts only if it ranks among the k best candidates (as in
                    # fairseq): a weak early EOS must not fill the finished list and stop the search
                    if rank < k and len(finished[sent]) < k:
                        finished[sent].append((s / length_penalty(t + 1, alpha), hyps[sent][beam]))
                elif len(new_hyps) < k:
                    new_hyps.append((beam, hyps[sent][beam] + [tok]))
                    new_scores.append(s)
            if len(finished[sent]) >= k or at_limit or not new_hyps:
                continue
            while len(new_hyps) < k:                       # pad the beam with dead entries
                new_hyps.append((new_hyps[0][0], new_hyps[0][1]))
                new_scores.append(-np.inf)
            hyps[sent] = [h for _, h in new_hyps]
            scores[sent] = new_scores
            rows.extend(i * k + beam for beam, _ in new_hyps)
            next_tokens.extend(h[-1] for _, h in new_hyps)
            still.append(sent)
        if not still:
            break
        dec.reorder(np.asarray(rows), same_sources=still == alive)
        alive = still
        tokens = xp.asarray(np.asarray(next_tokens)).astype(src.dtype)
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


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
