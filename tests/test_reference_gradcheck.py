"""minitf/reference.py proves itself, without the engine: every backward of the reference against
central differences in float64 (every parameter and every float input), and its header lists
exactly what of the engine's config it leaves out.

tests/test_reference.py holds the reference equal to the engine; a bug made in both (the same wrong
LayerNorm backward, say) would pass there and fails here."""
import dataclasses
import re

import numpy as np
import pytest

import minitf
from minitf import reference as ref

from gradcheck_util import check

V, D, F, H, B, S, T = 11, 8, 12, 2, 2, 5, 4


def masks(p=0.3, seed=4):
    """mask_fn(site, shape): fixed inverted-dropout masks (0 or 1 / (1 - p)), the same on every call."""
    rng, made = np.random.default_rng(seed), {}

    def mask_fn(site, shape):
        if (site, shape) not in made:
            made[site, shape] = (rng.random(shape) >= p) / (1 - p)
        return made[site, shape]
    return mask_fn


def batch():
    src = np.array([[5, 6, 7, 3, 0], [9, 10, 5, 6, 3]])
    tgt_in = np.array([[2, 4, 6, 8], [2, 7, 5, 0]])
    tgt_out = np.array([[4, 6, 8, 3], [7, 5, 3, 0]])
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("learned", [False, True])
def test_every_parameter_gradient_of_the_reference_against_central_differences(learned):
    """The whole step: padding, the causal mask, dropout at every site, label smoothing, the tied
    embedding's three shares, 2 encoder and 2 decoder layers (the memory's gradient is the sum of every decoder
    layer's cross-attention share: with one, a backward that kept only the last share had passed); learned positions
    too."""
    rng = np.random.default_rng(0)
    params = ref.init_params(V, D, F, 2, rng, learned_max_len=8 if learned else None, n_decoder_layers=2)
    for name, p in params.items():   # not the init's zero biases and unit gains: a wrong term must show
        p += 0.1 * rng.standard_normal(p.shape)
    mask_fn = masks()
    src, tgt_in, tgt_out = batch()

    def loss():
        return ref.forward(params, src, tgt_in, tgt_out, H, mask_fn)[0]

    _, _, cache = ref.forward(params, src, tgt_in, tgt_out, H, mask_fn)
    grads = ref.backward(params, cache)
    assert set(grads) == set(params)
    zero = [name for name in params if check(f"reference {name}", grads[name], loss, params[name]) is None]
    assert zero and all(name.endswith(".k.bias") for name in zero)   # only the inert key biases (deviations.md item 1)


def layer_params(rng, *names_dims):
    params = {}
    for name, d_in, d_out in names_dims:
        params[name + ".weight"] = rng.standard_normal((d_in, d_out)) * 0.5
        params[name + ".bias"] = rng.standard_normal(d_out) * 0.1
    return params


def sum_against(r, fn):
    return lambda: float((fn() * r).sum())


def test_linear_and_ffn_input_gradients():
    rng = np.random.default_rng(1)
    params = layer_params(rng, ("lin", D, 6), ("ffn.fc1", D, F), ("ffn.fc2", F, D))
    x = rng.standard_normal((B, T, D))
    r = rng.standard_normal((B, T, 6))
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    dx = ref.linear_backward(r, x, params, grads, "lin")
    check("linear x", dx, sum_against(r, lambda: ref.linear_forward(x, params, "lin")), x)
    x = rng.standard_normal((B, T, D))
    r = rng.standard_normal((B, T, D))
    _, cache = ref.ffn_forward(x, params, "ffn")
    dx = ref.ffn_backward(r, cache, params, grads, "ffn")
    check("ffn x", dx, sum_against(r, lambda: ref.ffn_forward(x, params, "ffn")[0]), x)


def test_layernorm_dropout_softmax_and_loss_input_gradients():
    rng = np.random.default_rng(2)
    params = {"ln.weight": 1 + rng.standard_normal(D) * 0.1, "ln.bias": rng.standard_normal(D) * 0.1}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    x, r = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))
    _, cache = ref.layernorm_forward(x, params, "ln", 1e-5)
    dx = ref.layernorm_backward(r, cache, params, grads, "ln")
    check("layernorm x", dx, sum_against(r, lambda: ref.layernorm_forward(x, params, "ln", 1e-5)[0]), x)
    mask_fn = masks()
    _, mask = ref.dropout_forward(x, mask_fn, 0)
    check("dropout x", ref.dropout_backward(r, mask), sum_against(r, lambda: ref.dropout_forward(x, mask_fn, 0)[0]), x)
    logits, gold = rng.standard_normal((B, T, V)), np.array([[4, 6, 8, 3], [7, 5, 3, 0]])
    _, loss_cache = ref.label_smoothed_loss(logits, gold, 0.1, 0)
    dlogits = ref.label_smoothed_loss_backward(loss_cache)
    check("loss logits", dlogits, lambda: float(ref.label_smoothed_loss(logits, gold, 0.1, 0)[0]), logits)
    assert not dlogits[gold == 0].any()


@pytest.mark.parametrize("self_attention", [True, False])
def test_attention_input_gradients_through_both_inputs_and_the_masks(self_attention):
    """attention_backward's (dx_q, dx_kv): decoder self-attention (causal + padding bias, one input
    given twice) and cross-attention (a source padding bias)."""
    rng = np.random.default_rng(3)
    params = layer_params(rng, *[(f"att.{p}", D, D) for p in "qkv"], ("att.out", D, D))
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    src, tgt_in, _ = batch()
    x_q = rng.standard_normal((B, T, D))
    if self_attention:
        x_kv, bias = x_q, ref.causal_bias(T)[None, None] + ref.padding_bias(tgt_in, 0)
    else:
        x_kv, bias = rng.standard_normal((B, S, D)), ref.padding_bias(src, 0)
    r = rng.standard_normal((B, T, D))
    _, cache = ref.attention_forward(x_q, x_kv, bias, params, "att", H)
    dx_q, dx_kv = ref.attention_backward(r, cache, params, grads, "att")
    if self_attention:   # one input read twice: its gradient is the sum of both
        check("self-attention x", dx_q + dx_kv,
              sum_against(r, lambda: ref.attention_forward(x_q, x_q, bias, params, "att", H)[0]), x_q)
    else:
        check("cross-attention x_q", dx_q,
              sum_against(r, lambda: ref.attention_forward(x_q, x_kv, bias, params, "att", H)[0]), x_q)
        check("cross-attention x_kv", dx_kv,
              sum_against(r, lambda: ref.attention_forward(x_q, x_kv, bias, params, "att", H)[0]), x_kv)
    for name in ("att.q.weight", "att.v.weight", "att.out.weight", "att.out.bias"):
        check(f"attention {name}", grads[name],
              sum_against(r, lambda: ref.attention_forward(x_q, x_kv, bias, params, "att", H)[0]), params[name])


def test_encoder_and_decoder_layer_input_gradients_with_dropout():
    rng = np.random.default_rng(5)
    params = ref.init_params(V, D, F, 1, rng)
    for p in params.values():
        p += 0.1 * rng.standard_normal(p.shape)
    src, tgt_in, _ = batch()
    mask_fn = masks()
    src_bias = ref.padding_bias(src, 0)
    tgt_bias = ref.causal_bias(T)[None, None] + ref.padding_bias(tgt_in, 0)
    x, memory, y = rng.standard_normal((B, S, D)), rng.standard_normal((B, S, D)), rng.standard_normal((B, T, D))
    grads = {k: np.zeros_like(v) for k, v in params.items()}

    def enc():
        return ref.encoder_layer_forward(x, src_bias, params, "encoder.layers.0", H, 1e-5, mask_fn, 1)

    r = rng.standard_normal((B, S, D))
    dx = ref.encoder_layer_backward(r, enc()[1], params, grads, "encoder.layers.0")
    check("encoder layer x", dx, sum_against(r, lambda: enc()[0]), x)

    def dec():
        return ref.decoder_layer_forward(y, memory, src_bias, tgt_bias, params, "decoder.layers.0", H, 1e-5, mask_fn, 3)

    r = rng.standard_normal((B, T, D))
    dy, dmemory = ref.decoder_layer_backward(r, dec()[1], params, grads, "decoder.layers.0")
    check("decoder layer y", dy, sum_against(r, lambda: dec()[0]), y)
    check("decoder layer memory", dmemory, sum_against(r, lambda: dec()[0]), memory)


# ------------------------------------------------------------------------------ what the reference leaves out
# Config fields the reference's step reads (under its own argument names), and fields that are not
# part of one training step of the model (the data, the run's clock and files, decoding, the other
# architecture's sizes); every other field must be named in the reference's header as left out.
READS = {"vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "n_decoder_layers", "d_k", "dropout",
         "label_smoothing", "pad_id", "layer_norm_eps", "positional", "max_len", "warmup", "lr_factor",
         "weight_decay"}
NOT_THE_STEP = {"unk_id", "bos_id", "eos_id", "bpe_dropout_source", "bpe_dropout_target", "bidirectional_epochs",
                "update_tokens", "max_tokens", "save_every", "save_every_minutes", "average_last", "max_steps",
                "decode_alpha", "rnn_hidden", "attention"}


def header_leaves_out():
    """The config fields the reference's header names (in backticks) in its "Left out" paragraph."""
    doc = ref.__doc__
    part = doc[doc.index("Left out"):]
    part = part[:part.index("\n\n")]
    return set(re.findall(r"`(\w+)`", part))


def test_the_reference_header_lists_exactly_the_config_fields_it_leaves_out():
    fields = {f.name for f in dataclasses.fields(minitf.Config)}
    named = header_leaves_out()
    assert not named - fields, f"named in the header but not config fields: {sorted(named - fields)}"
    unplaced = fields - READS - NOT_THE_STEP - named
    assert not unplaced, (f"config fields neither read by reference.py, nor outside the step, nor named in its "
                          f"header's 'Left out' paragraph: {sorted(unplaced)}")
    assert not named & READS, f"named as left out but the reference reads them: {sorted(named & READS)}"
    params = ref.init_params(V, D, F, 1, np.random.default_rng(0))
    import inspect
    sig = " ".join(str(inspect.signature(f)) for f in (ref.forward, ref.train_step, ref.init_params, ref.adam_step))
    for word in ("label_smoothing", "pad_id", "ln_eps", "warmup", "lr_factor", "weight_decay", "n_decoder_layers",
                 "learned_max_len", "mask_fn"):   # how the READS fields reach it
        assert word in sig, word
    assert set(params) == set(minitf.architectures.parameter_shapes(minitf.Config(
        vocab_size=V, d_model=D, n_heads=2, d_ff=F, n_layers=1)))
