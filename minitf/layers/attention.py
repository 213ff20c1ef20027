"""Multi-head attention (paper 3.2.2): the paper's MultiHead(Q, K, V) = Concat(head_1..head_h) W^O
(its Q, K, V: the queries, keys and values, not the legend's letters).

Head i uses columns i*K..(i+1)*K-1 of the q/k/v projections and the same rows of `out`.
Used three ways (3.2.3): encoder self-attention, masked decoder self-attention and
encoder-decoder attention. `backward` returns (dx_q, dx_kv) so the encoder output receives
the gradient of every decoder layer's cross-attention. `dropout` > 0: attention dropout on
the softmax weights while training (not in the paper; docs/deviations.md).

On a GPU (gemm.enabled) every full forward (training, the encoder's when decoding, Transformer.forward) takes `_forward_gpu`, the backward `_backward_gpu`: the same maths with
each step one kernel. The projections' rows go straight into the head-major [B, H, L, K]
layout with their bias (kernels.unpack_heads: unpack, split heads and bias add in one pass),
the six batched products (two forward, four backward) are single cuBLAS calls over the B*H
heads with the transposes as flags and 1/sqrt(d_k) as alpha (gemm.matmul), and the context
comes back to packed rows with its heads merged in one pass (kernels.pack_heads).
docs/performance.md measures it.

With MINITF_FUSED_ATTN=1 (kernels.attention_rows_ok), packed rows on both sides (packing.Spans) and no
attention dropout, the attention itself reads the projections' packed rows instead: one kernel for
the forward (kernels.attention_rows: biases, scores, mask, softmax and the weighted sum, never writing
the [B, H, T, S] weights) and one for the backward, without the head layout or the pack/unpack passes
(off by default: on an H200 the step was slower in float32 and no faster in 16 bits, docs/performance.md).
"""
import contextlib
import math
import threading
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
    of the query and key rows (or None); on the GPU path also the inputs x_q, x_kv (the
    projections' own caches are not kept there) and `weights` [B, H, T, pitch], the memory p views: its rows
    kernels.row_pitch apart."""
    q: object
    k: object
    v: object
    p: object
    drop_mask: object
    rows_q: object
    rows_kv: object
    x_q: object = None
    x_kv: object = None
    weights: object = None


def _pitched(weights, s):
    """gemm.Mat of the attention weights' rows in weights [B, H, T, pitch]: B*H matrices of T x s (kernels.row_pitch)."""
    b, h, t, pitch = weights.shape
    return gemm.Mat(weights, t, s, pitch, t * pitch)


def _dropped(weights, s, mask):
    """weights [B, H, T, pitch] itself, or with attention dropout (mask [B, H, T, S]) a new array of its shape whose
    rows' s first values are p * mask (the rest never read): the same pitch for the products."""
    if mask is None:
        return weights
    xp = F.xp_of(weights)
    out = xp.empty_like(weights)
    xp.multiply(weights[..., :s], mask, out=out[..., :s])
    return out


class RowsCache(NamedTuple):
    """What the backward of attention on packed rows (kernels.attention_rows) needs: the projections'
    outputs before their biases, q [rows_q, H*K] (the query side's kept rows: N_t in the decoder, N_s in
    the encoder) and k, v [rows_kv, H*K] (the key side's: in a self-attention the same rows), the biases
    (bq, bk, bv), the output out [rows_q, H*K] and its lse [H, rows_q], the two sides' packing.Rows and the
    inputs x_q, x_kv."""
    q: object
    k: object
    v: object
    biases: tuple
    out: object
    lse: object
    rows_q: object
    rows_kv: object
    x_q: object
    x_kv: object


class MultiHeadAttention(Layer):
    def __init__(self, d_model, n_heads, d_k, rng, dropout=0.0, causal=False):
        """causal: the bias this layer is given masks later positions (the decoder's self-attention);
        the attention on packed rows applies that mask itself."""
        super().__init__()
        self.n_heads, self.d_k, self.causal = n_heads, d_k, causal
        self.scale = 1.0 / math.sqrt(d_k)
        self.q = self.add("q", Linear(d_model, n_heads * d_k, rng))
        self.k = self.add("k", Linear(d_model, n_heads * d_k, rng))
        self.v = self.add("v", Linear(d_model, n_heads * d_k, rng))
        self.out = self.add("out", Linear(n_heads * d_k, d_model, rng))
        self.drop = self.add("drop", Dropout(dropout))   # its mask (draw) is applied by the attention itself

    def forward(self, x_q, x_kv, bias, rows_q=None, rows_kv=None, sites=None, out_bias=True):
        """x_q [B, T, D] queries, x_kv [B, S, D] keys/values (T, S: the query and key lengths, as
        cross-attention's; S = T = L in self-attention), bias broadcastable to [B, H, T, S].
        out_bias=False: the output projection's bias is left to the caller's next pass (a post-norm
        block's fused sum and LayerNorm, blocks.add_norm); backward is the same.

        With `rows_q`/`rows_kv` (packing.Rows) x_q and x_kv are their sides' kept rows ([N_t, D] or [N_s, D]): only the
        non-pad positions, unpacked to [B, ., .] around the attention itself. `sites`
        (functional.DropoutSites): the attention-dropout mask, drawn on [B, H, T, S] in
        either layout, when training with dropout > 0.
        """
        F.check_attention_bias(bias)
        if gemm.enabled(x_q):
            return self._forward_gpu(x_q, x_kv, bias, rows_q, rows_kv, sites, out_bias)
        h = self.n_heads
        q = F.split_heads(unpack(rows_q, self.q.forward(x_q)), h)
        k = F.split_heads(unpack(rows_kv, self.k.forward(x_kv)), h)
        v = F.split_heads(unpack(rows_kv, self.v.forward(x_kv)), h)
        mask = self.drop.draw(sites, q.shape[:-1] + k.shape[-2:-1], q.dtype, F.xp_of(q))
        keep = self.training or keeps_maps()   # p [B, H, T, S] for a backward, or attention plots
        ctx, p = F.attention_forward(q, k, v, bias, self.scale, mask, keep_p=keep)
        self.cache = AttentionCache(q, k, v, p, mask, rows_q, rows_kv) if keep else None
        return self.out.forward(pack(rows_q, F.merge_heads(ctx)), out_bias)

    def backward(self, dy, dx_into=None, dkv_into=None, out_bias=True):
        """(dx_q, dx_kv). `dx_into` / `dkv_into`: arrays (the caller's own, shaped like x_q / x_kv)
        the gradients are added into instead, and returned: a residual's gradient, or the
        gradient of memory summed over the decoder's layers; the same array for both when x_q is
        x_kv (self-attention: then both returned are that array, holding the whole gradient). On a
        GPU each addition is a GEMM's beta = 1. out_bias=False: the output projection's bias
        gradient is the caller's (Linear.backward's bias)."""
        if self.cache is None:
            self.take_cache()   # raises: no forward to go back through
        if gemm.enabled(dy):
            return self._backward_gpu(dy, dx_into, dkv_into, out_bias)
        q, k, v, p, mask, rows_q, rows_kv = self.take_cache()[:7]   # the inputs are the projections' caches here
        h = self.n_heads
        # y = out(pack(merge_heads(ctx)))
        dctx = F.split_heads(unpack(rows_q, self.out.backward(dy, bias=out_bias)), h)
        # ctx = attention(q, k, v), with the forward's dropout mask
        dq, dk, dv = F.attention_backward(dctx, q, k, v, p, self.scale, mask)
        # q = split(unpack(q(x_q))), k = split(unpack(k(x_kv))), v = split(unpack(v(x_kv)))
        dx_q = self.q.backward(pack(rows_q, F.merge_heads(dq)), dx_into)
        dx_kv = self.k.backward(pack(rows_kv, F.merge_heads(dk)), dkv_into)
        return dx_q, self.v.backward(pack(rows_kv, F.merge_heads(dv)), dx_kv)

    # -- the GPU training path: the forward and backward above, one kernel a step --
    def _stride(self, names, kind):
        """Elements between the `kind` arrays ('params' or 'grads') of the projections `names`,
        when their weights and biases lie evenly spaced in one buffer (the model's flat buffers,
        in named_parameters' order: q.weight, q.bias, k.weight, ...); else None."""
        ws = [getattr(getattr(self, n), kind)["weight"] for n in names]
        bs = [getattr(getattr(self, n), kind)["bias"] for n in names]
        step = ws[1].data.ptr - ws[0].data.ptr
        even = all(w.dtype == ws[0].dtype and w.flags.c_contiguous and w.data.ptr == ws[0].data.ptr + i * step
                   and b.data.ptr == bs[0].data.ptr + i * step for i, (w, b) in enumerate(zip(ws, bs)))
        return step // ws[0].itemsize if even and step > 0 and step % ws[0].itemsize == 0 else None

    def _products(self, x, names):
        """(outs, stride): x @ W of the projections `names` (x [N_t, D] or [N_s, D] packed rows, or [B, L, D];
        biases not added): outs [parts, rows, H*K] from ONE strided-batched GEMM over the stacked weights when they lie
        evenly spaced (stride: the elements between them), else a list of one product each (stride None)."""
        lins = [getattr(self, n) for n in names]
        stride = self._stride(names, "params") if len(names) > 1 else None
        if stride is None:
            x2 = x.reshape(-1, x.shape[-1])
            return [gemm.product(x2, lin.params["weight"]) for lin in lins], None
        xp = F.xp_of(x)
        x2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        w0 = lins[0].params["weight"]
        n, d = x2.shape
        out = xp.empty((len(names), n, w0.shape[1]), dtype=x2.dtype)
        # out[i] = x @ W_i: x shared (batch stride 0), W_i `stride` elements apart in the flat buffer
        gemm.matmul(gemm.Mat(x2, n, d, d, 0), gemm.Mat(w0, d, w0.shape[1], w0.shape[1], stride), out, batch=len(names))
        return out, stride

    def _project_heads(self, x, rows, names):
        """The heads [B, H, L, K] of the projections `names` of x ([N_t, D] or [N_s, D] packed with rows, or
        [B, L, D]), biases added: ONE strided-batched GEMM over the stacked weights and ONE
        unpack for all of them when they lie evenly spaced (kernels.unpack_heads), else one each."""
        b, length = rows.shape if rows is not None else x.shape[:2]
        inverse = None if rows is None else rows.inverse
        lins = [getattr(self, n) for n in names]
        outs, stride = self._products(x, names)
        if stride is None:
            return [kernels.unpack_heads(out, lin.params["bias"], inverse, b, length, self.n_heads)
                    for out, lin in zip(outs, lins)]
        return list(kernels.unpack_heads(outs, lins[0].params["bias"], inverse, b, length, self.n_heads, stride))

    def _project_backward(self, x, names, packed, into, group):
        """Backward of _products (and of the biases added after them): packed [parts, rows, H*K] (one buffer),
        the gradients of the projections' outputs -> their weight and bias gradients accumulated, and
        projection i's input gradient added into into[group[i]] (an array, or None for a fresh one);
        returns `into`, filled."""
        lins = [getattr(self, n) for n in names]
        xp = F.xp_of(packed)
        x2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        n, d = x2.shape
        stride = self._stride(names, "grads") if len(names) > 1 else None
        if stride is not None:   # dW_i += x^T dY_i for every i in one GEMM (split-K: gemm.accumulate_at_b)
            g0 = lins[0].grads["weight"]
            gemm.accumulate_at_b(gemm.Mat(x2, n, d, d, 0), packed, gemm.Mat(g0, d, g0.shape[1], g0.shape[1], stride),
                                 batch=len(names))
            # db_i += the column sums of dY_i, every i in one launch (the biases lie `stride` apart too)
            kernels.column_sums_planes(packed, lins[0].grads["bias"], stride)
        into = list(into)
        for i, lin in enumerate(lins):
            w = lin.params["weight"]
            if stride is None:
                gemm.accumulate_xt_dy(lin.grads["weight"], x2, packed[i])
                kernels.column_sums(packed[i], out=lin.grads["bias"])
            j = group[i]
            if into[j] is None:    # a fresh dx = dY_i W_i^T (beta = 0), the next ones added into it
                into[j] = gemm.matmul(packed[i], w, xp.empty((n, d), dtype=x2.dtype), trans_b=True).reshape(x.shape)
            else:
                gemm.matmul(packed[i], w, into[j].reshape(n, d), trans_b=True, beta=1.0)
        return into

    def _forward_gpu(self, x_q, x_kv, bias, rows_q, rows_kv, sites, out_bias=True):
        if self._on_rows(x_q, rows_q, rows_kv, sites):
            return self._forward_rows(x_q, x_kv, rows_q, rows_kv, out_bias)
        if x_q is x_kv:       # self-attention: q, k and v of one input, together
            q, k, v = self._project_heads(x_q, rows_q, ("q", "k", "v"))
        else:
            (q,) = self._project_heads(x_q, rows_q, ("q",))
            k, v = self._project_heads(x_kv, rows_kv, ("k", "v"))
        xp = F.xp_of(q)
        b, h, t, s = q.shape[:3] + k.shape[2:3]
        mask = self.drop.draw(sites, (b, h, t, s), q.dtype, xp)
        # scores = (q * scale) @ k^T, then p = softmax(scores + bias) in place: rows of s values kernels.row_pitch
        # apart in `weights` [B, H, T, pitch], p the view of their values
        weights = xp.empty((b, h, t, kernels.row_pitch(s, q.dtype)), dtype=q.dtype)
        gemm.matmul(q, k, _pitched(weights, s), trans_b=True, alpha=self.scale, batch=b * h)
        kernels.masked_softmax(weights, bias, out=weights, n=s)
        # ctx = p @ v, or (p * mask) @ v
        p = weights[..., :s]
        ctx = gemm.matmul(_pitched(_dropped(weights, s, mask), s), v, xp.empty_like(q), batch=b * h)
        self.cache = AttentionCache(q, k, v, p, mask, rows_q, rows_kv, x_q, x_kv, weights) \
            if self.training or keeps_maps() else None
        return self.out.forward(self._merged(ctx, rows_q, x_q), out_bias)

    def _merged(self, x, rows, like):
        """x [B, H, L, K] -> packed rows [rows, H*K] (rows), or [B, L, H*K] shaped like `like`."""
        out = kernels.pack_heads(x, None if rows is None else rows.index)
        return out if rows is not None else out.reshape(like.shape[:-1] + out.shape[-1:])

    def _backward_gpu(self, dy, dx_into, dkv_into, out_bias=True):
        if type(self.cache) is RowsCache:
            return self._backward_rows(dy, dx_into, dkv_into, out_bias)
        x_q, x_kv = self.cache.x_q, self.cache.x_kv
        # the head layout's buffers (p, the weights' gradient, the heads' gradients) go when this returns
        dq, dqkv = self._heads_backward(dy, out_bias)
        return self._inputs_backward(x_q, x_kv, dq, dqkv, dx_into, dkv_into)

    def _heads_backward(self, dy, out_bias):
        """(dq, dqkv): the gradients of the projections' outputs, in packed rows as _inputs_backward takes
        them, from dy through the head layout (the forward's AttentionCache)."""
        q, k, v, p, mask, rows_q, rows_kv, x_q, x_kv, weights = self.cache
        self.cache = None
        xp = F.xp_of(q)
        b, h, t, s = p.shape
        self_attention = x_q is x_kv
        # the gradients of q, k, v written into one buffer, as the projections' backward reads them
        dqkv = xp.empty((3 if self_attention else 2,) + k.shape, dtype=q.dtype)
        dq = dqkv[0] if self_attention else xp.empty_like(q)
        dk, dv = dqkv[-2], dqkv[-1]
        # y = out(pack_heads(ctx))
        dctx = kernels.unpack_heads(self.out.backward(dy, bias=out_bias), None, None if rows_q is None else
                                    rows_q.inverse, b, t, h)
        # ctx = pm @ v with pm = p (or p * mask); p's rows (and dp's, ds's) as the forward's: row_pitch apart
        gemm.matmul(_pitched(_dropped(weights, s, mask), s), dctx, dv, trans_a=True, batch=b * h)
        dweights = xp.empty_like(weights)
        gemm.matmul(dctx, v, _pitched(dweights, s), trans_b=True, batch=b * h)
        if mask is not None:
            dweights[..., :s] *= mask
        # p = softmax(scores + bias)
        kernels.softmax_backward(dweights, weights, out=dweights, n=s)
        ds = _pitched(dweights, s)
        # scores = (q * scale) @ k^T
        gemm.matmul(ds, k, dq, alpha=self.scale, batch=b * h)
        gemm.matmul(ds, q, dk, trans_a=True, alpha=self.scale, batch=b * h)
        # q, k, v = the projections' heads (_project_heads): their gradients back in packed rows
        if self_attention:
            packed = self._packed(dqkv, rows_q, 3)
            return packed[0], packed
        return self._packed(dq, rows_q, 1)[0], self._packed(dqkv, rows_kv, 2)

    @staticmethod
    def _packed(dheads, rows, parts):
        """dheads [parts, B, H, L, K] (or [B, H, L, K] for one) -> [parts, rows, H*K]: the kept rows (N_t or
        N_s of them, or B * L), heads merged."""
        packed = kernels.pack_heads(dheads if parts > 1 else dheads.reshape(dheads.shape[-4:]),
                                    None if rows is None else rows.index)
        return packed.reshape(parts, -1, packed.shape[-1])

    def _inputs_backward(self, x_q, x_kv, dq, dqkv, dx_into, dkv_into):
        """(dx_q, dx_kv) from the gradients of the projections' outputs, one row per row of x_q or x_kv: dq
        [rows_q, H*K] and dqkv [3, rows_q, H*K] (q, k, v of a self-attention, dq its first part) or
        [2, rows_kv, H*K] (k, v of a cross-attention), rows_q and rows_kv the query and key sides' rows (N_t
        or N_s packed; B * T or B * S where a side is not packed)."""
        if x_q is x_kv and dx_into is not None and dx_into is dkv_into:   # one gradient, one array
            (dx,) = self._project_backward(x_q, ("q", "k", "v"), dqkv, [dx_into], (0, 0, 0))
            return dx, dx
        if x_q is x_kv:
            dx_q, dx_kv = self._project_backward(x_q, ("q", "k", "v"), dqkv, [dx_into, dkv_into], (0, 1, 1))
            return dx_q, dx_kv
        (dx_q,) = self._project_backward(x_q, ("q",), dq[None], [dx_into], (0,))
        (dx_kv,) = self._project_backward(x_kv, ("k", "v"), dqkv, [dkv_into], (0, 0))
        return dx_q, dx_kv

    # -- attention on packed rows (kernels.attention_rows): no head layout, no [B, H, T, S] weights --
    def _on_rows(self, x, rows_q, rows_kv, sites):
        """Whether this forward runs on packed rows: kernels.attention_rows_ok, both sides packed with
        packing.Spans, and no attention dropout (its mask lives on [B, H, T, S])."""
        return (rows_q is not None and rows_kv is not None and kernels.attention_rows_ok(x, self.d_k)
                and not self.drop.active(sites) and rows_q.spans is not None and rows_kv.spans is not None)

    def _forward_rows(self, x_q, x_kv, rows_q, rows_kv, out_bias):
        if x_q is x_kv:       # q, k and v of one input, together
            q, k, v = self._products(x_q, ("q", "k", "v"))[0]
        else:
            (q,) = self._products(x_q, ("q",))[0]
            k, v = self._products(x_kv, ("k", "v"))[0]
        biases = tuple(getattr(self, n).params["bias"] for n in ("q", "k", "v"))
        # out = softmax(q k^T * scale + mask) v per sentence and head, heads side by side in packed rows
        out, lse = kernels.attention_rows(q, k, v, biases, rows_q.spans, rows_kv.spans, self.n_heads, self.causal,
                                          self.scale)
        self.cache = RowsCache(q, k, v, biases, out, lse, rows_q, rows_kv, x_q, x_kv)
        return self.out.forward(out, out_bias)

    def _backward_rows(self, dy, dx_into, dkv_into, out_bias):
        q, k, v, biases, out, lse, rows_q, rows_kv, x_q, x_kv = self.cache
        self.cache = None
        xp = F.xp_of(q)
        # y = self.out(out)
        dout = self.out.backward(dy, bias=out_bias)
        # out = attention_rows(q, k, v): the gradients of q, k, v into one buffer, as _project_backward reads them
        dqkv = xp.empty((3 if x_q is x_kv else 2,) + k.shape, dtype=q.dtype)
        dq = dqkv[0] if x_q is x_kv else xp.empty_like(q)
        kernels.attention_rows_backward(dout, out, lse, q, k, v, biases, rows_q.spans, rows_kv.spans, self.n_heads,
                                        self.causal, self.scale, dq, dqkv[-2], dqkv[-1])
        return self._inputs_backward(x_q, x_kv, dq, dqkv, dx_into, dkv_into)

    # -- inference (incremental.StepCache, read by decoder_layer_step): keys/values computed once and reused, no caches kept --
    def project_kv(self, x_kv):
        """x_kv [B, S, D] -> (k, v) each [B, H, S, K]."""
        h = self.n_heads
        return F.split_heads(self.k.apply(x_kv), h), F.split_heads(self.v.apply(x_kv), h)


_MAPS = threading.local()   # .off: how many maps_off blocks this thread is in


def keeps_maps():
    """Whether a forward in this thread keeps its attention weights (outside maps_off, or in training)."""
    return not getattr(_MAPS, "off", 0)


@contextlib.contextmanager
def maps_off():
    """For the block, the attention layers' forwards in this thread, in eval mode, keep no softmax weights
    p [B, H, T, S] (no backward follows: decoding's encoder, a loss alone) and make them a block of queries at a time
    (functional.attention_forward's keep_p=False): a forward's memory then grows with T * S by one block, not by every
    layer's weights (a line of 30,084 characters had held 3.35 GB of them while it was decoded; docs/data.md). The
    same outputs, to float rounding. On a GPU the weights are made whole as before, a layer's at a time (none kept).
    Per thread: searches side by side share one model."""
    _MAPS.off = getattr(_MAPS, "off", 0) + 1
    try:
        yield
    finally:
        _MAPS.off -= 1
