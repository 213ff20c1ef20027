"""The Transformer's incremental decoder (the KV cache): the state beam search and greedy
search step through (decode.py), one new token per row and step.

The encoder runs once per sentence, every decoder layer's cross-attention keys/values are
computed once, and each step feeds only the newest token, reusing the cached self-attention
keys/values of the earlier positions (StepCache, decoder_layer_step, here).
`use_cache=False` recomputes the whole prefix each step instead (for bench/decode.py).
Derivation: docs/derivations/decoding.md.
"""
from typing import NamedTuple

import numpy as np

from .backend import to_numpy
from . import functional as F
from .backend import xp_of
from .decode import check_step_rows
from .layers.attention import maps_off
from .layers.embedding import decoding_logits
from .loss import log_softmax
from .masks import causal_bias


class StepCache:
    """What the decoder keeps between decoding steps for one group of sentences that started
    together (incremental.IncrementalDecoder), for all the decoder's layers in one array each: kv [rows, n_decoder_layers, 2,
    T_max, H, K], each row's self-attention keys (0) and values (1) of every layer at the
    positions so far (position t is written at step t), row-major, so that moving a row to
    another parent copies one block per layer and side; ckv [n_decoder_layers, 2, n, H, S, K], each layer's
    cross-attention keys/values of the encoder output, computed once per sentence (its beam
    rows share them)."""
    __slots__ = ("kv", "ckv")

    def __init__(self, layers, memory, rows, max_steps):
        xp, sa = xp_of(memory), layers[0].self_attn
        n, s, _ = memory.shape
        self.kv = xp.empty((rows, len(layers), 2, max_steps, sa.n_heads, sa.d_k), memory.dtype)
        self.ckv = xp.empty((len(layers), 2, n, sa.n_heads, s, sa.d_k), memory.dtype)
        for i, layer in enumerate(layers):
            self.ckv[i, 0], self.ckv[i, 1] = layer.cross_attn.project_kv(memory)


class StepGroup(NamedTuple):
    """The rows a:b of a decoding step that belong to one group (sentences that started
    together): `beam` rows a sentence, all at position t, their sources masked by src_bias
    [n, 1, 1, S], their keys/values in `cache` (StepCache)."""
    a: int
    b: int
    t: int
    src_bias: object
    cache: StepCache
    beam: int


def fused_qkv(layer):
    """The self-attention's q, k, v projections side by side: (w [D, 3*H*K], b [3*H*K]), so a
    decoding step projects its new position with one matmul instead of three."""
    sa = layer.self_attn
    xp = xp_of(sa.q.params["weight"])
    return (xp.concatenate([sa.q.params["weight"], sa.k.params["weight"], sa.v.params["weight"]], axis=1),
            xp.concatenate([sa.q.params["bias"], sa.k.params["bias"], sa.v.params["bias"]]))


def decoder_layer_step(layer, i, x, qkv, groups):
    """Incremental (KV-cached) forward of DecoderLayer `layer` (the i-th) for one new position
    per row, inference only.

    x [rows, 1, D]: the new position of each row, rows sentence-major and grouped by `groups`
    (StepGroup: their rows, caches and rows per sentence); qkv: fused_qkv(layer). Equals the
    row's position of DecoderLayer.forward on its whole prefix: the cache holds only the
    positions up to this one, so no causal mask is needed.
    The projections and other position-wise parts run on all rows at once (one matmul
    each), only the attention itself group by group.
    """
    sa, ca = layer.self_attn, layer.cross_attn
    n_rows, _, d = x.shape
    pre = layer.pre   # a sublayer reads norm(x) (pre-norm) or x; a block's sum is x + ... (pre) or norm(x + ...)
    # q, k, v = x Wq, x Wk, x Wv in one matmul; k, v of the new position join the cache
    q, k, v = (F.split_heads(part, sa.n_heads)
               for part in F.split_last(F.linear_forward(_norm_if(pre, layer.norm1, x), *qkv), 3))   # [rows, H, 1, K]
    heads = []
    for g in groups:
        keys, values = g.cache.kv[: g.b - g.a, i, 0], g.cache.kv[: g.b - g.a, i, 1]            # [rows, T_max, H, K]
        keys[:, g.t], values[:, g.t] = k[g.a: g.b, :, 0], v[g.a: g.b, :, 0]
        heads.append(F.attention_forward(q[g.a: g.b], keys[:, : g.t + 1].transpose(0, 2, 1, 3),
                                         values[:, : g.t + 1].transpose(0, 2, 1, 3), 0.0, sa.scale)[0])
    h1 = _norm_if(not pre, layer.norm1, x + sa.out.apply(F.merge_heads(_join(heads))))        # [rows, 1, D]
    # cross-attention: the beams of a sentence are the queries of one [beam, S] attention
    q = ca.q.apply(_norm_if(pre, layer.norm2, h1))                                                # [rows, 1, H*K]
    heads = []
    for g in groups:
        q_g = F.split_heads(q[g.a: g.b].reshape((g.b - g.a) // g.beam, g.beam, -1), ca.n_heads)  # [n, H, beam, K]
        ctx = F.attention_forward(q_g, g.cache.ckv[i, 0], g.cache.ckv[i, 1], g.src_bias, ca.scale)[0]
        heads.append(F.merge_heads(ctx).reshape(g.b - g.a, 1, -1))                              # [rows, 1, H*K]
    h2 = _norm_if(not pre, layer.norm2, h1 + ca.out.apply(_join(heads)))
    return _norm_if(not pre, layer.norm3, h2 + layer.ffn.apply(_norm_if(pre, layer.norm3, h2)))


def _norm_if(cond, norm, a):
    """norm(a) (inference: LayerNorm.apply) when cond, else a."""
    return norm.apply(a) if cond else a


def _join(parts):
    return parts[0] if len(parts) == 1 else xp_of(parts[0]).concatenate(parts)


class _Group:
    """Sentences that started decoding together: n of them, `width` rows each (1 until the
    first reorder, then the beam), all at step t (positions 0..t-1 written), with their encoder
    state (src_bias, and memory or per-layer caches)."""

    def __init__(self, n, src_bias):
        self.n, self.width, self.t, self.src_bias = n, 1, 0, src_bias
        self.cache, self.memory, self.prefix = None, None, None


class IncrementalDecoder:
    """Decoder state for sentences x `beam` rows, sentence-major (a sentence's beams are
    consecutive rows). `logits` feeds one token per row and returns the logits of each row's
    next position; `reorder` keeps chosen rows (beams taking new parents, finished sentences
    leaving); `admit` starts more sentences while others are mid-way. Sentences that started
    together form a group with its own step and buffers: the position-wise layers run on all
    rows at once, each attention group by group over exactly its positions.

    A sentence enters with ONE row: its `beam` beams would all start from BOS in the same
    state, so its first step is computed once; its first `reorder` gives it `beam` rows (all
    with that row as their parent).
    """

    def __init__(self, model, src, max_steps, use_cache=True, beam=1):
        self.model, self.use_cache, self.beam, self.max_steps = model, use_cache, beam, max_steps
        model.eval()
        self.qkv = [fused_qkv(layer) for layer in model.decoder.layer_list] if use_cache else None
        self.w_out = model.embedding.output_weight()
        self.out_bias = model.embedding.output_bias()     # -inf outside an output vocabulary (None: none)
        self.groups = []
        self.admit(src)

    def admit(self, src, max_steps=None):
        """Start decoding the sentences src [m, S] (after those held), at step 0, with room in their cache for
        max_steps positions (default the decoder's max_steps)."""
        with maps_off():   # no backward: no attention weights kept
            memory, src_bias, _ = self.model.encode(src)                   # once per sentence, not per beam
        g = _Group(src.shape[0], src_bias)
        rows = src.shape[0] * self.beam                                # room for the beams after the first step
        if self.use_cache:
            g.cache = StepCache(self.model.decoder.layer_list, memory, rows, max_steps or self.max_steps)
        else:   # the whole prefix again at every step: keep memory [m, S, D] and the tokens so far
            g.memory, g.prefix = memory, self.model.xp.zeros((src.shape[0], 0), dtype=src.dtype)
        self.groups.append(g)

    def step(self, tokens):
        """tokens [rows] (each row's token at its position t) -> log-probabilities [rows, V] for t + 1."""
        return log_softmax(self.logits(tokens))

    def logits(self, tokens):
        """tokens [rows] (each row's token at its position t) -> logits [rows, V] for position t + 1."""
        m, xp = self.model, self.model.xp
        bounds = np.cumsum([0] + [g.n * g.width for g in self.groups])
        check_step_rows(tokens, bounds[-1])
        at = [StepGroup(int(a), int(b), g.t, g.src_bias, g.cache, g.width)
              for a, b, g in zip(bounds[:-1], bounds[1:], self.groups)]
        if self.use_cache:
            positions = (self.groups[0].t if len(self.groups) == 1 else
                         np.concatenate([np.full(g.b - g.a, g.t) for g in at]))
            x = m.positional.forward(m.embedding.lookup(tokens[:, None])[0], offset=positions)    # [rows, 1, D]
            for i, layer in enumerate(m.decoder.layer_list):
                x = decoder_layer_step(layer, i, x, self.qkv[i], at)
            h = x[:, 0] if m.decoder.norm is None else m.decoder.norm.apply(x[:, 0])
        else:   # each group's whole prefix again, causal mask and all
            parts = []
            for g, s in zip(self.groups, at):
                g.prefix = xp.concatenate([g.prefix, tokens[s.a: s.b, None].astype(g.prefix.dtype)], axis=1)
                y = m.positional.forward(m.embedding.lookup(g.prefix)[0])
                memory, src_bias = (xp.repeat(a, g.width, axis=0) for a in (g.memory, g.src_bias))
                parts.append(m.decoder.forward(y, memory, src_bias, causal_bias(g.t + 1, xp, m.dtype)[None, None])[:, -1])
            h = xp.concatenate(parts)
        for g in self.groups:
            g.t += 1
        return decoding_logits(h, self.w_out, self.out_bias)

    def reorder(self, rows):
        """Keep rows `rows` (an int array into the current rows), in that order.

        The rows come in groups of `beam` from one sentence each (a sentence's beams taking
        new parents among themselves, a finished sentence leaving), in sentence order; a
        sentence that had one row gets its `beam`. Only the rows that move are copied, in
        place, and only the positions written so far.
        """
        xp, k = self.model.xp, self.beam
        rows = np.asarray(to_numpy(rows))
        start, kept = 0, []
        for g in self.groups:
            stop = start + g.n * g.width
            mine = rows[(rows >= start) & (rows < stop)] - start       # this group's rows, in order
            start = stop
            sentences = mine[::k] // g.width
            moved = np.flatnonzero(sentences != np.arange(len(sentences)))
            if len(moved):                                           # finished sentences left: close the gaps
                dst, src = xp.asarray(moved), xp.asarray(sentences[moved])
                g.src_bias[dst] = g.src_bias[src]                    # each right side is a copy: no aliasing
                if g.cache is not None:
                    g.cache.ckv[:, :, dst] = g.cache.ckv[:, :, src]
                if g.memory is not None:
                    g.memory[dst] = g.memory[src]
            g.n, g.width = len(sentences), k
            g.src_bias = g.src_bias[: g.n]
            if g.memory is not None:
                g.memory, g.prefix = g.memory[: g.n], g.prefix[xp.asarray(mine)]
            if g.cache is not None:
                moved = np.flatnonzero(mine != np.arange(len(mine)))
                if len(moved):                                       # beams that took another parent
                    dst, src = xp.asarray(moved), xp.asarray(mine[moved])
                    g.cache.kv[dst, :, :, : g.t] = g.cache.kv[src, :, :, : g.t]   # [rows, n_decoder_layers, 2, t, H, K]
                g.cache.ckv = g.cache.ckv[:, :, : g.n]               # a smaller group: views of the first rows
                g.cache.kv = g.cache.kv[: len(mine)]
            if g.n:
                kept.append(g)
        self.groups = kept
