"""The attention of the recurrent encoder-decoders the Transformer replaced: a decoder state
q scores every encoder annotation h_s, and the context is the softmax-weighted sum of them.

    additive (Bahdanau et al. 2015, eq. 6 / A.1.2):  score(q, h_s) = tanh(q @ w_q + h_s @ w_k) @ v
    general  (Luong et al. 2015, 3.1):               score(q, h_s) = q^T W_a h_s   (= q . (h_s @ w_k))
    dot      (Luong et al. 2015, 3.1):               score(q, h_s) = q . h_s
    p = softmax(score + bias) over s,  context = sum_s p_s h_s

The key side (h_s @ w_k) does not depend on the query: `keys` computes it once per sentence
and every decoder step reuses it (`attend`), as the Transformer's decoder reuses its
cross-attention keys and values. q [B, k, Q] holds k queries per sentence (one per training
step, or the k beams of a sentence when decoding); memory [B, S, M]; bias [B, S] (NEG_INF on padding).
Compare the Transformer's scaled dot product (paper 3.2.1), which is `dot` divided by sqrt(d_k)
and run for all positions and heads at once. Derivation: docs/derivations/rnn_attention.md.
"""
from typing import NamedTuple

import numpy as np

from .. import functional as F
from ..backend import xp_of
from .base import Layer


class AttendCache(NamedTuple):
    """One attend call: q [B, k, Q], p [B, k, S] (the attention weights), pre-score tanh
    [B, k, S, A] (additive only, else None), keys and memory (references, not copies)."""
    q: object
    p: object
    tanh: object
    keys: object
    memory: object


class RecurrentAttention(Layer):
    KINDS = ("general", "dot", "additive")   # config.ATTENTIONS

    def __init__(self, kind, d_query, d_memory, rng, d_attn=None):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"attention must be one of {', '.join(self.KINDS)}, got {kind!r}")
        if kind == "dot" and d_query != d_memory:
            raise ValueError(f"dot attention needs the query width ({d_query}) = the memory width ({d_memory})")
        self.kind = kind
        if kind == "general":
            limit = np.sqrt(6.0 / (d_query + d_memory))
            self.params["w_k"] = rng.uniform(-limit, limit, size=(d_memory, d_query))
        elif kind == "additive":
            a = d_attn or d_query
            self.params["w_q"] = rng.uniform(-1, 1, size=(d_query, a)) * np.sqrt(6.0 / (d_query + a))
            self.params["w_k"] = rng.uniform(-1, 1, size=(d_memory, a)) * np.sqrt(6.0 / (d_memory + a))
            self.params["v"] = rng.uniform(-1, 1, size=(a,)) * np.sqrt(3.0 / a)

    # --------------------------------------------------------------- the key side, once per sentence
    def keys(self, memory):
        """memory [B, S, M] -> keys [B, S, Q] (general), [B, S, A] (additive), memory itself (dot)."""
        if self.kind == "dot":
            return memory
        self.cache = memory
        return memory @ self.params["w_k"]

    def keys_backward(self, dkeys):
        """dkeys (summed over every attend) -> dmemory [B, S, M]; accumulates d w_k."""
        if self.kind == "dot":
            return dkeys
        memory = self.take_cache()
        m = memory.shape[-1]
        # keys = memory @ w_k
        self.grads["w_k"] += memory.reshape(-1, m).T @ dkeys.reshape(-1, dkeys.shape[-1])
        return dkeys @ self.params["w_k"].T

    # --------------------------------------------------------------- one step: k queries per sentence
    def attend(self, q, keys, memory, bias):
        """q [B, k, Q] -> (context [B, k, M], p [B, k, S], cache)."""
        t = None
        if self.kind == "additive":
            t = xp_of(q).tanh(keys[:, None] + (q @ self.params["w_q"])[:, :, None])   # [B, k, S, A]
            scores = t @ self.params["v"]                                          # [B, k, S]
        else:
            scores = q @ keys.transpose(0, 2, 1)                                   # [B, k, S]
        p = F.softmax_forward(scores + bias[:, None, :])
        return p @ memory, p, AttendCache(q, p, t, keys, memory)

    def attend_backward(self, dctx, cache, dkeys, dmemory):
        """dctx [B, k, M] -> dq [B, k, Q]; ACCUMULATES into dkeys and dmemory (arrays the caller
        sums over all steps) and into the parameter gradients."""
        q, p, t, keys, memory = cache
        # context = p @ memory   (k is 1 in training, the only backward: an einsum of outer products beats k-deep matmuls)
        dmemory += xp_of(p).einsum("bks,bkm->bsm", p, dctx)
        dscores = F.softmax_backward(dctx @ memory.transpose(0, 2, 1), p)
        if self.kind != "additive":
            # scores = q @ keys^T
            dkeys += xp_of(q).einsum("bks,bkq->bsq", dscores, q)
            return dscores @ keys
        # scores = tanh(keys + q @ w_q) @ v
        self.grads["v"] += dscores.reshape(-1) @ t.reshape(-1, t.shape[-1])
        dpre = dscores[..., None] * self.params["v"] * (1 - t * t)              # [B, k, S, A]
        dkeys += dpre.sum(axis=1)
        dqw = dpre.sum(axis=2)                                                 # [B, k, A]
        self.grads["w_q"] += q.reshape(-1, q.shape[-1]).T @ dqw.reshape(-1, dqw.shape[-1])
        return dqw @ self.params["w_q"].T

    # --------------------------------------------------------------- all queries at once (tests)
    def forward(self, q, memory, bias):
        """q [B, k, Q], memory [B, S, M], bias [B, S] -> context [B, k, M]."""
        keys = self.keys(memory)
        ctx, _, self._attend = self.attend(q, keys, memory, bias)
        return ctx

    def backward(self, dctx):
        cache, self._attend = self._attend, None
        xp = xp_of(dctx)
        dkeys, dmemory = xp.zeros_like(cache.keys), xp.zeros_like(cache.memory)
        dq = self.attend_backward(dctx, cache, dkeys, dmemory)
        if self.kind == "dot":
            dmemory += dkeys
        else:
            dmemory += self.keys_backward(dkeys)
        return dq, dmemory
