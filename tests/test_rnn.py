"""The recurrent baseline driven by the same decoding, checkpoint and training code."""
import numpy as np
import pytest

import minitf
from minitf.decode import beam_search, greedy_search
from minitf.loss import log_softmax
from minitf.architectures import build_model

from plain_beam import mixed_length_sources, plain_beam_search


def rnn_model(vocab=13, seed=0, attention="general", dtype="float64", n_layers=2):
    cfg = minitf.Config(arch="rnn", vocab_size=vocab, d_model=8, rnn_hidden=12, n_layers=n_layers,
                                   n_heads=2, d_ff=8, dropout=0.1, attention=attention)
    return build_model(cfg, dtype=dtype, seed=seed)


SRC = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 5, 6, 7, 3], [4, 3, 0, 0, 0, 0]])


@pytest.mark.parametrize("attention", ["general", "dot", "additive"])
def test_step_logits_equal_the_training_forward(attention):
    """The recurrent state stepped one token at a time gives the teacher-forced forward's logits."""
    model = rnn_model(attention=attention).eval()
    tgt = np.array([[2, 4, 6, 5, 9], [2, 7, 7, 4, 4], [2, 5, 0, 0, 0]])
    full = log_softmax(model.forward(SRC, tgt))
    dec = model.incremental_decoder(SRC, 5)
    for t in range(5):
        np.testing.assert_allclose(dec.step(tgt[:, t]), full[:, t], atol=1e-12)


def test_reorder_moves_state_with_beams_and_drops_finished_sentences():
    model = rnn_model().eval()
    k = 2
    dec = model.incremental_decoder(SRC, 6, beam=k)
    dec.step(np.full(3, 2))                              # one row a sentence at first
    dec.reorder(np.repeat(np.arange(3), k))              # then k
    dec.step(np.array([5, 6, 9, 9, 7, 8]))
    # sentence 1 leaves; sentence 0's beams swap; sentence 2's both take beam 0
    dec.reorder(np.array([1, 0, 4, 4]))
    got = dec.step(np.array([5, 6, 7, 8]))
    for row, (sent, tokens) in enumerate([(0, [2, 6, 5]), (0, [2, 5, 6]), (2, [2, 7, 7]), (2, [2, 7, 8])]):
        want = log_softmax(model.forward(SRC[sent:sent + 1], np.array([tokens])))[0, -1]
        np.testing.assert_allclose(got[row], want, atol=1e-12)


@pytest.mark.parametrize("vocab,beam,max_len_b,seed", [(13, 4, 6, 0), (13, 1, 8, 1), (40, 3, 3, 2), (7, 4, 4, 4)])
def test_the_same_beam_search_as_the_transformer(vocab, beam, max_len_b, seed):
    """decode.beam_search (one search for both models) returns what the plain loop does."""
    model = rnn_model(vocab=vocab, seed=seed)
    src = np.minimum(SRC, vocab - 1)
    want = plain_beam_search(model, src, beam_size=beam, max_len_b=max_len_b)
    assert beam_search(model, src, beam_size=beam, max_len_b=max_len_b) == want
    assert any(len(h) for h in want)


def test_continuous_batching_with_the_recurrent_state():
    model = rnn_model(vocab=13, seed=8, attention="additive")
    src = mixed_length_sources(vocab=13)
    want = plain_beam_search(model, src, beam_size=3, max_len_b=4)
    model.train()
    assert beam_search(model, src, beam_size=3, max_len_b=4, batch_size=3) == want
    assert greedy_search(model, src, max_len_b=4, batch_size=3) == greedy_search(model, src, max_len_b=4)
    assert model.training   # the caller's mode is given back


def test_checkpoint_round_trip_keeps_the_arch(tmp_path):
    from minitf.checkpoint import load_checkpoint, save_checkpoint
    model = rnn_model(dtype="float32", attention="additive").eval()
    path = tmp_path / "rnn.npz"
    save_checkpoint(path, model, train_state={"step": 1})
    loaded = load_checkpoint(path)
    again = loaded.build_model()
    assert loaded.config.arch == "rnn" and type(again) is type(model)
    tgt = np.array([[2, 4, 6], [2, 7, 7], [2, 5, 0]])
    np.testing.assert_array_equal(again.forward(SRC, tgt), model.forward(SRC, tgt))


def test_rnn_learns_to_copy():
    """A few hundred Adam steps on a copy task: the loss falls and greedy decoding copies."""
    from minitf.optim import Adam
    cfg = minitf.Config(arch="rnn", vocab_size=12, d_model=16, rnn_hidden=32, n_layers=1, n_heads=2,
                                   d_ff=8, dropout=0.0, label_smoothing=0.0)
    model = build_model(cfg, seed=0)
    opt = Adam(model, lr=1e-2)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(300):
        body = rng.integers(4, 12, (16, 5))
        src = np.concatenate([body, np.full((16, 1), 3)], axis=1)
        tgt_in = np.concatenate([np.full((16, 1), 2), body], axis=1)
        tgt_out = np.concatenate([body, np.full((16, 1), 3)], axis=1)
        model.zero_grad()
        losses.append(model.forward_loss(src, tgt_in, tgt_out))
        model.backward()
        opt.step()
    assert np.mean(losses[-20:]) < 0.1 * np.mean(losses[:20])
    body = rng.integers(4, 12, (8, 5))
    src = np.concatenate([body, np.full((8, 1), 3)], axis=1)
    assert greedy_search(model, src, max_len_b=3) == body.tolist()


@pytest.mark.parametrize("dtype,flag", [("float16", "--fp16"), ("bfloat16", "--bf16")])
def test_mixed_precision_is_refused_with_a_plain_message(dtype, flag):
    with pytest.raises(minitf.errors.ConfigError, match=flag):
        rnn_model(dtype=dtype)


@pytest.mark.parametrize("field,value", [("arch", "gru"), ("attention", "concat"), ("rnn_hidden", 7),
                                         ("positional", "learned")])
def test_bad_rnn_config_values_are_plain_errors(field, value):
    # (learned positions had been taken, and their max_len then refused longer sources of a model without positions)
    with pytest.raises(minitf.errors.ConfigError, match=field):
        minitf.Config(**{"arch": "rnn", field: value})


def test_any_width_is_an_rnn_width_and_each_class_takes_its_own_arch(tmp_path):
    # the Transformer's heads had required an rnn's d_model to divide by the preset's head count (--heads is refused for
    # --arch rnn: no flag got round it); a Config of one arch had built the other class, whose checkpoint no load read
    cfg = minitf.Config.preset("small", arch="rnn", vocab_size=13, d_model=30)
    assert build_model(cfg).embedding.params["weight"].shape == (13, 30)
    for cls, other in ((minitf.Transformer, cfg), (type(rnn_model()), minitf.Config(vocab_size=13, d_model=8, n_heads=2,
                                                                                    d_ff=8, n_layers=1))):
        with pytest.raises(minitf.errors.ConfigError, match="build_model"):
            cls(other)


def test_a_forward_without_loss_has_no_backward():
    """backward() after forward() (no loss) must not reuse an earlier loss: a plain error."""
    for model in (rnn_model(), minitf.Transformer(minitf.Config(vocab_size=13, d_model=8, n_heads=2,
                                                                          d_ff=8, n_layers=1), dtype="float64")):
        tgt = np.array([[2, 4, 6], [2, 7, 7], [2, 5, 0]])
        model.forward_loss(SRC, tgt, tgt)
        model.forward(SRC, tgt)
        with pytest.raises(RuntimeError, match="forward_loss"):
            model.backward()
