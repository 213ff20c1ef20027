"""The one token embedding matrix, shared three ways (paper 3.4, joint vocabulary):
source lookup, target lookup (both multiplied by sqrt(d_model)) and the pre-softmax
projection logits = h @ weight^T. Each use caches its own inputs in the object it returns;
each backward ACCUMULATES into the same gradient, so tying needs no special code.

An output vocabulary (config `output_vocab`, not the paper's: docs/deviations.md) restricts the
projection to V_o of the V rows, ids [V_o]: logits = h @ weight[ids]^T, [N, V_o]. A joint vocabulary
holds the pieces of both languages, and the target side of the training data uses only some of
them (5,481 of 8,000 on Multi30k's German side, EOS and unknown included: docs/benchmarks.md): the others can
never be the right answer, and
scoring them is a third of the projection's work. Decoding sees them at -inf (`output_bias`).
"""
import numpy as np

from .. import functional as F
from .. import gemm
from ..backend import is_gpu, xp_of
from .base import Layer


def segment_sum_rows(ids, rows, out):
    """out[ids[n]] += rows[n] for every n (ids [n_rows], rows [n_rows, D], out [V, D]).

    CPU: one stable sort and one reduceat instead of np.add.at's slow unbuffered scatter.
    GPU: CuPy's add.at is an atomic scatter-add kernel, the fast way there (it has none for
    bfloat16: those rows are summed in float32, then added).
    """
    xp = xp_of(rows)
    if is_gpu(xp):
        if out.dtype.name == "bfloat16":
            acc = xp.zeros(out.shape, dtype=xp.float32)
            xp.add.at(acc, ids, rows.astype(xp.float32))
            out += acc.astype(out.dtype)
            return
        xp.add.at(out, ids, rows)
        return
    order = xp.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), sorted_ids[1:] != sorted_ids[:-1]]))
    out[sorted_ids[starts]] += xp.add.reduceat(rows[order], starts, axis=0)


def decoding_logits(h, w_out, bias):
    """h [rows, D] @ w_out [D, V] (TokenEmbedding.output_weight) + bias [V] (output_bias, or None):
    a decoding step's logits over all V pieces, -inf outside an output vocabulary."""
    logits = h @ w_out
    if bias is not None:
        logits += bias
    return logits


class TokenEmbedding(Layer):
    def __init__(self, vocab_size, d_model, rng, bias=False):
        super().__init__()
        self.scale = float(np.sqrt(d_model))
        # N(0, 1/d_model), standard deviation d_model^-0.5: after the sqrt(d_model) scale the embeddings have
        # unit variance
        self.params["weight"] = rng.normal(0.0, d_model ** -0.5, size=(vocab_size, d_model))
        if bias:   # logits = h @ weight^T + bias (config output_bias: Marian's logit bias; not the paper's)
            self.params["bias"] = np.zeros(vocab_size)
        self.output_ids = None     # [V_o] device ids the projection scores; None: all V
        self.column_of = None      # [V] host: each piece's column of the logits (None: the id itself)

    def use_output_vocabulary(self, ids, unk_id, xp):
        """Score only the pieces `ids` (sorted, distinct host int array [V_o], or None: all V). A gold
        piece outside them is scored as `unk_id`'s column (which must be among them): like every
        piece the training targets never hold, the model can only give it the smoothing's share."""
        if ids is None:
            self.output_ids = self.column_of = None
            return
        ids = np.asarray(ids, dtype=np.int64)
        self.column_of = np.full(self.params["weight"].shape[0], int(np.searchsorted(ids, unk_id)), dtype=np.int64)
        self.column_of[ids] = np.arange(ids.size)
        self.output_ids = xp.asarray(ids)

    def columns(self, gold):
        """Host piece ids [N] -> their columns of project's logits (the ids themselves without an
        output vocabulary)."""
        return gold if self.column_of is None else self.column_of[gold]

    def lookup(self, ids):
        """ids [B, L] int -> (x [B, L, D] = weight[ids] * sqrt(D), cache)."""
        x = self.params["weight"][ids]
        x *= self.scale            # in place, in the weight's dtype (bfloat16 too: F.scaled)
        return x, ids

    def lookup_backward(self, dx, ids):
        # x = weight[ids] * scale
        d = dx.shape[-1]
        segment_sum_rows(ids.reshape(-1), F.scaled(dx.reshape(-1, d), self.scale), self.grads["weight"])

    def _out_rows(self):
        """weight[ids] [V_o, D] (a gathered copy), or weight itself [V, D] without an output vocabulary."""
        w = self.params["weight"]
        return w if self.output_ids is None else w[self.output_ids]

    def project(self, h):
        """h [..., D] (the loss rows [N, D]) -> (logits [..., V_o] = h @ weight[ids]^T, cache); V_o = V and ids = all
        without an output vocabulary: logits = h @ weight^T."""
        d = h.shape[-1]
        logits = gemm.product(h.reshape(-1, d), self._out_rows(), trans_b=True)
        if "bias" in self.params:
            b = self.params["bias"]
            logits += b if self.output_ids is None else b[self.output_ids]
        return logits.reshape(*h.shape[:-1], -1), h

    def output_weight(self):
        """weight^T [D, V] as an array of its own (row-major), for decoding: h @ output_weight()
        (+ output_bias()) = project_all(h) without the transposed view (a product over contiguous
        rows for the few rows of a decoding step; docs/performance.md). A copy: take it again after
        the weights change."""
        return xp_of(self.params["weight"]).ascontiguousarray(self.params["weight"].T)

    def output_bias(self):
        """[V]: the logits' bias (config output_bias; else 0) on the output vocabulary's pieces,
        -inf on the others; None with neither."""
        if self.output_ids is None:
            return self.params["bias"].copy() if "bias" in self.params else None
        w = self.params["weight"]
        bias = xp_of(w).full(w.shape[0], -np.inf, dtype=w.dtype)
        bias[self.output_ids] = self.params["bias"][self.output_ids] if "bias" in self.params else 0
        return bias

    def project_all(self, h):
        """h [B, T, D] -> logits [B, T, V] over every piece, -inf outside the output vocabulary
        (the log-softmax of these is the model's distribution over all V)."""
        logits = decoding_logits(h.reshape(-1, h.shape[-1]), self.params["weight"].T, self.output_bias())
        return logits.reshape(*h.shape[:-1], -1)

    def project_backward(self, dlogits, h):
        """Returns dh; accumulates the projection's share of d weight (its rows ids only)."""
        w = self._out_rows()
        d = w.shape[1]
        dl2 = dlogits.reshape(-1, w.shape[0])
        if "bias" in self.params:
            # logits = h @ weight[ids]^T + bias[ids]
            db = F.column_sum(dl2)
            if self.output_ids is None:
                self.grads["bias"] += db
            else:
                self.grads["bias"][self.output_ids] += db
        # logits = h @ weight[ids]^T
        if self.output_ids is None:
            gemm.accumulate_xt_dy(self.grads["weight"], dl2, h.reshape(-1, d))    # += dl2^T h [V, D]
        else:
            self.grads["weight"][self.output_ids] += dl2.T @ h.reshape(-1, d)  # [V_o, D]; ids distinct: no repeats
        return gemm.product(dl2, w).reshape(h.shape)
