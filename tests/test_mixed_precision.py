"""Mixed precision: float16 (dtype="float16", --fp16) or bfloat16 (dtype="bfloat16", --bf16)
activations and matmuls, float32 master weights and Adam state; dynamic loss scaling for
float16, none for bfloat16 (it has float32's exponent range). NumPy runs float16 too (slowly), so
that path is tested here on tiny models; bfloat16 is a GPU dtype, tested on the GPU path over the
strict CuPy stand-in (tests/strict_cupy.py, its kernels emulated); on a GPU the same code runs on
CuPy (tests/test_gpu.py)."""
import numpy as np
import pytest

import minitf
import strict_cupy
from minitf import backend
from minitf.backend import to_numpy
from minitf.optim import LossScaler

from test_learning import reverse_batch

BF16 = backend.dtype_named("bfloat16")


def cfg():
    return minitf.Config(vocab_size=14, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                                    dropout=0.0, label_smoothing=0.1, max_len=16)


def train(dtype, steps=150, scaler=None, device="cpu"):
    model = minitf.Transformer(cfg(), dtype=dtype, seed=0, device=device)
    opt = minitf.Adam(model, lr=lambda s: 3e-3 * min(1.0, s / 30))
    rng = np.random.default_rng(0)
    losses, skipped = [], 0
    for _ in range(steps):
        src, tgt_in, tgt_out = reverse_batch(rng, 32, 6, 14)
        model.zero_grad()
        losses.append(float(model.forward_loss(src, tgt_in, tgt_out)))
        scale = scaler.scale if scaler else 1.0
        model.backward(loss_weight=scale)
        if scaler is None or scaler.update(bool(np.isfinite(to_numpy(model.flat_grads)).all())):
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


# ----------------------------------------------------------------------------- bfloat16 (the GPU path)
def test_bfloat16_master_weights_are_float32_and_compute_copy_bfloat16(standin):
    model = minitf.Transformer(cfg(), dtype="bfloat16", seed=0, device="gpu")
    ref = minitf.Transformer(cfg(), dtype="float32", seed=0)
    assert model.flat_params.dtype == BF16 and model.flat_grads.dtype == BF16
    assert model.master_params.dtype == np.float32
    assert model.state_dict()["embedding.weight"].dtype == np.float32
    np.testing.assert_array_equal(to_numpy(model.master_params), ref.flat_params)
    np.testing.assert_array_equal(to_numpy(model.flat_params).view(np.uint16), ref.flat_params.astype(BF16).view(np.uint16))
    assert minitf.Adam(model)._m.dtype == np.float32


def test_bfloat16_logits_loss_and_gradients_are_float32_at_the_same_weights(standin):
    """Each 16-bit step on the GPU path against float32 at the weights it holds (the master weights
    rounded to its dtype): a bfloat16 value keeps 8 bits, float16 11, so bfloat16's gradients are
    a few % from float32's and several times as far as float16's (3.96% and 0.22% on the stand-in)."""
    src, tgt_in, tgt_out = reverse_batch(np.random.default_rng(1), 8, 6, 14)
    errors = {}
    for dtype in ("float16", "bfloat16"):
        half = minitf.Transformer(cfg(), dtype=dtype, seed=0, device="gpu")
        full = minitf.Transformer(cfg(), dtype="float32", seed=0)
        full.flat_params[...] = full.flat_params.astype(half.dtype).astype(np.float32)
        lh, lf = float(half.forward_loss(src, tgt_in, tgt_out)), full.forward_loss(src, tgt_in, tgt_out)
        assert abs(lh - lf) < 1e-2 * abs(lf)
        half.backward()
        full.backward()
        gh, gf = to_numpy(half.flat_grads).astype(np.float32), full.flat_grads
        errors[dtype] = np.linalg.norm(gh - gf) / np.linalg.norm(gf)
        zh, zf = to_numpy(half.forward(src, tgt_in)).astype(np.float32), full.forward(src, tgt_in)
        assert np.abs(zh - zf).max() < 3e-2 * np.abs(zf).max()
    assert errors["bfloat16"] < 6e-2 and errors["float16"] < 5e-3, errors
    assert errors["bfloat16"] > 3 * errors["float16"], errors


def test_bfloat16_without_loss_scaling_trains_like_float32(standin):
    _, l32, _ = train("float32", steps=90)
    model, lb, skipped = train("bfloat16", steps=90, device="gpu")
    assert skipped == 0
    # float32 itself ends at about half its first loss here (0.495 on one machine): the products' rounding in NumPy's
    # BLAS differs from CPU to CPU, so learning is asked as 0.6 and likeness to float32's loss at the end as 5%
    assert np.mean(lb[-10:]) < 0.6 * np.mean(lb[:10])
    assert abs(np.mean(lb[-10:]) - np.mean(l32[-10:])) < 0.05 * np.mean(l32[-10:])
    assert model.flat_params.dtype == BF16
    np.testing.assert_array_equal(to_numpy(model.flat_params).view(np.uint16),
                                  to_numpy(model.master_params).astype(BF16).view(np.uint16))


def test_bfloat16_on_a_cupy_without_it_is_one_clear_error(standin, monkeypatch):
    """CuPy leaves its bfloat16 loops out without ml_dtypes or on NumPy before 2.1.2: the model says
    so when it is built, naming what is needed, not in the middle of a step."""
    def no_bf16(shape, dtype=float, order="C", _real=strict_cupy.ones):
        if np.dtype(dtype) == BF16:
            raise TypeError("Unsupported type <class 'numpy.dtype[bfloat16]'>")
        return _real(shape, dtype=dtype, order=order)
    monkeypatch.setattr(strict_cupy, "ones", no_bf16)
    with pytest.raises(minitf.DeviceError, match=r"--bf16: CuPy .* cannot compute in bfloat16 here .*ml_dtypes"):
        minitf.Transformer(cfg(), dtype="bfloat16", seed=0, device="gpu")
    minitf.Transformer(cfg(), dtype="float16", seed=0, device="gpu")      # the other dtypes are not asked


@pytest.mark.parametrize("late", ["argmax", "multiply"])
def test_bfloat16_kernels_a_run_needs_later_are_compiled_when_the_model_is_built(standin, monkeypatch, late):
    """Decoding's argmax over bfloat16 logits and a product with a Python float into a bfloat16 array are CuPy
    kernels of their own (compiled on first use, with cuda_bf16.h): one that cannot be built is the same clear
    error when the model is built, not in the middle of a run."""
    def refuse(*a, **k):
        raise RuntimeError("nvrtc: error: cannot open source file \"cuda_bf16.h\"")
    if late == "argmax":
        real = strict_cupy.ndarray.argmax
        monkeypatch.setattr(strict_cupy.ndarray, "argmax",
                            lambda self, *a, **k: refuse() if self.dtype == BF16 else real(self, *a, **k))
    else:
        real = strict_cupy.multiply
        monkeypatch.setattr(strict_cupy, "multiply", lambda x, y, out=None, **k: refuse()
                            if out is not None and out.dtype == BF16 and isinstance(y, float) else real(x, y, out=out, **k))
    with pytest.raises(minitf.DeviceError, match=r"--bf16: CuPy .* cannot compute in bfloat16 here \(RuntimeError"):
        minitf.Transformer(cfg(), dtype="bfloat16", seed=0, device="gpu")


def test_float16_products_on_the_cpu_are_float32_blas_rounded_once(monkeypatch):
    """NumPy's own float16 product adds in float32 in a loop without BLAS (a small model's --fp16 step took 40 s
    against 0.17 s in float32): every product of the CPU path multiplies float16 operands as float32 arrays (BLAS)
    and rounds the result once to float16, the same values up to the order of the sums."""
    from minitf import functional, gemm
    seen = []
    real = np.matmul

    def spy(a, b, *args, **kw):
        seen.append((a.dtype, b.dtype))
        return real(a, b, *args, **kw)
    monkeypatch.setattr(np, "matmul", spy)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 300)).astype(np.float16)
    w = rng.standard_normal((300, 24)).astype(np.float16)
    dy = rng.standard_normal((40, 24)).astype(np.float16)

    def want(a, b):
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    y = gemm.product(x, w)
    assert y.dtype == np.float16 and np.array_equal(y, want(x, w))
    assert np.allclose(y.astype(np.float32), (x @ w).astype(np.float32), rtol=2 ** -10, atol=0)  # NumPy's own
    assert np.array_equal(gemm.product(dy, w, trans_b=True), want(dy, w.T))
    dw = np.zeros_like(w)
    assert np.array_equal(gemm.accumulate_xt_dy(dw, x, dy), want(x.T, dy))
    dx = np.zeros_like(x)
    assert np.array_equal(functional.linear_backward(dy, x, w, np.zeros_like(w), None, dx_into=dx), want(dy, w.T))
    q, k = rng.standard_normal((2, 3, 5, 16)).astype(np.float16), rng.standard_normal((2, 3, 16, 7)).astype(np.float16)
    assert np.array_equal(functional.batched_matmul(q, k), want(q, k))
    assert len(seen) == 6 and set(seen) == {(np.dtype(np.float32), np.dtype(np.float32))}, seen


@pytest.mark.parametrize("dtype,device", [("float32", "cpu"), ("float16", "cpu"), ("float16", "gpu")])
def test_adam_divides_the_gradients_by_the_loss_scale_before_its_moments(dtype, device, request):
    """Adam.step(grad_divisor=s) on gradients times s is step() on the gradients themselves, bit for bit (s a power
    of 2). Adam's m / (sqrt(v) + eps) hides a missing division except through eps, so no training curve showed one:
    a large eps, and gradients of every size down to 0, make it show here. float16 takes the master-weights branch
    (float16 gradients, float32 weights), float32 the same-dtype one; on the GPU stand-in the fused kernel."""
    if device == "gpu":
        request.getfixturevalue("standin")
    scale = 2.0 ** 12
    models = [minitf.Transformer(cfg(), dtype=dtype, seed=0, device=device) for _ in range(2)]
    opts = [minitf.Adam(m, lr=1e-2, eps=1e-3) for m in models]
    rng = np.random.default_rng(3)
    for _ in range(3):
        g = (rng.standard_normal(models[0].flat_grads.size) * 10.0 ** rng.integers(-6, 0, models[0].flat_grads.size))
        g[rng.random(g.size) < 0.1] = 0.0
        g = g.astype(models[0].flat_grads.dtype)
        xp = models[0].xp
        models[0].flat_grads[...] = xp.asarray(g * scale)
        models[1].flat_grads[...] = xp.asarray(g)
        opts[0].step(grad_divisor=scale)
        opts[1].step()
    a, b = (to_numpy(m.weights) for m in models)
    assert np.array_equal(a, b)
    fresh = to_numpy(minitf.Transformer(cfg(), dtype=dtype, seed=0, device=device).weights)
    assert np.abs(a - fresh).max() > 1e-3   # the updates moved the weights


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_fused_adam_kernel_updates_as_adams_passes_do(standin, monkeypatch, dtype):
    """Adam.step through the one kernel (kernels.adam_update) against the same steps as separate passes
    (MINITF_FUSED_ADAM=0), on the stand-in, with the coefficients Adam.step works out (bias corrections, weight decay,
    the loss scale): the kernel's own test hands it coefficients of its own, so a wrong one passed from Adam (a bias
    correction dropped) had been caught only by a whole training run."""
    scale = 2.0 ** 10
    models = [minitf.Transformer(cfg(), dtype=dtype, seed=0, device="gpu") for _ in range(2)]
    opts = [minitf.Adam(m, lr=lambda s: 1e-2 / s, eps=1e-6, weight_decay=0.1) for m in models]
    rng = np.random.default_rng(5)
    for _ in range(4):
        g = (rng.standard_normal(models[0].flat_grads.size) * 1e-2).astype(models[0].flat_grads.dtype) * scale
        for model, opt, fused in zip(models, opts, ("1", "0")):
            monkeypatch.setenv("MINITF_FUSED_ADAM", fused)
            assert opt.fused() == (fused == "1")
            model.flat_grads[...] = model.xp.asarray(g)
            opt.step(grad_divisor=scale)
    a, b = (to_numpy(m.weights) for m in models)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(to_numpy(models[0].flat_params).astype(np.float32),      # the 16-bit copy too
                               to_numpy(models[1].flat_params).astype(np.float32), rtol=2e-3, atol=1e-6)
    fresh = to_numpy(minitf.Transformer(cfg(), dtype=dtype, seed=0, device="gpu").weights)
    assert np.abs(a - fresh).max() > 1e-3
