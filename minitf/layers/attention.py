"""Multi-head attention (paper 3.2.2): MultiHead(Q, K, V) = Concat(head_1..head_h) W^O.

Head i uses columns i*K..(i+1)*K-1 of the q/k/v projections and the same rows of `out`.
Used three ways (3.2.3): encoder self-attention, masked decoder self-attention and
encoder-decoder attention. `backward` returns (dx_q, dx_kv) so the encoder output receives
the gradient of every decoder layer's cross-attention. `dropout` > 0: attention dropout on
the softmax weights while training (not in the paper; docs/deviations.md).

On a GPU (gemm.enabled) training takes `_forward_gpu`/`_backward_gpu`: the same maths with
each step one kernel. The projections' rows go straight into the head-major [B, H, L, K]
layout with their bias (kernels.unpack_heads: unpack, split heads and bias add in one pass),
the four batched products are single cuBLAS calls over the B*H heads with the transposes as
flags and 1/sqrt(d_k) as alpha (gemm.matmul), and the context comes back to packed rows with
its heads merged in one pass (kernels.pack_heads). docs/performance.md measures it.
"""
import math
from typing import NamedTuple

from .. import functional as F
from .. import gemm, kernels
from ..packing import pack, unpack
from .base import Layer
from .dropout import Dropout
from .linear import Linear


class AttentionCache(NamedTuple):
    """What MultiHeadAttention.backward needs: q [B, H, T, K], k and v [B, H, S, K] (heads
    split), p [B, H, T, S], the attention-dropout mask [B, H, T, S] (or None), and the packing
    of the query and key rows (or None)."""
    q: object
    k: object
    v: object
    p: object
    drop_mask: object
    rows_q: object
    rows_kv: object


class MultiHeadAttention(Layer):
    def __init__(self, d_model, n_heads, d_k, rng, dropout=0.0):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_k
        self.scale = 1.0 / math.sqrt(d_k)
        self.q = self.add("q", Linear(d_model, n_heads * d_k, rng))
        self.k = self.add("k", Linear(d_model, n_heads * d_k, rng))
        self.v = self.add("v", Linear(d_model, n_heads * d_k, rng))
        self.out = self.add("out", Linear(n_heads * d_k, d_model, rng))
        self.drop = self.add("drop", Dropout(dropout))   # its mask is applied inside attention_forward

    def forward(self, x_q, x_kv, bias, rows_q=None, rows_kv=None, stream=None):
        """x_q [B, T, D] queries, x_kv [B, S, D] keys/values, bias broadcastable to [B, H, T, S].

        With `rows_q`/`rows_kv` (packing.Rows) x_q is [Nq, D] and x_kv [Nkv, D]: only the
        non-pad positions, unpacked to [B, ., .] around the attention itself. `stream`
        (functional.DropoutStream): the attention-dropout mask, drawn on [B, H, T, S] in
        either layout, when training with dropout > 0.
        """
        if gemm.enabled(x_q):
            return self._forward_gpu(x_q, x_kv, bias, rows_q, rows_kv, stream)
        h = self.n_heads
        q = F.split_heads(unpack(rows_q, self.q.forward(x_q)), h)
        k = F.split_heads(unpack(rows_kv, self.k.forward(x_kv)), h)
        v = F.split_heads(unpack(rows_kv, self.v.forward(x_kv)), h)
        mask = self.drop.draw(stream, q.shape[:-1] + k.shape[-2:-1], q.dtype, F.xp_of(q))
        ctx, p = F.attention_forward(q, k, v, bias, self.scale, mask)
        self.cache = AttentionCache(q, k, v, p, mask, rows_q, rows_kv)
        return self.out.forward(pack(rows_q, F.merge_heads(ctx)))

    def backward(self, dy, dx_into=None, dkv_into=None):
        """(dx_q, dx_kv). `dx_into` / `dkv_into`: arrays (the caller's own, shaped like x_q / x_kv)
        the gradients are added into instead, and returned: a residual's gradient, or the
        gradient of memory summed over the decoder's layers; the same array for both when x_q is
        x_kv (self-attention). On a GPU each addition is a GEMM's beta = 1."""
        if gemm.enabled(dy):
            return self._backward_gpu(dy, dx_into, dkv_into)
        q, k, v, p, mask, rows_q, rows_kv = self.cache
        self.cache = None
        h = self.n_heads
        # y = out(pack(merge_heads(ctx)))
        dctx = F.split_heads(unpack(rows_q, self.out.backward(dy)), h)
        # ctx = attention(q, k, v), with the forward's dropout mask
        dq, dk, dv = F.attention_backward(dctx, q, k, v, p, self.scale, mask)
        # q = split(unpack(q(x_q))), k = split(unpack(k(x_kv))), v = split(unpack(v(x_kv)))
        dx_q = self.q.backward(pack(rows_q, F.merge_heads(dq)), dx_into)
        dx_kv = self.k.backward(pack(rows_kv, F.merge_heads(dk)), dkv_into)
        return dx_q, self.v.backward(pack(rows_kv, F.merge_heads(dv)), dx_kv)

    # -- the GPU training path: the forward and backward above, one kernel a step --
    def _heads(self, linear, x, rows):
        """x [N, D] packed (rows) or [B, L, D] -> the projection's heads [B, H, L, K], bias added."""
        b, length = rows.shape if rows is not None else x.shape[:2]
        return kernels.unpack_heads(linear.project(x), linear.params["bias"], None if rows is None else rows.inverse,
                                    b, length, self.n_heads)

    def _merged(self, x, rows, like):
        """x [B, H, L, K] -> packed rows [N, H*K] (rows), or [B, L, H*K] shaped like `like`."""
        out = kernels.pack_heads(x, None if rows is None else rows.index)
        return out if rows is not None else out.reshape(like.shape[:-1] + out.shape[-1:])

    def _forward_gpu(self, x_q, x_kv, bias, rows_q, rows_kv, stream):
        q, k, v = self._heads(self.q, x_q, rows_q), self._heads(self.k, x_kv, rows_kv), self._heads(self.v, x_kv, rows_kv)
        xp = F.xp_of(q)
        b, h, t, s = q.shape[:3] + k.shape[2:3]
        mask = self.drop.draw(stream, (b, h, t, s), q.dtype, xp)
        # scores = (q * scale) @ k^T, then p = softmax(scores + bias) in place
        p = gemm.matmul(q, k, xp.empty((b, h, t, s), dtype=q.dtype), trans_b=True, alpha=self.scale, batch=b * h)
        kernels.masked_softmax(p, bias, out=p)
        # ctx = p @ v, or (p * mask) @ v
        ctx = gemm.matmul(p if mask is None else p * mask, v, xp.empty_like(q), batch=b * h)
        self.cache = AttentionCache(q, k, v, p, mask, rows_q, rows_kv)
        return self.out.forward(self._merged(ctx, rows_q, x_q))

    def _backward_gpu(self, dy, dx_into, dkv_into):
        q, k, v, p, mask, rows_q, rows_kv = self.cache
        self.cache = None
        xp = F.xp_of(q)
        b, h, t, s = p.shape
        # y = out(pack_heads(ctx))
        dctx = kernels.unpack_heads(self.out.backward(dy), None, None if rows_q is None else rows_q.inverse, b, t, h)
        # ctx = pm @ v with pm = p (or p * mask)
        pm = p if mask is None else p * mask
        dv = gemm.matmul(pm, dctx, xp.empty_like(v), trans_a=True, batch=b * h)
        dp = gemm.matmul(dctx, v, xp.empty_like(p), trans_b=True, batch=b * h)
        if mask is not None:
            dp *= mask
        # p = softmax(scores + bias)
        ds = kernels.softmax_backward(dp, p, out=dp)
        # scores = (q * scale) @ k^T
        dq = gemm.matmul(ds, k, xp.empty_like(q), alpha=self.scale, batch=b * h)
        dk = gemm.matmul(ds, q, xp.empty_like(k), trans_a=True, alpha=self.scale, batch=b * h)
        # q, k, v = unpack_heads(q(x_q)), unpack_heads(k(x_kv)), unpack_heads(v(x_kv))
        dx_q = self.q.backward(self._merged(dq, rows_q, dq[:, 0]), dx_into)
        dx_kv = self.k.backward(self._merged(dk, rows_kv, dk[:, 0]), dkv_into)
        return dx_q, self.v.backward(self._merged(dv, rows_kv, dv[:, 0]), dx_kv)

    # -- inference (blocks.decoder_layer_step): keys/values computed once and reused, no caches kept --
    def project_kv(self, x_kv):
        """x_kv [B, S, D] -> (k, v) each [B, H, S, K]."""
        h = self.n_heads
        return F.split_heads(self.k.apply(x_kv), h), F.split_heads(self.v.apply(x_kv), h)
