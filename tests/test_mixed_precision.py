"""Mixed precision (dtype="float16"): float16 activations and matmuls, float32 master weights
and Adam state, dynamic loss scaling. NumPy runs float16 too (slowly), so the path is tested
here on tiny models; on a GPU the same code runs on CuPy (tests/test_gpu.py)."""
import numpy as np
import pytest

import minitf
from minitf.optim import LossScaler

from test_learning import reverse_batch


def cfg():
    return minitf.Config(vocab_size=14, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                                    dropout=0.0, label_smoothing=0.1, max_len=16)


def train(dtype, steps=150, scaler=None):
    model = minitf.Transformer(cfg(), dtype=dtype, seed=0)
    opt = minitf.Adam(model, lr=lambda s: 3e-3 * min(1.0, s / 30))
    rng = np.random.default_rng(0)
    losses, skipped = [], 0
    for _ in range(steps):
        src, tgt_in, tgt_out = reverse_batch(rng, 32, 6, 14)
        model.zero_grad()
        losses.append(float(model.forward_loss(src, tgt_in, tgt_out)))
        scale = scaler.scale if scaler else 1.0
        model.backward(loss_weight=scale)
        if scaler is None or scaler.update(bool(np.isfinite(model.flat_grads).all())):
            opt.step(grad_divisor=scale)
        else:
            skipped += 1
    return model, losses, skipped


def test_master_weights_are_float32_and_compute_copy_float16():
    model = minitf.Transformer(cfg(), dtype="float16", seed=0)
    ref = minitf.Transformer(cfg(), dtype="float32", seed=0)
    assert model.flat_params.dtype == np.float16 and model.master_params.dtype == np.float32
    assert model.state_dict()["embedding.weight"].dtype == np.float32
    np.testing.assert_array_equal(model.master_params, ref.flat_params)
    np.testing.assert_array_equal(model.flat_params, ref.flat_params.astype(np.float16))
    opt = minitf.Adam(model)
    assert opt._m.dtype == np.float32


def test_float16_logits_and_loss_close_to_float32():
    src, tgt_in, tgt_out = reverse_batch(np.random.default_rng(1), 8, 6, 14)
    half = minitf.Transformer(cfg(), dtype="float16", seed=0)
    full = minitf.Transformer(cfg(), dtype="float32", seed=0)
    lh, lf = half.forward_loss(src, tgt_in, tgt_out), full.forward_loss(src, tgt_in, tgt_out)
    assert abs(lh - lf) < 1e-2 * abs(lf)
    half.backward()
    full.backward()
    gh, gf = half.flat_grads.astype(np.float32), full.flat_grads
    assert np.linalg.norm(gh - gf) < 2e-2 * np.linalg.norm(gf)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the deliberate overflows
def test_float16_with_loss_scaling_trains_like_float32():
    _, l32, _ = train("float32")
    model, l16, skipped = train("float16", scaler=LossScaler(init_scale=2.0 ** 24, growth_interval=50))
    assert skipped >= 1              # 2^24 overflows float16 gradients: steps skipped, scale lowered
    assert np.mean(l16[-10:]) < 0.5 * np.mean(l16[:10])
    assert abs(np.mean(l16[-10:]) - np.mean(l32[-10:])) < 0.15 * np.mean(l32[-10:])
    assert model.flat_params.dtype == np.float16
    np.testing.assert_array_equal(model.flat_params, model.master_params.astype(np.float16))


def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps():
    s = LossScaler(init_scale=8.0, growth_interval=3)
    assert s.update(False) is False and s.scale == 4.0
    assert all(s.update(True) for _ in range(3)) and s.scale == 8.0
    for _ in range(10):
        s.update(False)
    assert s.scale == 1.0  # never below min_scale
