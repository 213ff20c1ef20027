"""The pieces learn together: a small model masters a synthetic reverse task."""
import numpy as np

import minitf


def reverse_batch(rng, batch, max_len, vocab):
    """Source: random tokens + EOS; target: the same tokens reversed. Ragged, right-padded."""
    src = np.zeros((batch, max_len + 1), dtype=np.int64)
    tgt_in, tgt_out = src.copy(), src.copy()
    for b in range(batch):
        n = rng.integers(max_len // 2, max_len + 1)
        body = rng.integers(4, vocab, size=n)
        src[b, : n + 1] = np.append(body, 3)                 # + EOS
        tgt_in[b, : n + 1] = np.append(2, body[::-1])        # BOS + reversed
        tgt_out[b, : n + 1] = np.append(body[::-1], 3)       # reversed + EOS
    return src, tgt_in, tgt_out


def test_small_model_learns_to_reverse():
    cfg = minitf.Config(vocab_size=14, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                                   dropout=0.0, label_smoothing=0.1, max_len=16)
    model = minitf.Transformer(cfg, seed=0)
    opt = minitf.Adam(model, lr=lambda step: 3e-3 * min(1.0, step / 30))
    rng = np.random.default_rng(0)
    losses = []
    for step in range(400):
        src, tgt_in, tgt_out = reverse_batch(rng, 32, 6, 14)
        model.zero_grad()
        losses.append(model.forward_loss(src, tgt_in, tgt_out))
        model.backward()
        opt.step()
    nll = float(model.last_stats["nll_sum"]) / float(model.last_stats["n_tokens"])
    assert np.mean(losses[:10]) > 2.5
    assert np.mean(losses[-20:]) < 0.8, f"loss did not fall: {losses[::50]}"
    assert nll < 0.3, f"reverse task not learned: final nll {nll:.3f}, losses {losses[::50]}"
    model.eval()
    src, tgt_in, tgt_out = reverse_batch(rng, 32, 6, 14)
    pred = model.forward(src, tgt_in).argmax(-1)
    acc = (pred == tgt_out)[tgt_out != 0].mean()
    assert acc > 0.9, f"teacher-forced accuracy {acc:.3f}"
