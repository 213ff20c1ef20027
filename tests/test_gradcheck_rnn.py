"""The layers of the recurrent baseline and of Table 1 against central differences, float64,
relative error <= 1e-6: every parameter and every input gradient, with padded sequences."""
import numpy as np
import pytest

from minitf.layers import LSTM, BiLSTM, RecurrentAttention
from minitf.masks import padding_bias

from gradcheck_util import check_layer, check_model

B, L, I, HD, S, Q, M = 3, 5, 4, 3, 6, 5, 4


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def padded_mask():
    """[B, L] bool: lengths 5, 3 and 1 (right padding)."""
    return np.arange(L)[None, :] < np.array([5, 3, 1])[:, None]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("mask", [None, "padded"])
def test_gradcheck_lstm_outputs_and_final_state(rng, reverse, mask):
    layer = LSTM(I, HD, rng, reverse=reverse)
    m = padded_mask() if mask else None
    x, h0, c0 = rng.standard_normal((B, L, I)), rng.standard_normal((B, HD)), rng.standard_normal((B, HD))
    r_h, r_c = rng.standard_normal((B, HD)), rng.standard_normal((B, HD))

    def forward(x, h0, c0):
        out, (h, c) = layer.forward(x, m, h0, c0)
        # the final state enters the checked sum too: sum(out * R) + sum(h * r_h) + sum(c * r_c)
        return np.concatenate([out.reshape(-1), [(h * r_h).sum() + (c * r_c).sum()]])

    def backward(dout):
        dx, dh0, dc0 = layer.backward(dout[:-1].reshape(B, L, HD), dout[-1] * r_h, dout[-1] * r_c)
        return dx, dh0, dc0

    errs = check_layer(layer, [x, h0, c0], forward, backward, rng)
    assert set(errs) == {"w_x", "w_h", "b", "input0", "input1", "input2"}


def test_lstm_padding_carries_the_state(rng):
    """A padded row ends with the state of its last token, exactly as if it were run unpadded."""
    layer = LSTM(I, HD, rng)
    x = rng.standard_normal((B, L, I))
    out, (h, c) = layer.forward(x, padded_mask())
    alone, (h1, c1) = LSTM.forward(layer, x[1:2, :3])
    np.testing.assert_allclose(h[1], h1[0], rtol=1e-12)
    np.testing.assert_allclose(out[1, :3], alone[0], rtol=1e-12)
    np.testing.assert_allclose(out[1, 3:], np.broadcast_to(h1[0], (2, HD)), rtol=1e-12)
    back = LSTM(I, HD, np.random.default_rng(1), reverse=True)
    out_b, _ = back.forward(x, padded_mask())
    alone_b, _ = back.forward(x[1:2, :3])
    np.testing.assert_allclose(out_b[1, :3], alone_b[0], rtol=1e-12)   # the right-to-left pass starts at the last token


def test_lstm_step_matches_the_sequence_forward(rng):
    layer = LSTM(I, HD, rng)
    x = rng.standard_normal((B, L, I))
    out, _ = layer.forward(x)
    h = c = np.zeros((B, HD))
    for t in range(L):
        h, c = layer.step(x[:, t], h, c)
        np.testing.assert_allclose(h, out[:, t], rtol=1e-12)


def test_gradcheck_bilstm_with_padding(rng):
    layer = BiLSTM(I, HD, rng)
    m = padded_mask()
    errs = check_layer(layer, [rng.standard_normal((B, L, I))], lambda x: layer.forward(x, m), layer.backward, rng)
    assert len(errs) == 7   # two directions x (w_x, w_h, b) + the input


@pytest.mark.parametrize("kind", RecurrentAttention.KINDS)
def test_gradcheck_recurrent_attention_with_padding(rng, kind):
    d_q = M if kind == "dot" else Q
    layer = RecurrentAttention(kind, d_q, M, rng, d_attn=3)
    src = np.array([[5, 4, 3, 2, 1, 1], [5, 4, 3, 0, 0, 0], [7, 0, 0, 0, 0, 0]])
    bias = padding_bias(src, 0, np.float64)[:, 0, 0]    # [B, S]
    q, memory = rng.standard_normal((B, 2, d_q)), rng.standard_normal((B, S, M))
    errs = check_layer(layer, [q, memory], lambda q, m: layer.forward(q, m, bias), layer.backward, rng)
    assert len(errs) == {"general": 1, "dot": 0, "additive": 3}[kind] + 2
    ctx = layer.forward(q, memory, bias)
    np.testing.assert_allclose(ctx[2], np.broadcast_to(memory[2, 0], (2, M)), rtol=1e-12)   # one real position: all weight


def rnn_cfg(**kw):
    import minitf
    base = dict(arch="rnn", vocab_size=11, d_model=4, rnn_hidden=6, n_layers=2, n_heads=1, d_ff=4, dropout=0.0,
                label_smoothing=0.1, pad_id=0)
    base.update(kw)
    return minitf.Config(**base)


def rnn_batch():
    """Padded sources and targets (BOS 2, EOS 3, pad 0), one target longer than the other."""
    src = np.array([[5, 6, 7, 3, 0], [8, 9, 4, 6, 3]])
    tgt_in = np.array([[2, 4, 5, 0], [2, 7, 7, 4]])
    tgt_out = np.array([[4, 5, 3, 0], [7, 7, 4, 3]])
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("attention,dropout", [("general", 0.0), ("dot", 0.0), ("additive", 0.0), ("general", 0.3)])
def test_gradcheck_rnnsearch_every_parameter(attention, dropout):
    """The whole recurrent model (two bi-LSTM encoder layers, two decoder layers, input feeding,
    tied embeddings), padded batch: every parameter against central differences."""
    from minitf.architectures import build_model
    model = build_model(rnn_cfg(attention=attention, dropout=dropout), dtype="float64", seed=3)
    src, tgt_in, tgt_out = rnn_batch()
    # a point away from the near-linear start (at init the attention's gradients are ~1e-6 and
    # the differences' round-off dominates): every weight x 3
    model.flat_params *= 3.0
    n_params = check_model(model, src, tgt_in, tgt_out)
    # embedding, encoder (2 layers x 2 directions x 3), decoder (2 x 3), combine, attention
    assert n_params == 1 + 12 + 6 + 2 + {"general": 1, "dot": 0, "additive": 3}[attention]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gradcheck_conv1d(rng, k):
    from minitf.layers import Conv1d
    layer = Conv1d(I, HD, k, rng)
    errs = check_layer(layer, [rng.standard_normal((B, L, I))], layer.forward, layer.backward, rng)
    assert len(errs) == 3
    x = rng.standard_normal((1, L, I))
    y = layer.forward(x)
    w = layer.params["weight"]
    t, before = 2, (k - 1) // 2        # position t sees t - before ... t - before + k - 1
    want = sum(x[0, t - before + j] @ w[j * I:(j + 1) * I] for j in range(k)) + layer.params["bias"]
    np.testing.assert_allclose(y[0, t], want, rtol=1e-12)
