"""The GPU path (CuPy) against the NumPy path. Runs where CuPy and a CUDA GPU are present;
everywhere else each test is skipped with the reason (no CuPy / no GPU)."""
import numpy as np
import pytest

import minitf
from minitf.backend import gpu_available, to_numpy

ok, why = gpu_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no GPU: {why}")


def cfg(**kw):
    base = dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2, dropout=0.0, max_len=64)
    base.update(kw)
    return minitf.TransformerConfig(**base)


SRC = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 5, 6, 7, 3]])
TGT_IN = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 11, 12]])
TGT_OUT = np.array([[4, 6, 8, 3, 0], [7, 5, 11, 12, 3]])


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_gpu_loss_logits_and_every_gradient_match_cpu_float64(positional):
    c = cfg(positional=positional)
    cpu = minitf.Transformer(c, device="cpu", dtype="float64", seed=0)
    gpu = minitf.Transformer(c, device="gpu", dtype="float64", seed=0)
    np.testing.assert_allclose(to_numpy(gpu.forward(SRC, TGT_IN)), cpu.forward(SRC, TGT_IN), rtol=1e-10, atol=1e-12)
    lc = cpu.forward_loss(SRC, TGT_IN, TGT_OUT)
    lg = float(gpu.forward_loss(SRC, TGT_IN, TGT_OUT))
    assert abs(lc - lg) <= 1e-10 * abs(lc)
    cpu.backward()
    gpu.backward()
    for name, g in cpu.grad_dict().items():
        gg = to_numpy(gpu.grad_dict()[name])
        err = np.linalg.norm(gg - g) / max(np.linalg.norm(g), 1e-30)
        assert err <= 1e-9 or np.linalg.norm(g) < 1e-12, (name, err)


def test_gpu_adam_step_matches_cpu():
    c = cfg()
    models = [minitf.Transformer(c, device=d, dtype="float64", seed=1) for d in ("cpu", "gpu")]
    for m in models:
        opt = minitf.Adam(m, lr=minitf.NoamSchedule(16, 10))
        for _ in range(3):
            m.zero_grad()
            m.forward_loss(SRC, TGT_IN, TGT_OUT)
            m.backward()
            opt.step()
    np.testing.assert_allclose(to_numpy(models[1].flat_params), models[0].flat_params, rtol=1e-9, atol=1e-12)


def test_gpu_training_loss_falls_float32():
    m = minitf.Transformer(cfg(dropout=0.1), device="gpu", seed=0)
    opt = minitf.Adam(m, lr=3e-3)
    losses = []
    for _ in range(60):
        m.zero_grad()
        losses.append(float(m.forward_loss(SRC, TGT_IN, TGT_OUT)))
        m.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]


def test_gpu_decoding_matches_cpu():
    from minitf.decode import beam_search, greedy_search
    c = cfg(dropout=0.1)
    cpu = minitf.Transformer(c, device="cpu", dtype="float64", seed=3)
    gpu = minitf.Transformer(c, device="gpu", dtype="float64", seed=3)
    assert greedy_search(gpu, SRC, max_len_b=6) == greedy_search(cpu, SRC, max_len_b=6)
    assert beam_search(gpu, SRC, beam_size=3, max_len_b=6) == beam_search(cpu, SRC, beam_size=3, max_len_b=6)


def test_checkpoint_saved_on_gpu_loads_on_cpu(tmp_path):
    from minitf.checkpoint import load_checkpoint, save_checkpoint
    gpu = minitf.Transformer(cfg(), device="gpu", seed=4).eval()
    opt = minitf.Adam(gpu)
    save_checkpoint(tmp_path / "g.npz", gpu, opt)
    ck = load_checkpoint(tmp_path / "g.npz")
    assert all(isinstance(a, np.ndarray) for a in ck.params.values())
    cpu = ck.build_model(device="cpu")
    np.testing.assert_allclose(cpu.forward(SRC, TGT_IN), to_numpy(gpu.forward(SRC, TGT_IN)), rtol=1e-4, atol=1e-5)
    back = ck.build_model(device="gpu")
    np.testing.assert_array_equal(to_numpy(back.flat_params), to_numpy(gpu.flat_params))
