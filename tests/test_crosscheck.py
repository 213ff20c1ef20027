"""Cross-checks of the whole model against independent implementations, in float64, dropout 0.

1. Always: a naive NumPy reference written here (loops over batch, heads and query rows,
   explicit per-row softmax): loss and logits agree to 1e-7.
2. With PyTorch (skipped without it): bench/torch_model.py, written from the paper, loads
   minitf's parameters; loss, logits and EVERY parameter gradient (torch autograd) agree to 1e-7.
Errors are norm-wise: ||a - b|| / max(||a||, ||b||) per tensor.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import minitf

TOL = 1e-7
PAD = 0

CONFIGS = {
    "plain": dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2),
    "dk_not_d_over_h": dict(vocab_size=23, d_model=16, n_heads=3, d_k=5, d_ff=24, n_layers=2),
    "learned_positions": dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2, positional="learned"),
}


def make_model(name, seed=0):
    cfg = minitf.Config(**CONFIGS[name], dropout=0.0, label_smoothing=0.1, pad_id=PAD, max_len=32)
    model = minitf.Transformer(cfg, device="cpu", dtype="float64", seed=seed)
    # perturb LayerNorm gains/biases and linear biases away from 1/0 so their gradients matter
    rng = np.random.default_rng(seed + 100)
    for n, p in model.state_dict().items():
        if "norm" in n or n.endswith(".bias"):
            p += 0.1 * rng.standard_normal(p.shape)
    return cfg, model


def make_batch(cfg, rng, b=3, s=7, t=6):
    """Random ids in [1, V) with trailing padding; every row keeps at least 2 real tokens.
    One source row and one target row are full length (no padding)."""
    src = rng.integers(1, cfg.vocab_size, size=(b, s))
    tgt = rng.integers(1, cfg.vocab_size, size=(b, t + 1))
    src_len = [s, 2] + list(rng.integers(2, s + 1, size=b - 2))
    tgt_len = [3, t + 1] + list(rng.integers(3, t + 2, size=b - 2))
    for i in range(b):
        src[i, src_len[i]:] = PAD
        tgt[i, tgt_len[i]:] = PAD
    return src, tgt[:, :-1], tgt[:, 1:]


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b), 1e-300))


# ----------------------------------------------------------------------------- naive NumPy reference
def ref_forward(P, cfg, src, tgt_in):
    """Logits [B, T, V] computed the slow, obvious way."""
    D, H, K = cfg.d_model, cfg.n_heads, cfg.d_k
    E = P["embedding.weight"]

    def positions(n):
        if cfg.positional == "learned":
            return P["positional.weight"][:n]
        pe = np.zeros((n, D))
        for pos in range(n):
            for j in range(D):
                angle = pos / 10000 ** ((j - j % 2) / D)
                pe[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
        return pe

    def lin(name, x):
        return x @ P[name + ".weight"] + P[name + ".bias"]

    def norm(name, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.layer_norm_eps) * P[name + ".weight"] + P[name + ".bias"]

    def attn(name, xq, xkv, allowed):
        """xq [Tq, D], xkv [Tk, D] of ONE sequence; allowed(i, j) -> bool."""
        q, k, v = lin(name + ".q", xq), lin(name + ".k", xkv), lin(name + ".v", xkv)
        heads = np.zeros((xq.shape[0], H * K))
        for h in range(H):
            cols = slice(h * K, (h + 1) * K)
            for i in range(xq.shape[0]):
                js = [j for j in range(xkv.shape[0]) if allowed(i, j)]
                scores = np.array([q[i, cols] @ k[j, cols] / math.sqrt(K) for j in js])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                heads[i, cols] = sum(wj * v[j, cols] for wj, j in zip(w, js))
        return lin(name + ".out", heads)

    def ffn(name, x):
        return lin(name + ".fc2", np.maximum(lin(name + ".fc1", x), 0.0))

    out = []
    for b in range(src.shape[0]):
        s_ids, t_ids = src[b], tgt_in[b]
        x = E[s_ids] * math.sqrt(D) + positions(len(s_ids))
        src_ok = lambda i, j: s_ids[j] != PAD
        for l in range(cfg.n_layers):
            n = f"encoder.layers.{l}"
            x = norm(n + ".norm1", x + attn(n + ".self_attn", x, x, src_ok))
            x = norm(n + ".norm2", x + ffn(n + ".ffn", x))
        y = E[t_ids] * math.sqrt(D) + positions(len(t_ids))
        tgt_ok = lambda i, j: j <= i and t_ids[j] != PAD
        for l in range(cfg.n_decoder_layers):
            n = f"decoder.layers.{l}"
            y = norm(n + ".norm1", y + attn(n + ".self_attn", y, y, tgt_ok))
            y = norm(n + ".norm2", y + attn(n + ".cross_attn", y, x, src_ok))
            y = norm(n + ".norm3", y + ffn(n + ".ffn", y))
        out.append(y @ E.T)
    return np.stack(out)


def ref_loss(logits, tgt_out, eps):
    total, count = 0.0, 0
    for b in range(tgt_out.shape[0]):
        for t in range(tgt_out.shape[1]):
            if tgt_out[b, t] == PAD:
                continue
            z = logits[b, t]
            logp = z - z.max() - math.log(np.exp(z - z.max()).sum())
            total += (1 - eps) * -logp[tgt_out[b, t]] + eps * -logp.mean()
            count += 1
    return total / count


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_naive_numpy_reference(name):
    cfg, model = make_model(name)
    src, tgt_in, tgt_out = make_batch(cfg, np.random.default_rng(1))
    model.eval()
    logits = model.forward(src, tgt_in)
    loss = model.forward_loss(src, tgt_in, tgt_out)
    ref_logits = ref_forward({n: np.array(p) for n, p in model.state_dict().items()}, cfg, src, tgt_in)
    assert rel_err(logits, ref_logits) <= TOL
    assert abs(loss - ref_loss(ref_logits, tgt_out, cfg.label_smoothing)) / abs(loss) <= TOL


# ----------------------------------------------------------------------------- PyTorch autograd
@pytest.fixture(scope="module")
def torch_model():
    pytest.importorskip("torch", reason="PyTorch is optional: the cross-check against torch autograd needs it")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import torch_model as tm
    return tm


@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_autograd(name, strong, torch_model):
    """The PyTorch model of the GPU benchmarks, as written plainly and as the strong baseline
    (scaled_dot_product_attention, logits on the rows with a loss): minitf's loss, logits and
    every gradient."""
    tm = torch_model
    cfg, model = make_model(name)
    src, tgt_in, tgt_out = make_batch(cfg, np.random.default_rng(2))
    ref = tm.from_minitf_state(model.state_dict(), cfg, dtype="float64", strong=strong)
    s, ti, to = tm.as_ids(src), tm.as_ids(tgt_in), tm.as_ids(tgt_out)

    model.zero_grad()
    loss = model.forward_loss(src, tgt_in, tgt_out)
    model.backward()
    ref_loss_t = ref.loss(s, ti, to)
    ref_loss_t.backward()
    assert abs(loss - ref_loss_t.item()) / abs(loss) <= TOL

    assert rel_err(model.forward(src, tgt_in), ref.forward(s, ti).detach().numpy()) <= TOL

    grads, ref_grads = model.grad_dict(), ref.grad_dict()
    assert sorted(grads) == sorted(ref_grads)
    for n in grads:
        if n.endswith(".k.bias"):
            # softmax ignores a per-row shift, so d loss / d key bias is exactly 0; both
            # sides hold only round-off (~1e-17), where a relative error means nothing
            assert max(np.linalg.norm(grads[n]), np.linalg.norm(ref_grads[n])) < 1e-12, n
            continue
        assert np.linalg.norm(ref_grads[n]) > 1e-6, f"{n}: no gradient reaches it, the check would be vacuous"
        err = rel_err(grads[n], ref_grads[n])
        assert err <= TOL, f"{n}: gradient relative error {err:.2e} > {TOL}"
