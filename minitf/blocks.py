"""Residual blocks and the encoder/decoder stacks (paper 3.1).

Every sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x))), and there is no LayerNorm
after either stack: the paper's post-norm. cfg.norm_position "pre" (not in the paper;
docs/deviations.md) wraps it as x + Dropout(Sublayer(LayerNorm(x))) instead and ends each
stack with a LayerNorm (`norm`), the arrangement of tensor2tensor's later versions and of
Xiong et al. (2020). Attention and ReLU dropout inside the sublayers (cfg.attention_dropout,
cfg.relu_dropout; 0 in the paper) draw their masks from the same sites, before the
sublayer's residual dropout.
"""
from . import functional as F
from .layers import Dropout, FeedForward, Layer, LayerNorm, MultiHeadAttention


def residual(x, dropout, sublayer_out, sites, rows):
    """x + Dropout(Sublayer(x)), the sum inside LayerNorm (3.1), written into the sublayer's
    output array (a fresh array nothing else holds) to save two temporaries. `sites`: the
    forward's dropout masks (functional.DropoutSites); `rows`: the positions x holds, if packed."""
    return dropout.forward_add(sublayer_out, residual=x, sites=sites, rows=rows)


def add_norm(norm, x, sublayer, last, dropout, sites, rows):
    """norm(x + dropout(sublayer(x))), the post-norm block of 3.1; `sublayer(bias)` runs the sublayer
    (bias=False: without the bias of its last Linear, `last`). On a GPU one kernel adds that bias,
    draws the dropout, makes the sum and normalizes it (LayerNorm.forward_residual); elsewhere the
    sum (written into the sublayer's output), then the LayerNorm."""
    if F.residual_layernorm_fused(x):
        return norm.forward_residual(x, sublayer(False), dropout, sites, rows, last.params["bias"])
    return norm.forward(residual(x, dropout, sublayer(True), sites, rows))


class EncoderLayer(Layer):
    def __init__(self, cfg, rng):
        super().__init__()
        d = cfg.d_model
        self.self_attn = self.add("self_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng, cfg.attention_dropout))
        self.norm1 = self.add("norm1", LayerNorm(d, cfg.layer_norm_eps))
        self.ffn = self.add("ffn", FeedForward(d, cfg.d_ff, rng, cfg.relu_dropout, cfg.activation))
        self.norm2 = self.add("norm2", LayerNorm(d, cfg.layer_norm_eps))
        self.drop1 = self.add("drop1", Dropout(cfg.dropout))
        self.drop2 = self.add("drop2", Dropout(cfg.dropout))
        self.pre = cfg.norm_position == "pre"

    def forward(self, x, src_bias, sites=None, rows=None):
        """x [B, S, D], src_bias [B, 1, 1, S] -> [B, S, D] (x [N_s, D] -> [N_s, D] with `rows`)."""
        if self.pre:
            n = self.norm1.forward(x)
            h = residual(x, self.drop1, self.self_attn.forward(n, n, src_bias, rows, rows, sites), sites, rows)
            return residual(h, self.drop2, self.ffn.forward(self.norm2.forward(h), sites, rows), sites, rows)
        sa, ffn = self.self_attn, self.ffn
        h = add_norm(self.norm1, x, lambda bias: sa.forward(x, x, src_bias, rows, rows, sites, bias), sa.out,
                     self.drop1, sites, rows)                                      # norm1(x + drop1(self_attn(x, x)))
        return add_norm(self.norm2, h, lambda bias: ffn.forward(h, sites, rows, bias), ffn.fc2, self.drop2, sites,
                        rows)                                                       # norm2(h + drop2(ffn(h)))

    def backward(self, dy):
        if self.pre:
            return self._backward_pre(dy)
        sa, ffn = self.self_attn, self.ffn
        fold = F.residual_layernorm_fused(dy)   # the LayerNorms take the sublayers' last bias gradients
        # y = norm2(h + drop2(ffn(h))): dsum for h + drop2(ffn(h)), dffn = drop2's backward of it
        dsum, dffn = self.norm2.backward(dy, dropout=self.drop2, sublayer=ffn.fc2 if fold else None)
        # h = norm1(x + drop1(self_attn(x, x))); dL/dh = ffn's gradient + the residual's dsum
        dsum, dattn = self.norm1.backward(ffn.backward(dffn, not fold), dy_residual=dsum, dropout=self.drop1,
                                          sublayer=sa.out if fold else None)
        # dL/dx = dsum (the residual) + the attention's gradients through q, k and v, added into dsum
        return sa.backward(dattn, dx_into=dsum, dkv_into=dsum, out_bias=not fold)[0]

    def _backward_pre(self, dy):
        # y = h + drop2(ffn(norm2(h)))
        dh = self.norm2.backward(self.ffn.backward(self.drop2.backward(dy)))
        dh += dy
        # h = x + drop1(self_attn(norm1(x), norm1(x)))
        dn_q, dn_kv = self.self_attn.backward(self.drop1.backward(dh))
        dn_q += dn_kv
        dx = self.norm1.backward(dn_q)
        dx += dh
        return dx


class DecoderLayer(Layer):
    def __init__(self, cfg, rng):
        super().__init__()
        d = cfg.d_model
        self.self_attn = self.add("self_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng, cfg.attention_dropout,
                                                                  causal=True))
        self.norm1 = self.add("norm1", LayerNorm(d, cfg.layer_norm_eps))
        self.cross_attn = self.add("cross_attn", MultiHeadAttention(d, cfg.n_heads, cfg.d_k, rng, cfg.attention_dropout))
        self.norm2 = self.add("norm2", LayerNorm(d, cfg.layer_norm_eps))
        self.ffn = self.add("ffn", FeedForward(d, cfg.d_ff, rng, cfg.relu_dropout, cfg.activation))
        self.norm3 = self.add("norm3", LayerNorm(d, cfg.layer_norm_eps))
        self.drop1 = self.add("drop1", Dropout(cfg.dropout))
        self.drop2 = self.add("drop2", Dropout(cfg.dropout))
        self.drop3 = self.add("drop3", Dropout(cfg.dropout))
        self.pre = cfg.norm_position == "pre"

    def forward(self, y, memory, src_bias, tgt_bias, sites=None, tgt_rows=None, src_rows=None):
        """y [B, T, D], memory [B, S, D] (encoder output), tgt_bias [B, 1, T, T] -> [B, T, D]
        (packed: y [N_t, D], memory [N_s, D] -> [N_t, D] with `tgt_rows`/`src_rows`; tgt_bias None where the
        self-attention runs on packed rows, which masks by the rows' spans)."""
        if self.pre:
            n = self.norm1.forward(y)
            h1 = residual(y, self.drop1, self.self_attn.forward(n, n, tgt_bias, tgt_rows, tgt_rows, sites),
                          sites, tgt_rows)
            a = self.cross_attn.forward(self.norm2.forward(h1), memory, src_bias, tgt_rows, src_rows, sites)
            h2 = residual(h1, self.drop2, a, sites, tgt_rows)
            return residual(h2, self.drop3, self.ffn.forward(self.norm3.forward(h2), sites, tgt_rows), sites, tgt_rows)
        sa, ca, ffn, rows = self.self_attn, self.cross_attn, self.ffn, tgt_rows
        h1 = add_norm(self.norm1, y, lambda bias: sa.forward(y, y, tgt_bias, rows, rows, sites, bias), sa.out,
                      self.drop1, sites, rows)                                     # norm1(y + drop1(self_attn(y, y)))
        h2 = add_norm(self.norm2, h1, lambda bias: ca.forward(h1, memory, src_bias, rows, src_rows, sites, bias),
                      ca.out, self.drop2, sites, rows)                             # norm2(h1 + drop2(cross_attn))
        return add_norm(self.norm3, h2, lambda bias: ffn.forward(h2, sites, rows, bias), ffn.fc2, self.drop3,
                        sites, rows)                                               # norm3(h2 + drop3(ffn(h2)))

    def backward(self, dout, dmemory_into=None):
        """Returns (dy, dmemory); with `dmemory_into` dmemory is added into that array (the sum
        over the decoder's layers) and it is returned."""
        if self.pre:
            dy, dmemory = self._backward_pre(dout)
            if dmemory_into is None:
                return dy, dmemory
            dmemory_into += dmemory
            return dy, dmemory_into
        sa, ca, ffn = self.self_attn, self.cross_attn, self.ffn
        fold = F.residual_layernorm_fused(dout)   # the LayerNorms take the sublayers' last bias gradients
        # out = norm3(h2 + drop3(ffn(h2))): dsum for h2 + drop3(ffn(h2)), dffn = drop3's backward of it
        dsum, dffn = self.norm3.backward(dout, dropout=self.drop3, sublayer=ffn.fc2 if fold else None)
        # h2 = norm2(h1 + drop2(cross_attn(h1, memory))); dL/dh2 = ffn's gradient + the residual's dsum
        dsum, dcross = self.norm2.backward(ffn.backward(dffn, not fold), dy_residual=dsum, dropout=self.drop2,
                                           sublayer=ca.out if fold else None)
        dh1, dmemory = ca.backward(dcross, dkv_into=dmemory_into, out_bias=not fold)
        # h1 = norm1(y + drop1(self_attn(y, y))); dL/dh1 = cross-attention's gradient + dsum
        dsum, dattn = self.norm1.backward(dh1, dy_residual=dsum, dropout=self.drop1, sublayer=sa.out if fold else None)
        # dL/dy = dsum (the residual) + the self-attention's gradients, added into dsum
        return sa.backward(dattn, dx_into=dsum, dkv_into=dsum, out_bias=not fold)[0], dmemory

    def _backward_pre(self, dout):
        # out = h2 + drop3(ffn(norm3(h2)))
        dh2 = self.norm3.backward(self.ffn.backward(self.drop3.backward(dout)))
        dh2 += dout
        # h2 = h1 + drop2(cross_attn(norm2(h1), memory))
        dn, dmemory = self.cross_attn.backward(self.drop2.backward(dh2))
        dh1 = self.norm2.backward(dn)
        dh1 += dh2
        # h1 = y + drop1(self_attn(norm1(y), norm1(y)))
        dn_q, dn_kv = self.self_attn.backward(self.drop1.backward(dh1))
        dn_q += dn_kv
        dy = self.norm1.backward(dn_q)
        dy += dh1
        return dy, dmemory


def add_layer_list(parent, layers):
    """Register `layers` as parent's children `layers.0`, `layers.1`, ... (the parameter names checkpoints store: `decoder.layers.0.ffn.fc1.weight`, ...)."""
    holder = parent.add("layers", Layer())
    for i, layer in enumerate(layers):
        holder.add(str(i), layer)
    return layers


def final_norm(parent, cfg):
    """The LayerNorm after a pre-norm stack (`norm`: its last sum is otherwise unnormalised); None
    for the paper's post-norm, whose layers end in one."""
    return parent.add("norm", LayerNorm(cfg.d_model, cfg.layer_norm_eps)) if cfg.norm_position == "pre" else None


class Encoder(Layer):
    """cfg.n_layers identical EncoderLayers (the paper's N, 3.1), and with pre-norm a final LayerNorm."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.layer_list = add_layer_list(self, [EncoderLayer(cfg, rng) for _ in range(cfg.n_layers)])
        self.norm = final_norm(self, cfg)

    def forward(self, x, src_bias, sites=None, rows=None):
        for layer in self.layer_list:
            x = layer.forward(x, src_bias, sites, rows)
        return x if self.norm is None else self.norm.forward(x)

    def backward(self, dy):
        if self.norm is not None:   # memory = norm(x)
            dy = self.norm.backward(dy)
        for layer in reversed(self.layer_list):
            dy = layer.backward(dy)
        return dy


class Decoder(Layer):
    """cfg.n_decoder_layers identical DecoderLayers (the paper's N, 3.1; the encoder's count unless set apart);
    every layer attends to the same encoder output; with pre-norm a final LayerNorm."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.layer_list = add_layer_list(self, [DecoderLayer(cfg, rng) for _ in range(cfg.n_decoder_layers)])
        self.norm = final_norm(self, cfg)

    def forward(self, y, memory, src_bias, tgt_bias, sites=None, tgt_rows=None, src_rows=None):
        for layer in self.layer_list:
            y = layer.forward(y, memory, src_bias, tgt_bias, sites, tgt_rows, src_rows)
        return y if self.norm is None else self.norm.forward(y)

    def backward(self, dy):
        """Returns (dy_embedded, dmemory) with dmemory summed over all layers."""
        if self.norm is not None:   # h = norm(y)
            dy = self.norm.backward(dy)
        dmemory = None
        for layer in reversed(self.layer_list):   # dmemory: the top layer's, then each one's below added into it
            dy, dmemory = layer.backward(dy, dmemory)
        return dy, dmemory
