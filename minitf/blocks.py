"""Post-norm residual blocks and the encoder/decoder stacks (paper 3.1).

Every sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x))). There is no final
LayerNorm after either stack (the paper's post-norm; see docs/deviations.md).
"""
from . import functional as F
from .layers import Dropout, FeedForward, Layer, LayerNorm, MultiHeadAttention


def residual(x, dropout, sublayer_out, rng):
    """x + Dropout(Sublayer(x)), the sum inside LayerNorm (3.1), written into the sublayer's
    output array (a fresh array nothing else holds) to save two temporaries."""
    return dropout.forward_add(sublayer_out, x, rng)


class EncoderLayer(Layer):
    def __init__(self, cfg, rng):
        super().__init__()
        d = cfg.d_model
        self.self_attn = self.add("self_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng))
        self.norm1 = self.add("norm1", LayerNorm(d, cfg.layer_norm_eps))
        self.ffn = self.add("ffn", FeedForward(d, cfg.d_ff, rng))
        self.norm2 = self.add("norm2", LayerNorm(d, cfg.layer_norm_eps))
        self.drop1 = self.add("drop1", Dropout(cfg.dropout))
        self.drop2 = self.add("drop2", Dropout(cfg.dropout))

    def forward(self, x, src_bias, rng=None, rows=None):
        """x [B, S, D], src_bias [B, 1, 1, S] -> [B, S, D] (x [Ns, D] -> [Ns, D] with `rows`)."""
        h = self.norm1.forward(residual(x, self.drop1, self.self_attn.forward(x, x, src_bias, rows, rows), rng))
        return self.norm2.forward(residual(h, self.drop2, self.ffn.forward(h), rng))

    def backward(self, dy):
        # y = norm2(h + drop2(ffn(h)))
        dsum = self.norm2.backward(dy)
        dh = self.ffn.backward(self.drop2.backward(dsum))
        dh += dsum
        # h = norm1(x + drop1(self_attn(x, x)))
        dsum = self.norm1.backward(dh)
        dq, dkv = self.self_attn.backward(self.drop1.backward(dsum))
        dq += dkv
        dq += dsum
        return dq


class DecoderLayer(Layer):
    def __init__(self, cfg, rng):
        super().__init__()
        d = cfg.d_model
        self.self_attn = self.add("self_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng))
        self.norm1 = self.add("norm1", LayerNorm(d, cfg.layer_norm_eps))
        self.cross_attn = self.add("cross_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng))
        self.norm2 = self.add("norm2", LayerNorm(d, cfg.layer_norm_eps))
        self.ffn = self.add("ffn", FeedForward(d, cfg.d_ff, rng))
        self.norm3 = self.add("norm3", LayerNorm(d, cfg.layer_norm_eps))
        self.drop1 = self.add("drop1", Dropout(cfg.dropout))
        self.drop2 = self.add("drop2", Dropout(cfg.dropout))
        self.drop3 = self.add("drop3", Dropout(cfg.dropout))

    def forward(self, y, memory, src_bias, tgt_bias, rng=None, tgt_rows=None, src_rows=None):
        """y [B, T, D], memory [B, S, D] (encoder output), tgt_bias [B, 1, T, T] -> [B, T, D]
        (packed: y [Nt, D], memory [Ns, D] -> [Nt, D] with `tgt_rows`/`src_rows`)."""
        h1 = self.norm1.forward(residual(y, self.drop1, self.self_attn.forward(y, y, tgt_bias, tgt_rows, tgt_rows), rng))
        h2 = self.norm2.forward(residual(h1, self.drop2, self.cross_attn.forward(h1, memory, src_bias, tgt_rows, src_rows),
                                         rng))
        return self.norm3.forward(residual(h2, self.drop3, self.ffn.forward(h2), rng))

    def backward(self, dout):
        """Returns (dy, dmemory)."""
        # out = norm3(h2 + drop3(ffn(h2)))
        dsum = self.norm3.backward(dout)
        dh2 = self.ffn.backward(self.drop3.backward(dsum))
        dh2 += dsum
        # h2 = norm2(h1 + drop2(cross_attn(h1, memory)))
        dsum = self.norm2.backward(dh2)
        dh1, dmemory = self.cross_attn.backward(self.drop2.backward(dsum))
        dh1 += dsum
        # h1 = norm1(y + drop1(self_attn(y, y)))
        dsum = self.norm1.backward(dh1)
        dq, dkv = self.self_attn.backward(self.drop1.backward(dsum))
        dq += dkv
        dq += dsum
        return dq, dmemory


class StepCache:
    """What one DecoderLayer keeps between decoding steps (decode.IncrementalDecoder).

    k, v [N, H, T_max, K]: the self-attention keys/values of every row's positions so far
    (position t is written at step t); ck, cv [n, H, S, K]: the encoder output's
    cross-attention keys/values, computed once per sentence (the `beam` rows of a sentence
    share them); w_qkv [D, 3 HK], b_qkv [3 HK]: the self-attention's q, k, v projections
    side by side, so the new position needs one matmul instead of three."""
    __slots__ = ("k", "v", "ck", "cv", "w_qkv", "b_qkv")

    def __init__(self, layer, memory, rows, max_steps, xp, dtype):
        sa, h, d_k = layer.self_attn, layer.self_attn.n_heads, layer.self_attn.d_k
        self.k = xp.empty((rows, h, max_steps, d_k), dtype)
        self.v = xp.empty((rows, h, max_steps, d_k), dtype)
        self.ck, self.cv = layer.cross_attn.project_kv(memory)
        self.w_qkv = xp.concatenate([sa.q.params["weight"], sa.k.params["weight"], sa.v.params["weight"]], axis=1)
        self.b_qkv = xp.concatenate([sa.q.params["bias"], sa.k.params["bias"], sa.v.params["bias"]])


def decoder_layer_step(layer, x, cache, t, src_bias, beam=1):
    """Incremental (KV-cached) DecoderLayer forward for one new position t, inference only.

    x [N, 1, D]: the new position of each of N = n sentences x `beam` rows (sentence-major);
    cache: this layer's StepCache; src_bias [n, 1, 1, S]. Equals row t of
    DecoderLayer.forward on the whole prefix: the cache holds only positions <= t, so no
    causal mask is needed.
    """
    sa, ca = layer.self_attn, layer.cross_attn
    n_rows, _, d = x.shape
    # q, k, v = x Wq, x Wk, x Wv in one matmul; k, v of position t join the cache
    q, k, v = (F.split_heads(part, sa.n_heads) for part in
               F.split_last(F.linear_forward(x, cache.w_qkv, cache.b_qkv), 3))          # each [N, H, 1, K]
    cache.k[:, :, t: t + 1] = k
    cache.v[:, :, t: t + 1] = v
    h1 = layer.norm1.apply(x + sa.attend_heads(q, cache.k[:, :, : t + 1], cache.v[:, :, : t + 1], 0.0))
    # cross-attention: the beams of a sentence are the queries of one [beam, S] attention
    h1 = h1.reshape(n_rows // beam, beam, d)
    h2 = layer.norm2.apply(h1 + ca.attend(h1, cache.ck, cache.cv, src_bias))
    return layer.norm3.apply(h2 + layer.ffn.apply(h2)).reshape(n_rows, 1, d)


def add_layer_list(parent, layers):
    """Register `layers` as parent's children `layers.0`, `layers.1`, ... (the contract's names)."""
    holder = parent.add("layers", Layer())
    for i, layer in enumerate(layers):
        holder.add(str(i), layer)
    return layers


class Encoder(Layer):
    """N identical EncoderLayers (3.1)."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.layers_ = add_layer_list(self, [EncoderLayer(cfg, rng) for _ in range(cfg.n_layers)])

    def forward(self, x, src_bias, rng=None, rows=None):
        for layer in self.layers_:
            x = layer.forward(x, src_bias, rng, rows)
        return x

    def backward(self, dy):
        for layer in reversed(self.layers_):
            dy = layer.backward(dy)
        return dy


class Decoder(Layer):
    """N identical DecoderLayers (3.1); every layer attends to the same encoder output."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.layers_ = add_layer_list(self, [DecoderLayer(cfg, rng) for _ in range(cfg.n_layers)])

    def forward(self, y, memory, src_bias, tgt_bias, rng=None, tgt_rows=None, src_rows=None):
        for layer in self.layers_:
            y = layer.forward(y, memory, src_bias, tgt_bias, rng, tgt_rows, src_rows)
        return y

    def backward(self, dy):
        """Returns (dy_embedded, dmemory) with dmemory summed over all layers."""
        dmemory = None
        for layer in reversed(self.layers_):
            dy, dm = layer.backward(dy)
            if dmemory is None:
                dmemory = dm
            else:
                dmemory += dm
        return dy, dmemory
