"""The Transformer's incremental decoder (the KV cache): the state beam search and greedy
search step through (decode.py), one new token per row and step.

The encoder runs once per sentence, every decoder layer's cross-attention keys/values are
computed once, and each step feeds only the newest token, reusing the cached self-attention
keys/values of the earlier positions (blocks.StepCache, blocks.decoder_layer_step).
`use_cache=False` recomputes the whole prefix each step instead (for bench/decode.py).
Derivation: docs/derivations/decoding.md.
"""
import numpy as np

from .backend import to_numpy
from .blocks import StepCache, StepGroup, decoder_layer_step, fused_qkv
from .layers.embedding import decoding_logits
from .loss import log_softmax
from .masks import causal_bias


class _Group:
    """Sentences that started decoding together: n of them, `width` rows each (1 until the
    first reorder, then the beam), all at step t (positions 0..t-1 written), with their encoder
    state (src_bias, and memory or per-layer caches)."""

    def __init__(self, n, src_bias):
        self.n, self.width, self.t, self.src_bias = n, 1, 0, src_bias
        self.cache, self.memory, self.prefix = None, None, None


def check_step_rows(tokens, rows):
    """A decoding step takes one token per row (both decoders' rule)."""
    if len(tokens) != rows:
        raise ValueError(f"{len(tokens)} tokens for {rows} rows: one token a row (a sentence has one row "
                         "until its first reorder, then one a beam)")


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

    def admit(self, src):
        """Start decoding the sentences src [m, S] (after those held), at step 0."""
        memory, src_bias, _ = self.model.encode(src)                   # once per sentence, not per beam
        g = _Group(src.shape[0], src_bias)
        rows = src.shape[0] * self.beam                                # room for the beams after the first step
        if self.use_cache:
            g.cache = StepCache(self.model.decoder.layer_list, memory, rows, self.max_steps)
        else:   # the whole prefix again at every step: keep memory [m, S, D] and the tokens so far
            g.memory, g.prefix = memory, self.model.xp.zeros((src.shape[0], 0), dtype=src.dtype)
        self.groups.append(g)

    def step(self, tokens):
        """tokens [N] (each row's token at its position t) -> log-probabilities [N, V] for t + 1."""
        return log_softmax(self.logits(tokens))

    def logits(self, tokens):
        """tokens [N] (each row's token at its position t) -> logits [N, V] for position t + 1."""
        m, xp = self.model, self.model.xp
        bounds = np.cumsum([0] + [g.n * g.width for g in self.groups])
        check_step_rows(tokens, bounds[-1])
        at = [StepGroup(int(a), int(b), g.t, g.src_bias, g.cache, g.width)
              for a, b, g in zip(bounds[:-1], bounds[1:], self.groups)]
        if self.use_cache:
            positions = (self.groups[0].t if len(self.groups) == 1 else
                         np.concatenate([np.full(g.b - g.a, g.t) for g in at]))
            x = m.positional.forward(m.embedding.lookup(tokens[:, None])[0], offset=positions)    # [N, 1, D]
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
                    g.cache.kv[dst, :, :, : g.t] = g.cache.kv[src, :, :, : g.t]   # [rows, L, 2, t, H, K]
                g.cache.ckv = g.cache.ckv[:, :, : g.n]               # a smaller group: views of the first rows
                g.cache.kv = g.cache.kv[: len(mine)]
            if g.n:
                kept.append(g)
        self.groups = kept
