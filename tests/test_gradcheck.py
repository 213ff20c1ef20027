"""Every backward pass against central differences, in float64, relative error <= 1e-6.

Each test checks every parameter gradient and every float input gradient of one layer
(or of the whole model), with padding and causal masks where they apply. The gradient buffers
hold random values before each backward, which must add to them (+=, never =); the parameters are moved off their
initial values first (a wrong term that vanishes at zero biases and unit gains must show), and a gradient that is 0
both ways fails but for the key projection's bias, whose true gradient is 0 (gradcheck_util). The recurrent
baseline's layers (LSTM, BiLSTM, recurrent attention, Conv1d) and model are checked in
tests/test_gradcheck_rnn.py.
"""
import numpy as np
import pytest

import minitf
from minitf import functional as F
from minitf.blocks import DecoderLayer, EncoderLayer
from minitf.layers import (Dropout, FeedForward, LayerNorm, LearnedPositional, Linear, MultiHeadAttention,
                           SinusoidalPositional, TokenEmbedding, flatten_parameters)
from minitf.loss import label_smoothed_nll, label_smoothed_nll_backward
from minitf.masks import causal_bias, padding_bias

from gradcheck_util import check, check_layer, check_model

B, S, T, D, H, K, FF, V = 2, 5, 4, 8, 2, 3, 12, 11


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def small_cfg(**kw):
    base = dict(vocab_size=V, d_model=D, n_heads=H, d_k=K, d_ff=FF, n_layers=2, dropout=0.0,
                label_smoothing=0.1, pad_id=0, max_len=16)
    base.update(kw)
    return minitf.Config(**base)


def test_gradcheck_linear(rng):
    layer = Linear(D, 6, rng)
    check_layer(layer, [rng.standard_normal((B, T, D))], layer.forward, layer.backward, rng)


def test_gradcheck_embedding_lookup_with_repeated_ids(rng):
    layer = TokenEmbedding(V, D, rng)
    ids = np.array([[1, 4, 4, 0], [4, 7, 1, 1]])  # repeats must add up
    check_layer(layer, [ids], lambda i: layer.lookup(i)[0], lambda d: layer.lookup_backward(d, ids) or (), rng)


def test_gradcheck_embedding_projection(rng):
    layer = TokenEmbedding(V, D, rng)
    h = rng.standard_normal((B, T, D))
    check_layer(layer, [h], lambda x: layer.project(x)[0], lambda d: layer.project_backward(d, h), rng)


def test_gradcheck_embedding_projection_over_an_output_vocabulary(rng):
    """logits = h @ weight[ids]^T: d weight on the rows ids only (the others stay 0), and dh."""
    layer = TokenEmbedding(V, D, rng)
    ids = np.array([1, 3, 4, 7, 9])
    layer.use_output_vocabulary(ids, 1, np)
    h = rng.standard_normal((B, T, D))
    assert layer.project(h)[0].shape == (B, T, ids.size)
    errs = check_layer(layer, [h], lambda x: layer.project(x)[0], lambda d: layer.project_backward(d, h), rng)
    assert set(errs) == {"weight", "input0"}
    layer.grads["weight"][...] = 0
    layer.project(h)
    layer.project_backward(rng.standard_normal((B, T, ids.size)), h)
    others = np.setdiff1d(np.arange(V), ids)
    assert np.all(layer.grads["weight"][others] == 0) and np.abs(layer.grads["weight"][ids]).min() > 0


def test_gradcheck_positional_sinusoidal(rng):
    layer = SinusoidalPositional(16, D)
    check_layer(layer, [rng.standard_normal((B, T, D))], layer.forward, layer.backward, rng)


def test_gradcheck_positional_learned(rng):
    layer = LearnedPositional(16, D, rng)
    check_layer(layer, [rng.standard_normal((B, T, D))], layer.forward, layer.backward, rng)


def test_gradcheck_layernorm(rng):
    layer = LayerNorm(D, 1e-5)
    flatten_parameters(layer, np, np.float64)
    layer.params["weight"][...] = rng.standard_normal(D)  # non-trivial gain and bias
    layer.params["bias"][...] = rng.standard_normal(D)
    check_layer(layer, [rng.standard_normal((B, T, D)) * 3 + 1], layer.forward, layer.backward, rng)


def test_gradcheck_softmax(rng):
    x = rng.standard_normal((B, H, T, S))
    r = rng.standard_normal(x.shape)
    dx = F.softmax_backward(r, F.softmax_forward(x))
    check("softmax x", dx, lambda: float((F.softmax_forward(x) * r).sum()), x)


def test_gradcheck_relu(rng):
    x = rng.standard_normal((B, T, D))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    r = rng.standard_normal(x.shape)
    check("relu x", F.relu_backward(r, F.relu_forward(x)), lambda: float((F.relu_forward(x) * r).sum()), x)


def test_gradcheck_swish(rng):
    """swish(x) = x * sigmoid(x) (Marian's feed-forward option), large |x| included."""
    x = rng.standard_normal((B, T, D)) * 3
    x[0, 0, :2] = [40.0, -40.0]
    r = rng.standard_normal(x.shape)
    check("swish x", F.swish_backward(r, x), lambda: float((F.swish_forward(x) * r).sum()), x)
    assert np.allclose(F.swish_forward(x), x / (1 + np.exp(-x)))


def test_gradcheck_feedforward_swish_with_relu_dropout(rng):
    layer = FeedForward(D, FF, rng, dropout=0.3, activation="swish")
    fwd = lambda x: layer.forward(x, F.DropoutSites(7, 0))  # noqa: E731
    check_layer(layer, [rng.standard_normal((B, T, D))], fwd, layer.backward, rng)


@pytest.mark.parametrize("output_vocab", [False, True])
def test_gradcheck_embedding_projection_with_a_logit_bias(rng, output_vocab):
    """logits = h @ weight[ids]^T + bias[ids] (config output_bias): d bias on the rows ids only."""
    layer = TokenEmbedding(V, D, rng, bias=True)
    layer.params["bias"] = rng.standard_normal(V)
    ids = np.array([1, 3, 4, 7, 9])
    if output_vocab:
        layer.use_output_vocabulary(ids, 1, np)
    h = rng.standard_normal((B, T, D))
    errs = check_layer(layer, [h], lambda x: layer.project(x)[0], lambda d: layer.project_backward(d, h), rng)
    assert set(errs) == {"weight", "bias", "input0"}
    if output_vocab:
        layer.grads["bias"][:] = 0
        layer.project_backward(np.ones((B, T, ids.size)), h)
        others = np.setdiff1d(np.arange(V), ids)
        assert np.all(layer.grads["bias"][others] == 0) and np.all(layer.grads["bias"][ids] == B * T)


@pytest.mark.parametrize("masks", ["padding", "causal+padding"])
def test_gradcheck_attention_with_masks(rng, masks):
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, S, K))
    v = rng.standard_normal((B, H, S, K))
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    bias = padding_bias(src, 0, np.float64)
    if masks == "causal+padding":  # T == S square case for the causal part
        q = rng.standard_normal((B, H, S, K))
        bias = bias + causal_bias(S, np, np.float64)
    scale = 1 / np.sqrt(K)
    out, p = F.attention_forward(q, k, v, bias, scale)
    r = rng.standard_normal(out.shape)
    dq, dk, dv = F.attention_backward(r, q, k, v, p, scale)

    def loss():
        return float((F.attention_forward(q, k, v, bias, scale)[0] * r).sum())

    check("attention q", dq, loss, q)
    check("attention k", dk, loss, k)
    check("attention v", dv, loss, v)
    assert np.all(dk[0, :, 3:] == 0) and np.all(dv[0, :, 3:] == 0), "masked keys must get no gradient"


def test_gradcheck_multihead_self_attention(rng):
    layer = MultiHeadAttention(D, H, K, rng)
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    bias = padding_bias(src, 0, np.float64)

    def fwd(x):
        return layer.forward(x, x, bias)

    def bwd(d):
        dx_q, dx_kv = layer.backward(d)
        return dx_q + dx_kv

    check_layer(layer, [rng.standard_normal((B, S, D))], fwd, bwd, rng)


def test_gradcheck_multihead_masked_self_attention(rng):
    layer = MultiHeadAttention(D, H, K, rng)
    tgt = np.array([[5, 6, 7, 0], [5, 6, 7, 8]])
    bias = causal_bias(T, np, np.float64)[None, None] + padding_bias(tgt, 0, np.float64)

    def bwd(d):
        dx_q, dx_kv = layer.backward(d)
        return dx_q + dx_kv

    check_layer(layer, [rng.standard_normal((B, T, D))], lambda x: layer.forward(x, x, bias), bwd, rng)


def test_gradcheck_multihead_cross_attention(rng):
    layer = MultiHeadAttention(D, H, K, rng)
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    bias = padding_bias(src, 0, np.float64)
    inputs = [rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))]
    check_layer(layer, inputs, lambda y, m: layer.forward(y, m, bias), layer.backward, rng)


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_gradcheck_multihead_attention_with_attention_dropout(rng, kind):
    layer = MultiHeadAttention(D, H, K, rng, dropout=0.3)
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    bias = padding_bias(src, 0, np.float64)
    # a fresh stream of the same forward on every call: the same mask each time
    if kind == "self":
        inputs = [rng.standard_normal((B, S, D))]
        fwd = lambda x: layer.forward(x, x, bias, sites=F.DropoutSites(7, 0))  # noqa: E731

        def bwd(d):
            dx_q, dx_kv = layer.backward(d)
            return dx_q + dx_kv
    else:
        inputs = [rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))]
        fwd = lambda y, m: layer.forward(y, m, bias, sites=F.DropoutSites(7, 0))  # noqa: E731
        bwd = layer.backward
    fwd(*inputs)
    mask = layer.cache.drop_mask
    assert mask.shape == (B, H, inputs[0].shape[1], S) and 0.1 < (mask == 0).mean() < 0.5
    check_layer(layer, inputs, fwd, bwd, rng)


def test_gradcheck_feedforward_with_relu_dropout(rng):
    layer = FeedForward(D, FF, rng, dropout=0.3)
    fwd = lambda x: layer.forward(x, F.DropoutSites(7, 0))  # noqa: E731
    x = rng.standard_normal((B, T, D))
    fwd(x)
    mask = layer.drop.cache
    assert mask.shape == (B, T, FF) and 0.1 < (mask == 0).mean() < 0.5
    check_layer(layer, [x], fwd, layer.backward, rng)


def test_gradcheck_feedforward(rng):
    layer = FeedForward(D, FF, rng)
    check_layer(layer, [rng.standard_normal((B, T, D))], layer.forward, layer.backward, rng)


def test_gradcheck_dropout_with_fixed_mask(rng):
    layer = Dropout(0.3)
    x = rng.standard_normal((B, T, D))
    mask = F.dropout_mask(F.DropoutSites(0, 0), x.shape, 0.3, x.dtype)
    assert 0 < (mask == 0).mean() < 1
    check_layer(layer, [x], lambda x: layer.forward(x, mask=mask), layer.backward, rng)


ALL_DROPOUTS = dict(dropout=0.2, attention_dropout=0.2, relu_dropout=0.2)


@pytest.mark.parametrize("dropouts", [dict(dropout=0.2), ALL_DROPOUTS, dict(ALL_DROPOUTS, norm_position="pre")],
                         ids=["residual", "all", "pre-norm"])
def test_gradcheck_encoder_layer_with_dropout(rng, dropouts):
    layer = EncoderLayer(small_cfg(**dropouts), rng)
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    bias = padding_bias(src, 0, np.float64)
    # a fresh stream of the same forward on every call: the same dropout masks each time
    fwd = lambda x: layer.forward(x, bias, F.DropoutSites(7, 0))  # noqa: E731
    check_layer(layer, [rng.standard_normal((B, S, D))], fwd, layer.backward, rng)


@pytest.mark.parametrize("dropouts", [dict(dropout=0.2), ALL_DROPOUTS, dict(ALL_DROPOUTS, norm_position="pre")],
                         ids=["residual", "all", "pre-norm"])
def test_gradcheck_decoder_layer_with_dropout(rng, dropouts):
    layer = DecoderLayer(small_cfg(**dropouts), rng)
    src = np.array([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    tgt = np.array([[5, 6, 7, 0], [5, 6, 7, 8]])
    src_bias = padding_bias(src, 0, np.float64)
    tgt_bias = causal_bias(T, np, np.float64)[None, None] + padding_bias(tgt, 0, np.float64)
    fwd = lambda y, m: layer.forward(y, m, src_bias, tgt_bias, F.DropoutSites(7, 0))  # noqa: E731
    inputs = [rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))]
    check_layer(layer, inputs, fwd, layer.backward, rng)


def test_gradcheck_label_smoothed_loss(rng):
    logits = rng.standard_normal((B, T, V)) * 2
    target = np.array([[4, 5, 6, 0], [7, 8, 0, 0]])  # pads are ignored

    def loss():
        return float(label_smoothed_nll(logits, target, 0.1, 0)[0])

    cache = label_smoothed_nll(logits, target, 0.1, 0)[3]
    d = label_smoothed_nll_backward(cache).reshape(logits.shape)
    check("loss logits", d, loss, logits)
    assert np.all(d[target == 0] == 0)


def test_gradcheck_label_smoothed_loss_device_scale(rng):
    """The loss scale kept on the device (dscale, a [1] array) multiplies the gradient: it is the
    gradient of dloss * scale * loss."""
    logits = rng.standard_normal((B, T, V)) * 2
    target = np.array([[4, 5, 6, 0], [7, 8, 0, 0]])
    dloss, scale = 0.75, np.array([3.0])

    def loss():
        return float(label_smoothed_nll(logits, target, 0.1, 0)[0]) * dloss * scale[0]

    cache = label_smoothed_nll(logits, target, 0.1, 0)[3]
    d = label_smoothed_nll_backward(cache, dloss, scale).reshape(logits.shape)
    check("loss logits, device scale", d, loss, logits)
    assert np.all(d[target == 0] == 0)


def _batch():
    src = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 5, 6, 7, 3]])
    tgt_out = np.array([[4, 6, 8, 3, 0], [7, 5, 3, 0, 0]])
    tgt_in = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 0, 0]])
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("variant", ["sinusoidal", "learned", "dropout", "all dropouts", "unpadded",
                                     "2+1 layers", "1+2 layers", "output vocabulary", "pre-norm", "pre-norm unpadded",
                                     "swish and a logit bias", "rows without a loss", "plain padded"])
def test_gradcheck_transformer_every_parameter(variant):
    """Padded batches take the pad-free packed layout (packing.py); "unpadded" (no pad
    anywhere) takes the plain [B, L, D] layout with no row index. "all dropouts": residual,
    attention and ReLU dropout. "2+1 layers" / "1+2 layers": encoder and decoder stacks of
    different depths (n_decoder_layers). "output vocabulary": logits over 7 of the 11 pieces, one
    reference piece (5) outside them (scored as the unknown piece, 1). "pre-norm": the LayerNorm
    before each sublayer and after each stack (norm_position "pre"), with all dropouts; packed and
    plain. "swish and a logit bias": Marian's options (activation "swish", output_bias), over an
    output vocabulary, with all dropouts. "rows without a loss": the shorter sentence first, a target position
    kept (tgt_in not pad) whose tgt_out is pad, so the loss head's rows go back into the decoder's by index;
    "plain padded": that batch in the plain [B, L, D] layout, pads included (forward_loss(packed=False))."""
    dropouts = {"dropout": dict(dropout=0.2), "all dropouts": ALL_DROPOUTS, "pre-norm": ALL_DROPOUTS,
                "pre-norm unpadded": ALL_DROPOUTS}.get(variant, dict(dropout=0.0))
    if variant.startswith("pre-norm"):
        dropouts = dict(dropouts, norm_position="pre")
    if variant in ("output vocabulary", "swish and a logit bias"):
        dropouts["output_vocab"] = "1,3-4,6-8,10"
    if variant == "swish and a logit bias":
        dropouts.update(ALL_DROPOUTS, activation="swish", output_bias=True)
    stacks = {"2+1 layers": dict(n_layers=2, n_decoder_layers=1),
              "1+2 layers": dict(n_layers=1, n_decoder_layers=2)}.get(variant, {})
    cfg = small_cfg(positional="learned" if variant == "learned" else "sinusoidal", **dropouts, **stacks)
    model = minitf.Transformer(cfg, dtype="float64", seed=3)
    if cfg.output_bias:   # a bias that is not zero, so a wrong index into it shows
        model.embedding.params["bias"][:] = np.random.default_rng(5).standard_normal(V)
    if stacks:
        assert (len(model.encoder.layer_list), len(model.decoder.layer_list)) == (
            stacks["n_layers"], stacks["n_decoder_layers"])
    src, tgt_in, tgt_out = _batch()
    if variant.startswith("pre-norm"):
        assert {"encoder.norm.weight", "decoder.norm.bias"} <= set(model.state_dict())
    if variant.endswith("unpadded"):
        src, tgt_in, tgt_out = src[1:, :5], tgt_in[:1, :4], tgt_out[:1, :4]
        assert (src != 0).all() and (tgt_in != 0).all() and (tgt_out != 0).all()
    if variant in ("rows without a loss", "plain padded"):
        src = np.array([[5, 6, 7, 0, 0, 0], [9, 10, 5, 6, 7, 3]])
        tgt_in, tgt_out = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 9, 4]]), np.array([[4, 6, 3, 0, 0], [7, 5, 9, 4, 3]])
        assert ((tgt_in != 0) & (tgt_out == 0)).any()
    assert check_model(model, src, tgt_in, tgt_out, packed=variant != "plain padded") > 50
