"""The one token embedding matrix, shared three ways (paper 3.4, joint vocabulary):
source lookup, target lookup (both multiplied by sqrt(d_model)) and the pre-softmax
projection logits = h @ weight^T. Each use caches its own inputs in the object it returns;
each backward ACCUMULATES into the same gradient, so tying needs no special code.
"""
import numpy as np

from ..backend import is_gpu, xp_of
from .base import Layer


def segment_sum_rows(ids, rows, out):
    """out[ids[n]] += rows[n] for every n (ids [N], rows [N, D], out [V, D]).

    CPU: one stable sort and one reduceat instead of np.add.at's slow unbuffered scatter.
    GPU: CuPy's add.at is an atomic scatter-add kernel, the fast way there.
    """
    xp = xp_of(rows)
    if is_gpu(xp):
        xp.add.at(out, ids, rows)
        return
    order = xp.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), sorted_ids[1:] != sorted_ids[:-1]]))
    out[sorted_ids[starts]] += xp.add.reduceat(rows[order], starts, axis=0)


class TokenEmbedding(Layer):
    def __init__(self, vocab_size, d_model, rng):
        super().__init__()
        self.scale = float(np.sqrt(d_model))
        # N(0, d_model^-0.5): after the sqrt(d_model) scale the embeddings have unit variance
        self.params["weight"] = rng.normal(0.0, d_model ** -0.5, size=(vocab_size, d_model))

    def lookup(self, ids):
        """ids [B, L] int -> (x [B, L, D] = weight[ids] * sqrt(D), cache)."""
        return self.params["weight"][ids] * self.scale, ids

    def lookup_backward(self, dx, ids):
        # x = weight[ids] * scale
        d = dx.shape[-1]
        segment_sum_rows(ids.reshape(-1), dx.reshape(-1, d) * self.scale, self.grads["weight"])

    def project(self, h):
        """h [B, T, D] -> (logits [B, T, V] = h @ weight^T, cache)."""
        d = h.shape[-1]
        logits = h.reshape(-1, d) @ self.params["weight"].T
        return logits.reshape(*h.shape[:-1], -1), h

    def output_weight(self):
        """weight^T [D, V] as an array of its own (row-major), for decoding: h @ output_weight()
        = project(h) without the transposed view (measured faster for the few rows of a
        decoding step: docs/benchmarks.md). A copy: take it again after the weights change."""
        return xp_of(self.params["weight"]).ascontiguousarray(self.params["weight"].T)

    def project_backward(self, dlogits, h):
        """Returns dh; accumulates the projection's share of d weight."""
        v, d = self.params["weight"].shape
        dl2 = dlogits.reshape(-1, v)
        # logits = h @ weight^T
        self.grads["weight"] += dl2.T @ h.reshape(-1, d)
        return (dl2 @ self.params["weight"]).reshape(h.shape)
