"""Unit tests of the engine: masks, schedule, Adam, weight tying, devices, errors."""
import re
import sys

import numpy as np
import pytest

import minitf
from minitf.backend import get_xp, gpu_available
from minitf.layers import sinusoid_table


def tiny(**kw):
    base = dict(vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_layers=2, dropout=0.0, max_len=32)
    base.update(kw)
    return minitf.Config(**base)


def batch():
    src = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 5, 6, 7, 3]])
    tgt_in = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 0, 0]])
    tgt_out = np.array([[4, 6, 8, 3, 0], [7, 5, 3, 0, 0]])
    return src, tgt_in, tgt_out


def test_source_padding_blocks_information():
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, _ = batch()
    before = model.forward(src, tgt_in)
    src2 = src.copy()
    model.embedding.params["weight"][0] += 5.0  # change what a pad token "means"
    after = model.forward(src2, tgt_in)
    # column 0 is the pad token's own logit (h @ E[0]), which depends on E[0] directly
    np.testing.assert_allclose(after[tgt_in != 0][:, 1:], before[tgt_in != 0][:, 1:], rtol=0, atol=1e-12)
    assert not np.allclose(after, model.forward(np.where(src == 0, 4, src), tgt_in))


def test_causal_mask_blocks_future_tokens():
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, _ = batch()
    tgt_in = np.array([[2, 4, 6, 8, 9], [2, 7, 5, 11, 12]])
    base = model.forward(src, tgt_in)
    for t in range(1, tgt_in.shape[1]):
        changed = tgt_in.copy()
        changed[:, t:] = 1  # rewrite every position from t on
        out = model.forward(src, changed)
        np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not np.allclose(out[:, t], base[:, t])


def test_target_padding_keys_are_masked():
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, _ = batch()
    base = model.forward(src, tgt_in)
    model.embedding.params["weight"][0] *= -3.0
    out = model.forward(src, tgt_in)
    np.testing.assert_allclose(out[tgt_in != 0][:, 1:], base[tgt_in != 0][:, 1:], rtol=0, atol=1e-12)
    assert not np.allclose(out[tgt_in == 0][:, 1:], base[tgt_in == 0][:, 1:])  # the pad rows do change


def test_noam_schedule_peaks_at_warmup():
    lrs = [minitf.noam(s, 512, 4000) for s in range(1, 20001)]
    assert int(np.argmax(lrs)) + 1 == 4000
    assert np.isclose(max(lrs), 512 ** -0.5 * 4000 ** -0.5)
    assert np.isclose(minitf.noam(100, 512, 4000, factor=2.0), 2 * 512 ** -0.5 * 100 * 4000 ** -1.5)
    assert minitf.NoamSchedule(512, 4000)(4000) == max(lrs)


def test_adam_matches_hand_computed_update():
    model = minitf.Transformer(tiny(), dtype="float64")
    name = "decoder.layers.1.ffn.fc2.bias"
    p0 = model.state_dict()[name].copy()
    g1, g2 = np.full(p0.shape, 0.5), np.full(p0.shape, -2.0)
    opt = minitf.Adam(model, lr=0.1, betas=(0.9, 0.98), eps=1e-9)
    model.zero_grad()
    model.grad_dict()[name][...] = g1
    opt.step()
    # step 1: m = 0.05, v = 0.005; m_hat = 0.5, v_hat = 0.25 -> p -= 0.1 * 0.5 / (0.5 + 1e-9)
    np.testing.assert_allclose(model.state_dict()[name], p0 - 0.1 * 0.5 / (0.5 + 1e-9), rtol=1e-14)
    model.zero_grad()
    model.grad_dict()[name][...] = g2
    opt.step()
    m = 0.9 * 0.05 + 0.1 * -2.0          # -0.155
    v = 0.98 * 0.005 + 0.02 * 4.0        # 0.0849
    m_hat, v_hat = m / (1 - 0.9 ** 2), v / (1 - 0.98 ** 2)
    expected = p0 - 0.1 * 0.5 / (0.5 + 1e-9) - 0.1 * m_hat / (np.sqrt(v_hat) + 1e-9)
    np.testing.assert_allclose(model.state_dict()[name], expected, rtol=1e-12)
    assert opt.step_count == 2
    np.testing.assert_allclose(opt.state["m"][name], m)
    other = "encoder.layers.0.norm1.weight"  # zero gradient -> unchanged
    np.testing.assert_array_equal(model.state_dict()[other], np.ones(16))


def test_adam_weight_decay_is_decoupled_from_the_moments():
    """AdamW: p <- p * (1 - lr * lambda) - lr * m_hat / (sqrt(v_hat) + eps); a weight with no gradient
    only shrinks, and lambda 0 is the paper's Adam to the last bit."""
    model = minitf.Transformer(tiny(), dtype="float64")
    name, other = "decoder.layers.1.ffn.fc2.weight", "encoder.layers.0.norm1.weight"
    p0, q0 = model.state_dict()[name].copy(), model.state_dict()[other].copy()
    plain = minitf.Transformer(tiny(), dtype="float64")
    opt, opt0 = minitf.Adam(model, lr=0.1, weight_decay=0.3), minitf.Adam(plain, lr=0.1)
    for m in (model, plain):
        m.zero_grad()
        m.grad_dict()[name][...] = 0.5
    opt.step()
    opt0.step()
    # step 1: m_hat = 0.5, v_hat = 0.25
    np.testing.assert_allclose(model.state_dict()[name], p0 * (1 - 0.1 * 0.3) - 0.1 * 0.5 / (0.5 + 1e-9), rtol=1e-14)
    np.testing.assert_allclose(model.state_dict()[other], q0 * (1 - 0.1 * 0.3), rtol=1e-15)
    np.testing.assert_array_equal(plain.state_dict()[name], p0 - 0.1 * 0.5 / (0.5 + 1e-9))
    np.testing.assert_array_equal(plain.state_dict()[other], q0)
    np.testing.assert_array_equal(opt.state["m"][name], opt0.state["m"][name])   # the moments never see the decay


def test_adam_with_schedule_uses_step_count():
    model = minitf.Transformer(tiny(), dtype="float64")
    opt = minitf.Adam(model, lr=minitf.NoamSchedule(16, 10, factor=2.0))
    assert opt.step() == minitf.noam(1, 16, 10, 2.0)
    assert opt.step() == minitf.noam(2, 16, 10, 2.0)


def test_tied_embedding_gradient_is_sum_of_three_uses():
    cfg = tiny()
    src, tgt_in, tgt_out = batch()
    model = minitf.Transformer(cfg, dtype="float64")
    model.zero_grad()
    model.forward_loss(src, tgt_in, tgt_out)
    model.backward()
    total = model.grad_dict()["embedding.weight"].copy()

    # Recompute each use's share by hand: run forward again, then backprop each piece alone.
    emb = model.embedding
    model.zero_grad()
    model.forward_loss(src, tgt_in, tgt_out)
    c, head = model._cache, model._head
    from minitf.loss import label_smoothed_nll_backward
    from minitf.packing import unpack
    dh_rows = emb.project_backward(label_smoothed_nll_backward(head["loss"]), head["h_rows"])
    proj = model.grad_dict()["embedding.weight"].copy()
    dh = dh_rows                              # packed training layout: h is [Nt, D]
    if head["loss_rows"] is not None:
        dh = np.zeros((int(np.prod(c["h_shape"][:-1])), c["h_shape"][-1]))
        dh[head["loss_rows"]] = dh_rows
    dy, dmem = model.decoder.backward(dh.reshape(c["h_shape"]))
    model.zero_grad()
    emb.lookup_backward(unpack(c["tgt_rows"], dy), c["tgt_ids"])
    tgt_part = model.grad_dict()["embedding.weight"].copy()
    model.zero_grad()
    emb.lookup_backward(unpack(c["src_rows"], model.encoder.backward(dmem)), c["src_ids"])
    src_part = model.grad_dict()["embedding.weight"].copy()
    for part in (proj, tgt_part, src_part):
        assert np.abs(part).sum() > 0
    np.testing.assert_allclose(total, proj + tgt_part + src_part, rtol=1e-12, atol=1e-15)


def test_a_source_row_of_padding_alone_is_refused_where_packed_and_padded_would_differ():
    """A sentence with no source piece: its cross-attention reads no memory. The padded computation (and
    reference.py) spread it evenly over the pad positions, the packed one read zeros: another loss (1.7% off) and
    other gradients, without a word. The data pipeline ends every source with </s>; a caller's batch is refused."""
    from minitf.errors import ConfigError
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, tgt_out = batch()
    src[1] = 0
    with pytest.raises(ConfigError, match=r"src row 1 is all padding \(id 0\)"):
        model.forward_loss(src, tgt_in, tgt_out)
    src[1, 0] = 3   # one piece: taken, packed equal to padded
    losses = [model.forward_loss(src, tgt_in, tgt_out, packed=p) for p in (True, False)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)


def test_backward_accumulates():
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, tgt_out = batch()
    model.zero_grad()
    model.forward_loss(src, tgt_in, tgt_out)
    model.backward()
    once = model.flat_grads.copy()
    model.forward_loss(src, tgt_in, tgt_out)
    model.backward()
    np.testing.assert_allclose(model.flat_grads, 2 * once, rtol=1e-12)


def test_library_misuse_is_a_clear_error_at_the_call():
    """What a reader trying the pieces on their own meets: each had given a wrong answer without a word, or failed
    deep inside."""
    from minitf.errors import ConfigError
    from minitf.layers import Linear, MultiHeadAttention
    from minitf.loss import label_smoothed_nll, label_smoothed_nll_backward
    from minitf.masks import causal_bias
    rng = np.random.default_rng(0)
    # the causal mask is shared by every model of the process: written to, it had unmasked the future for all
    with pytest.raises(ValueError, match="read-only"):
        causal_bias(3, np, np.float64)[0, 1] = 0.0
    # one source for three targets had broadcast over them (and two for three failed inside a product)
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, tgt_out = batch()
    for n_src in (1, 2):
        with pytest.raises(ConfigError, match=f"src has {n_src} sentences but tgt_in 3"):
            model.forward_loss(np.repeat(src, 2, axis=0)[:n_src], np.repeat(tgt_in, 2, axis=0)[:3],
                               np.repeat(tgt_out, 2, axis=0)[:3])
    # a [B, S] padding bias broadcast as [1, 1, B, S] where B == T: row b's padding masked query b of every sentence
    mha = MultiHeadAttention(8, 2, 4, rng)
    x = rng.standard_normal((2, 2, 8))
    with pytest.raises(ValueError, match=r"attention bias of shape \(2, 2\): expected 4 axes"):
        mha.forward(x, x, np.zeros((2, 2)))
    # the loss's backward overwrites the softmax it keeps: a second one had started from its own result
    loss, _, _, cache = label_smoothed_nll(rng.standard_normal((4, 5)), np.array([1, 2, 0, 4]), 0.1, 0)
    label_smoothed_nll_backward(cache)
    with pytest.raises(ValueError, match="used by a backward already"):
        label_smoothed_nll_backward(cache)
    # a layer's backward without its forward (or a second one) had been an AttributeError inside
    for layer, dy in ((Linear(4, 3, rng), np.ones((2, 3))), (mha, np.ones((2, 2, 8)))):
        with pytest.raises(RuntimeError, match=f"{type(layer).__name__}.backward: no forward to go back through"):
            layer.backward(dy)
    # Dropout's too (it had handed dy back unmasked), also after a forward that dropped nothing, at the second backward
    from minitf.layers import Dropout
    drop, x = Dropout(0.3), np.ones((2, 3))
    for forward in (None, lambda: drop.forward(x, mask=np.full((2, 3), 2.0)), lambda: (drop.eval(), drop.forward(x))):
        if forward is not None:
            forward()
            drop.backward(x)
        with pytest.raises(RuntimeError, match="Dropout.backward: no forward to go back through"):
            drop.backward(x)


def test_positional_encoding_formula():
    pe = sinusoid_table(50, 10)
    pos, i = 7, 3
    assert np.isclose(pe[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 10)))
    assert np.isclose(pe[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 10)))
    assert np.allclose(pe[0, 0::2], 0) and np.allclose(pe[0, 1::2], 1)


def test_parameter_names_and_shapes_follow_contract():
    cfg = tiny(d_k=5)
    sd = minitf.Transformer(cfg).state_dict()
    assert sd["embedding.weight"].shape == (13, 16)
    assert sd["encoder.layers.1.self_attn.q.weight"].shape == (16, 10)
    assert sd["decoder.layers.0.cross_attn.out.weight"].shape == (10, 16)
    assert sd["decoder.layers.1.norm3.bias"].shape == (16,)
    assert sd["encoder.layers.0.ffn.fc1.weight"].shape == (16, 24)
    assert not any(n.startswith(("encoder.norm", "decoder.norm")) for n in sd)  # post-norm: no final LN
    assert sd["embedding.weight"].dtype == np.float32


def test_state_dict_round_trip_and_errors():
    a, b = minitf.Transformer(tiny(), seed=1), minitf.Transformer(tiny(), seed=2)
    src, tgt_in, _ = batch()
    b.load_state_dict({k: v.copy() for k, v in a.state_dict().items()})
    np.testing.assert_array_equal(a.forward(src, tgt_in), b.forward(src, tgt_in))
    bad = dict(a.state_dict())
    bad.pop("embedding.weight")
    with pytest.raises(minitf.CheckpointError, match="missing"):
        b.load_state_dict(bad)
    with pytest.raises(minitf.CheckpointError, match="shape"):
        minitf.Transformer(tiny(d_model=8, d_ff=8)).load_state_dict(a.state_dict())


def test_dropout_is_deterministic_per_seed_and_off_in_eval():
    cfg = tiny(dropout=0.3)
    src, tgt_in, tgt_out = batch()
    a, b = minitf.Transformer(cfg, seed=5), minitf.Transformer(cfg, seed=5)
    la = [a.forward_loss(src, tgt_in, tgt_out) for _ in range(2)]
    lb = [b.forward_loss(src, tgt_in, tgt_out) for _ in range(2)]
    assert la == lb and la[0] != la[1]
    a.eval()
    assert a.forward_loss(src, tgt_in, tgt_out) == a.forward_loss(src, tgt_in, tgt_out)


@pytest.mark.parametrize("knob", ["attention_dropout", "relu_dropout"])
def test_attention_and_relu_dropout_alone_drop_and_eval_does_not(knob):
    """Either knob alone makes training forwards differ (a stream is drawn without residual
    dropout) and drops about its rate; eval mode is deterministic; bad values are errors."""
    src, tgt_in, tgt_out = batch()
    model = minitf.Transformer(tiny(**{knob: 0.3}), seed=5)
    losses = [model.forward_loss(src, tgt_in, tgt_out) for _ in range(2)]
    assert losses[0] != losses[1] and model.forward_count == 2
    layer = model.encoder.layer_list[0]
    mask = layer.self_attn.cache.drop_mask if knob == "attention_dropout" else layer.ffn.drop.cache
    assert mask is not None and 0.1 < (mask == 0).mean() < 0.5
    model.eval()
    assert model.forward_loss(src, tgt_in, tgt_out) == model.forward_loss(src, tgt_in, tgt_out)
    with pytest.raises(minitf.ConfigError, match=knob):
        tiny(**{knob: 1.0})
    with pytest.raises(minitf.ConfigError, match="Transformer"):
        tiny(arch="rnn", **{knob: 0.1})


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(minitf.DeviceError, match="unknown device"):
        get_xp("tpu")
    with pytest.raises(minitf.ConfigError, match="divisible"):
        minitf.Config(vocab_size=10, d_model=10, n_heads=3)
    with pytest.raises(minitf.ConfigError, match="preset"):
        minitf.Config.preset("huge")
    model = minitf.Transformer(tiny())
    with pytest.raises(minitf.ConfigError, match="2-D integer"):
        model.forward(np.zeros((2, 3), dtype=np.float32), np.zeros((2, 3), dtype=np.int64))
    # a piece id outside the vocabulary, in any of the three inputs (a negative one would index the embedding
    # from its end and train on without a word); a batch with no target token
    src, tgt = np.array([[5, 6, 3]]), np.array([[2, 7, 3]])
    v = model.cfg.vocab_size
    for bad, which in ((0, "src"), (1, "tgt_in"), (2, "tgt_out")):
        for value in (-1, v):
            args = [src.copy(), tgt.copy(), tgt.copy()]
            args[bad][0, 1] = value
            with pytest.raises(minitf.ConfigError, match=rf"^{which} holds the piece id {value}: ids must lie in "
                                                         rf"\[0, {v}\), the vocabulary$"):
                model.forward_loss(*args)
    with pytest.raises(minitf.ConfigError, match="holds the piece id -2"):
        model.forward([[5, -2, 3]], tgt)
    with pytest.raises(minitf.ConfigError, match=r"tgt_out \(1, 3\) is all padding \(id 0\)"):
        model.forward_loss(src, tgt, tgt * 0)
    model.forward_loss(src, tgt, tgt)     # the same arrays, in range, are taken
    for kw, error, says in ((dict(lr=-1e-3), ValueError, "Adam: lr=-0.001: expected 0 or more, or a function"),
                            (dict(lr="1e-3"), TypeError, "Adam: lr='1e-3': expected a number"),
                            (dict(betas=(0.9,)), TypeError, r"Adam: betas=\(0.9,\): expected two numbers"),
                            (dict(betas=(0.9, 1.0)), ValueError, r"Adam: betas\[1\]=1.0: expected 0 or more and below 1"),
                            (dict(eps=0), ValueError, "Adam: eps=0: expected more than 0"),
                            (dict(weight_decay=-0.1), ValueError, "Adam: weight_decay=-0.1: expected 0 or more")):
        with pytest.raises(error, match=says):
            minitf.Adam(model, **kw)
    minitf.Adam(model, lr=0, betas=[0, 0.999], eps=1e-9, weight_decay=0)     # the edges are taken
    with pytest.raises(minitf.ConfigError, match=r"^Transformer\(cfg\): expected a minitf.Config, got dict"):
        minitf.Transformer(tiny().to_dict())
    from minitf.decode import beam_search, greedy_search
    for search in (beam_search, greedy_search):
        for shape in ((0, 3), (2, 0)):
            with pytest.raises(minitf.ConfigError, match=rf"src \({shape[0]}, {shape[1]}\): no (sentence to decode|"
                                                         rf"position in it) \(a s"):
                search(model, np.zeros(shape, dtype=np.int64), max_len_b=2)
    with pytest.raises(minitf.ConfigError, match="'bfloat16'"):
        minitf.Transformer(tiny(), dtype="int8")
    with pytest.raises(minitf.ConfigError, match=r"bfloat16 \(--bf16\) is for device='gpu'"):
        minitf.Transformer(tiny(), dtype="bfloat16")


def test_bfloat16_without_ml_dtypes_is_one_clear_error(monkeypatch):
    """NumPy has no bfloat16: its dtype comes from ml_dtypes (as CuPy's does); without the package
    the error names it and how to install it."""
    from minitf.backend import dtype_named
    assert dtype_named("bfloat16").name == "bfloat16" and dtype_named("bfloat16").itemsize == 2
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)      # `import ml_dtypes` raises ImportError
    with pytest.raises(minitf.DeviceError, match=r"--bf16\) needs the ml_dtypes package.*pip install ml_dtypes"):
        dtype_named("bfloat16")


def test_presets_follow_the_paper():
    base = minitf.Config.preset("base", vocab_size=37000)
    assert (base.n_layers, base.d_model, base.d_ff, base.n_heads, base.d_k, base.dropout,
            base.label_smoothing) == (6, 512, 2048, 8, 64, 0.1, 0.1)
    big = minitf.Config.preset("big", vocab_size=37000)
    assert (big.d_model, big.d_ff, big.n_heads, big.dropout) == (1024, 4096, 16, 0.3)
    small = minitf.Config.preset("small", vocab_size=8000)
    assert (small.d_model, small.n_heads, small.d_ff, small.n_layers) == (192, 4, 768, 2)
    assert minitf.Config(vocab_size=100).d_model == 512
    assert base.n_decoder_layers == base.n_layers == 6


def test_the_decoder_stack_depth_defaults_to_the_encoders():
    """n_decoder_layers None (and a config written before the field existed) is n_layers; a
    different depth builds that many decoder layers; the recurrent baseline refuses one."""
    old = minitf.Config(vocab_size=13, n_layers=3).to_dict()
    del old["n_decoder_layers"]
    assert minitf.Config.from_dict(old).n_decoder_layers == 3
    cfg = minitf.Config.preset("tiny", vocab_size=13, n_layers=2, n_decoder_layers=3)
    model = minitf.Transformer(cfg, seed=0)
    assert (len(model.encoder.layer_list), len(model.decoder.layer_list)) == (2, 3)
    assert "decoder.layers.2.cross_attn.q.weight" in model.state_dict()
    assert "encoder.layers.2.self_attn.q.weight" not in model.state_dict()
    with pytest.raises(minitf.ConfigError, match="n_decoder_layers is the Transformer's"):
        minitf.Config(vocab_size=13, arch="rnn", n_layers=1, n_decoder_layers=2)
    with pytest.raises(minitf.ConfigError, match="n_decoder_layers must be a positive integer"):
        minitf.Config(vocab_size=13, n_decoder_layers=0)


def test_gpu_request_without_gpu_is_one_clear_error():
    ok, why = gpu_available()
    if ok:
        pytest.skip("a GPU is present: the error path cannot be exercised here")
    with pytest.raises(minitf.DeviceError) as e:
        minitf.Transformer(tiny(), device="gpu")
    assert "--device gpu" in str(e.value) and ("CuPy" in str(e.value))


# ----------------------------------------------------------------------------- pad-free training rows
def test_rows_pack_unpack_round_trip():
    from minitf.packing import Rows
    keep = np.array([[True, True, False], [True, False, False]])
    x = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)
    rows = Rows(keep)
    packed = rows.pack(x)
    np.testing.assert_array_equal(packed, x[keep])
    back = rows.unpack(packed)
    np.testing.assert_array_equal(back[keep], x[keep])
    assert np.all(back[~keep] == 0)


def test_extra_padding_changes_neither_loss_nor_gradients():
    """forward_loss skips pad positions; padding the batch further must be invisible."""
    cfg = tiny(positional="learned")
    src, tgt_in, tgt_out = batch()
    model = minitf.Transformer(cfg, dtype="float64")
    model.zero_grad()
    loss = model.forward_loss(src, tgt_in, tgt_out)
    model.backward()
    grads = model.flat_grads.copy()
    wide = lambda a, n: np.concatenate([a, np.zeros((a.shape[0], n), dtype=a.dtype)], axis=1)
    model.zero_grad()
    loss2 = model.forward_loss(wide(src, 3), wide(tgt_in, 4), wide(tgt_out, 4))
    model.backward()
    assert abs(loss - loss2) <= 1e-12 * abs(loss)
    np.testing.assert_allclose(model.flat_grads, grads, rtol=0, atol=1e-12 * np.abs(grads).max())


def test_loss_equals_padded_logits_loss_when_pad_patterns_differ():
    """Target positions are kept when either tgt_in or tgt_out is non-pad there: a pad input
    with a real output (and a real input with a pad output) still count as in the padded model."""
    from minitf.loss import label_smoothed_nll
    model = minitf.Transformer(tiny(), dtype="float64")
    src, tgt_in, tgt_out = batch()
    tgt_in, tgt_out = tgt_in.copy(), tgt_out.copy()
    tgt_in[1, 3] = 9        # real input, pad output
    tgt_out[0, 4] = 5       # pad input, real output
    loss = model.forward_loss(src, tgt_in, tgt_out)
    ref = float(label_smoothed_nll(model.forward(src, tgt_in), tgt_out, model.cfg.label_smoothing, 0)[0])
    assert abs(loss - ref) <= 1e-12 * abs(ref)


def test_batch_without_padding_takes_the_unpacked_layout_with_the_same_gradients():
    """No pad anywhere: no row index, no copies; loss and gradients equal those of the same
    sentences inside a padded batch."""
    src = np.array([[5, 6, 7, 3], [9, 10, 5, 3]])
    tgt_in = np.array([[2, 4, 6, 8], [2, 7, 5, 11]])
    tgt_out = np.array([[4, 6, 8, 3], [7, 5, 11, 3]])
    model = minitf.Transformer(tiny(), dtype="float64")
    model.zero_grad()
    loss = model.forward_loss(src, tgt_in, tgt_out)
    assert model._cache["src_rows"] is None and model._cache["tgt_rows"] is None
    model.backward()
    grads = model.flat_grads.copy()
    pad = lambda a: np.concatenate([a, np.zeros((2, 2), dtype=a.dtype)], axis=1)
    model.zero_grad()
    loss2 = model.forward_loss(pad(src), pad(tgt_in), pad(tgt_out))
    assert model._cache["tgt_rows"] is not None
    model.backward()
    assert abs(loss - loss2) <= 1e-12 * abs(loss)
    np.testing.assert_allclose(model.flat_grads, grads, rtol=0, atol=1e-12 * np.abs(grads).max())


def test_adam_split_over_threads_equals_one_pass(monkeypatch):
    """On CPU a large update is split into slices run on a thread pool; the result must be
    identical to the single pass (elementwise arithmetic, same order per element)."""
    from minitf import optim
    src, tgt_in, tgt_out = batch()
    params = []
    for split in (False, True):
        if split:
            monkeypatch.setattr(optim, "_chunks", lambda xp, n: [slice(0, n // 3), slice(n // 3, 2 * n // 3),
                                                                 slice(2 * n // 3, n)])
        model = minitf.Transformer(tiny(), dtype="float32", seed=5)
        opt = minitf.Adam(model, lr=1e-2)
        for _ in range(3):
            model.zero_grad()
            model.forward_loss(src, tgt_in, tgt_out)
            model.backward(loss_weight=4.0)
            opt.step(grad_divisor=4.0)
        params.append(model.flat_params.copy())
    assert not np.array_equal(params[0], minitf.Transformer(tiny(), dtype="float32", seed=5).flat_params)
    np.testing.assert_array_equal(params[1], params[0])


def test_adam_chunks_cover_the_buffer_once():
    from minitf.optim import _chunks
    for n in (10, 3 << 20, (5 << 20) + 7):
        covered = np.zeros(n, dtype=int)
        for c in _chunks(np, n):
            covered[c] += 1
        assert np.all(covered == 1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_dropout_mask_drops_p_and_keeps_the_mean(dtype):
    from minitf import functional as F
    m = F.dropout_mask(F.DropoutSites(0, 0), (400, 500), 0.1, dtype)
    assert m.dtype == dtype and set(np.unique(m)) == {0, dtype(1 / 0.9)}
    assert abs((m == 0).mean() - 0.1) < 0.003          # 200000 draws: 0.003 is ~4.5 sigma
    assert abs(m.astype(np.float64).mean() - 1.0) < 0.005
    again = F.dropout_mask(F.DropoutSites(0, 0), (400, 500), 0.1, dtype)
    np.testing.assert_array_equal(m, again)            # a function of (seed, forward, site, position)
    others = [F.dropout_mask(F.DropoutSites(*sf), (400, 500), 0.1, dtype) for sf in ((1, 0), (0, 1))]
    stream = F.DropoutSites(0, 0)
    F.dropout_mask(stream, (400, 500), 0.1, dtype)     # site 0 (= m)
    others.append(F.dropout_mask(stream, (400, 500), 0.1, dtype))   # site 1
    for other in others:                               # another seed, forward or site: another mask
        assert 0.15 < (other != m).mean() < 0.21       # independent masks differ in 2 p (1 - p) = 18%


@pytest.mark.parametrize("xp_name", ["numpy", "hash"])
def test_a_packed_mask_is_the_padded_masks_rows(xp_name, monkeypatch):
    """A mask is a function of the position in the padded [B, L, D] batch: packing keeps rows."""
    from minitf import functional as F
    from minitf.packing import Rows
    keep = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=bool)
    rows = Rows(keep)
    xp = np
    if xp_name == "hash":   # the path of a device array module (CuPy): hashed positions, nothing drawn for pads
        class Device:
            def __getattr__(self, name):
                return getattr(np, name)
        xp = Device()
    full = F.dropout_bits(F.DropoutSites(3, 4), xp, (3, 5, 10))
    packed = F.dropout_bits(F.DropoutSites(3, 4), xp, (rows.host_index.size, 10), rows)
    np.testing.assert_array_equal(packed, full.reshape(15, 10)[rows.host_index])
    assert 0.45 < full.mean() / 65536 < 0.55


def test_a_layer_built_on_its_own_runs_forward_and_backward():
    # no Transformer around it: the gradients start at zero and accumulate (backward uses +=)
    from minitf.layers import Linear
    lin = Linear(4, 3, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((5, 4))
    dy = np.random.default_rng(2).standard_normal((5, 3))
    lin.forward(x)
    dx = lin.backward(dy)
    np.testing.assert_allclose(dx, dy @ lin.params["weight"].T)
    np.testing.assert_allclose(lin.grads["weight"], x.T @ dy)
    np.testing.assert_allclose(lin.grads["bias"], dy.sum(axis=0))
    lin.forward(x)
    lin.backward(dy)
    np.testing.assert_allclose(lin.grads["weight"], 2 * x.T @ dy)      # accumulated


@pytest.mark.parametrize("dropouts", [dict(dropout=0.0), dict(dropout=0.3),
                                      dict(dropout=0.1, attention_dropout=0.3, relu_dropout=0.3),
                                      dict(dropout=0.3, norm_position="pre")],
                         ids=["none", "residual", "all", "pre-norm"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_the_plain_path_gives_the_packed_loss_and_every_gradient(positional, dropouts):
    # forward_loss(packed=False) runs every layer on [B, L, D] with the pads, as the
    # derivation pages write it; loss and all gradients equal the packed default's, with
    # dropout too (a mask is a function of the position in the padded batch; attention
    # dropout's is drawn on [B, H, T, S] in both layouts, ReLU dropout's like the residual's)
    cfg = tiny(positional=positional, **dropouts)
    src, tgt_in, tgt_out = batch()
    assert (src == 0).any() and (tgt_out == 0).any()          # the batch has padding to skip
    model = minitf.Transformer(cfg, dtype="float64")
    results = []
    for packed in (True, False):
        model.zero_grad()
        model.forward_count = 5
        loss = model.forward_loss(src, tgt_in, tgt_out, packed=packed)
        model.backward()
        results.append((loss, model.flat_grads.copy()))
    (loss_p, g_p), (loss_u, g_u) = results
    assert abs(loss_p - loss_u) <= 1e-12 * abs(loss_p)
    for name, (start, stop, _) in model.slices.items():
        np.testing.assert_allclose(g_u[start:stop], g_p[start:stop], rtol=0, atol=1e-12 * np.abs(g_p).max(),
                                   err_msg=name)


def test_adam_in_cache_sized_blocks_equals_one_pass(monkeypatch):
    """A CPU update runs block by block (optim._BLOCK elements); a block size that does not divide
    the buffer gives exactly the update of one whole pass."""
    from minitf import optim
    src, tgt_in, tgt_out = batch()
    params = []
    for block in (1 << 40, 1000):
        monkeypatch.setattr(optim, "_BLOCK", block)
        model = minitf.Transformer(tiny(), dtype="float32", seed=5)
        assert model.flat_params.size % 1000 and model.flat_params.size > 3000
        opt = minitf.Adam(model, lr=1e-2)
        for _ in range(3):
            model.zero_grad()
            model.forward_loss(src, tgt_in, tgt_out)
            model.backward()
            opt.step()
        params.append(model.flat_params.copy())
    np.testing.assert_array_equal(params[1], params[0])


def test_the_config_keeps_its_former_name():
    """minitf.Config configures a model of either architecture and its recipe; the former name
    TransformerConfig still names it (code written against it keeps working)."""
    assert minitf.TransformerConfig is minitf.Config
    assert minitf.Config.preset("small", arch="rnn").arch == "rnn"


def test_spans_of_packed_rows_are_each_sentences_first_positions_or_none():
    """packing.Rows.spans (what the attention on packed rows reads): each sentence's first row and row count
    among the kept rows where every sentence keeps its first positions (padding at the end) and at least one;
    None where a sentence keeps a later position after a dropped one, keeps none, the batch is empty, or the
    kept positions are not the attention's keys (keys=False); make_rows' `whole` gives every position of an
    unpadded batch."""
    from minitf.packing import Rows, make_rows
    spans = Rows(np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], bool)).spans
    assert spans.start.tolist() == [0, 2, 6] and spans.length.tolist() == [2, 4, 1]
    assert (spans.count, spans.most) == (3, 4) and spans.start.dtype == spans.length.dtype == np.int32
    assert Rows(np.array([[1, 0, 1], [1, 1, 0]], bool)).spans is None
    assert Rows(np.array([[1, 1, 0], [0, 0, 0]], bool)).spans is None
    assert Rows(np.array([[1, 1, 0], [1, 0, 0]], bool), keys=False).spans is None
    assert Rows(np.zeros((0, 3), bool)).spans is None
    full = np.ones((2, 3), bool)
    assert make_rows(full) is None
    whole = make_rows(full, whole=True)
    assert whole.host_index.tolist() == list(range(6)) and whole.spans.start.tolist() == [0, 3]


def test_a_forward_without_a_backward_keeps_no_attention_weights_and_gives_the_same_values():
    # decoding's encoder and a loss alone had kept every layer's softmax weights [B, H, T, S]: a line of 30,084
    # characters held 3.35 GB while it was translated. Under maps_off the weights are made QUERY_BLOCK queries at a time
    # and not kept; the values are the same
    from minitf import functional as F
    from minitf.layers.attention import MultiHeadAttention, maps_off
    from minitf.masks import causal_bias
    rng = np.random.default_rng(0)
    t = F.QUERY_BLOCK * 2 + 37
    q, k, v = (rng.standard_normal((2, 3, t, 8)) for _ in range(3))
    for bias in (np.where(rng.random((2, 1, 1, t)) < 0.1, -1e9, 0.0), causal_bias(t, np, np.float64)[None, None]):
        whole, p = F.attention_forward(q, k, v, bias, 0.3)
        blocks, none = F.attention_forward(q, k, v, bias, 0.3, keep_p=False)
        assert none is None and p.shape == (2, 3, t, t)
        np.testing.assert_allclose(blocks, whole, rtol=1e-12, atol=1e-14)
    cfg = minitf.Config(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, max_len=1024)
    model = minitf.Transformer(cfg, seed=0)
    src = rng.integers(4, 30, size=(2, t))
    tgt = rng.integers(4, 30, size=(2, 40))
    model.eval()
    want = model.forward_loss(src, tgt[:, :-1], tgt[:, 1:])
    attention = [layer for layer in model.layers() if isinstance(layer, MultiHeadAttention)]
    assert all(layer.cache is not None and layer.cache.p is not None for layer in attention)   # kept (plots read them)
    with maps_off():
        assert model.forward_loss(src, tgt[:, :-1], tgt[:, 1:]) == pytest.approx(want, rel=1e-12)
        assert all(layer.cache is None for layer in attention)
    model.forward_loss(src, tgt[:, :-1], tgt[:, 1:])
    assert all(layer.cache is not None for layer in attention)           # on again after the block
    import threading
    from minitf.layers.attention import keeps_maps
    seen = []
    with maps_off(), maps_off():            # per thread, nested: searches side by side share one model
        worker = threading.Thread(target=lambda: seen.append(keeps_maps()))
        worker.start()
        worker.join()
        assert not keeps_maps()
    assert seen == [True] and keeps_maps()
    model.train()
    with maps_off():                     # training keeps them: a backward follows
        model.forward_loss(src, tgt[:, :-1], tgt[:, 1:])
    model.backward()
    from minitf.translate import translate_ids   # decoding's encoder keeps none either
    model.eval()
    translate_ids(model, [list(src[0]) + [3]], beam_size=2, alpha=0.6, max_len_b=3, nbest=1)
    assert all(layer.cache is None for layer in model.encoder.layers() if isinstance(layer, MultiHeadAttention))


def test_the_library_refuses_bad_configs_and_saves_and_loads_as_it_says(tmp_path):
    """A value of the wrong type or range in a Config is one ConfigError naming the field (they had failed later,
    inside the model or the schedule: 'float' object cannot be interpreted as an integer, a division by zero);
    save_checkpoint takes a Tokenizer as its bytes, refuses a .safetensors name (an .npz had been written under it)
    and a call without a model; minitf.load keeps a float64 checkpoint float64; nbest's n and the lines are checked."""
    from minitf.checkpoint import save_checkpoint
    from minitf.data.tokenizer import tokenizer_from_bytes
    from minitf.errors import CheckpointError, ConfigError
    for kw, says in ((dict(decode_alpha="x"), "decode_alpha must be a finite number, got 'x'"),
                     (dict(decode_alpha=-1.0), "decode_alpha must be at least 0"),
                     (dict(vocab_size=200.5), "vocab_size must be a whole number, got 200.5"),
                     (dict(warmup=0), "warmup must be at least 1"),
                     (dict(d_model="64"), "d_model must be a whole number, got '64'"),
                     (dict(dropout="0.1"), "dropout must be a finite number"),
                     (dict(d_model=True), "d_model must be a whole number, got True"),
                     (dict(lr_factor=float("nan")), "lr_factor must be a finite number"),
                     (dict(save_every_minutes=0.0), "save_every_minutes must be above 0")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            minitf.Config(**kw)
    cfg = minitf.Config(vocab_size=np.int64(60), dropout=0, lr_factor=2)     # NumPy's ints, ints for floats
    assert type(cfg.vocab_size) is int and cfg.dropout == 0                   # as Python's: written as JSON
    model = minitf.Transformer(tiny(), dtype="float64")
    with pytest.raises(ConfigError, match=r"src \(2, 0\): no position in it"):
        model.forward_loss(np.zeros((2, 0), dtype=np.int64), np.array([[2, 4], [2, 5]]), np.array([[4, 3], [5, 3]]))
    tok = tokenizer_from_bytes(_tiny_tokenizer_bytes(tmp_path))
    with pytest.raises(CheckpointError, match=r"save_checkpoint writes an \.npz checkpoint; name it \*\.npz"):
        save_checkpoint(tmp_path / "m.safetensors", model, tokenizer=tok)
    with pytest.raises(TypeError, match="give a model, or params and config"):
        save_checkpoint(tmp_path / "w.npz")
    cfg = tiny()
    big = minitf.Transformer(minitf.Config(**{**cfg.to_dict(), "vocab_size": tok.vocab_size}), dtype="float64")
    save_checkpoint(tmp_path / "m.npz", big, tokenizer=tok)              # the Tokenizer itself, as its bytes
    t = minitf.load(tmp_path / "m.npz")
    assert t.model.dtype == np.float64 and minitf.load(tmp_path / "m.npz", dtype="float32").model.dtype == np.float32
    with pytest.raises(TypeError, match=r"n='2': expected a whole number"):
        t.nbest("a b", n="2")
    for unordered in ({"a b", "c"}, {"a b": 1}):
        with pytest.raises(TypeError, match="its order is not the results'"):
            t.translate(unordered)


def _tiny_tokenizer_bytes(tmp_path):
    from minitf.data.tokenizer import Tokenizer
    lines = ["a b c d e f g h", "b c d a e g f h", "h g f e d c b a"] * 20
    return Tokenizer.train(lines, str(tmp_path / "tok.model"), vocab_size=21, model_type="bpe").to_bytes()
