"""The GPU path (CuPy) against the NumPy path. On a machine with CuPy and a CUDA GPU the tests
run on it; everywhere else on tests/strict_cupy.py, a stand-in for CuPy on NumPy that refuses
what CuPy refuses (implicit host<->device conversions, NumPy-only functions and keywords, wrongly
typed kernel arguments) and runs the fused CUDA kernels in tests/cuda_emulator.py. Under the
stand-in the kernel tests use small sizes (the emulator runs each CUDA thread in turn)."""
import numpy as np
import pytest

import minitf
from minitf import backend, gemm, kernels
from minitf.backend import dtype_named, gpu_available, to_numpy

from conftest import record_launches
from cuda_emulator import compiler

REAL_GPU = gpu_available()[0]
needs_kernels = pytest.mark.skipif(not REAL_GPU and compiler() is None,
                                   reason="no GPU, and no g++ >= 12 to emulate the CUDA kernels on the CPU")


@pytest.fixture(autouse=True)
def cp(monkeypatch):
    """The CuPy module the tests run on: the real one on a GPU machine, else the strict stand-in."""
    if not REAL_GPU:
        import strict_cupy
        monkeypatch.setattr(backend, "cupy", strict_cupy)
        monkeypatch.setattr(kernels, "_MODULES", {})
        monkeypatch.setattr(kernels, "COMPILE_ERRORS", {})
    return backend.cupy


def cfg(**kw):
    base = dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2, dropout=0.0, max_len=64)
    base.update(kw)
    return minitf.Config(**base)


SRC = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 5, 6, 7, 3]])
TGT_IN = np.array([[2, 4, 6, 8, 0], [2, 7, 5, 11, 12]])
TGT_OUT = np.array([[4, 6, 8, 3, 0], [7, 5, 11, 12, 3]])


def assert_same_gradients(cpu, gpu):
    """backward on both; every gradient equal to 1e-9 relative."""
    cpu.backward()
    gpu.backward()
    for name, g in cpu.grad_dict().items():
        gg = to_numpy(gpu.grad_dict()[name])
        err = np.linalg.norm(gg - g) / max(np.linalg.norm(g), 1e-30)
        assert err <= 1e-9 or np.linalg.norm(g) < 1e-12, (name, err)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_gpu_loss_logits_and_every_gradient_match_cpu_float64(positional):
    c = cfg(positional=positional)
    cpu = minitf.Transformer(c, device="cpu", dtype="float64", seed=0)
    gpu = minitf.Transformer(c, device="gpu", dtype="float64", seed=0)
    np.testing.assert_allclose(to_numpy(gpu.forward(SRC, TGT_IN)), cpu.forward(SRC, TGT_IN), rtol=1e-10, atol=1e-12)
    lc = cpu.forward_loss(SRC, TGT_IN, TGT_OUT)
    lg = float(gpu.forward_loss(SRC, TGT_IN, TGT_OUT))
    assert abs(lc - lg) <= 1e-10 * abs(lc)
    assert_same_gradients(cpu, gpu)


@needs_kernels
def test_gpu_gradients_with_residual_dropout_keyed_masks_match_stored_masks(monkeypatch):
    """Residual dropout on, float64: the fused post-norm blocks keep each mask as its key
    (kernels.KeyedMask) and the LayerNorm's backward draws it again; the loss and every gradient
    equal those of the passes apart (MINITF_FUSED_NORM=0: dropout_add stores the same mask)."""
    c = cfg(dropout=0.3)
    runs = []
    for norm in ("1", "0"):
        monkeypatch.setenv("MINITF_FUSED_NORM", norm)
        gpu = minitf.Transformer(c, device="gpu", dtype="float64", seed=0)
        loss = float(gpu.forward_loss(SRC, TGT_IN, TGT_OUT))
        held = [layer.drop1.cache for layer in gpu.encoder.layer_list]
        assert all((type(m) is kernels.KeyedMask) == (norm == "1") for m in held)
        gpu.backward()
        runs.append((loss, {k: to_numpy(v) for k, v in gpu.grad_dict().items()}))
    (loss, grads), (want_loss, want) = runs
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss)
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-9, atol=1e-12, err_msg=name)


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
    # to 1e-9 of the largest parameter, not per element: the attention keys' bias has a zero gradient
    # in exact arithmetic (softmax's shift invariance), so it gets rounding noise, whose value depends
    # on the summation order (the fused kernels', cuBLAS's), and Adam scales that noise up to ~1e-10
    want = models[0].flat_params
    np.testing.assert_allclose(to_numpy(models[1].flat_params), want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


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


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_gpu_bfloat16_trains_and_decodes_in_bfloat16(fused, positional, monkeypatch):
    """A bfloat16 model on the GPU path, with the fused kernels and without them (MINITF_FUSED=0, where a failed
    compile falls back to), with sinusoidal or learned positions: its logits stay bfloat16, its loss and gradients
    are near a float64 CPU model's with the same (bfloat16) weights, and greedy and beam search run. (CuPy 14
    computes a bfloat16 array times a Python float in float32 and returns float32 with ml_dtypes before 0.7, and refuses bfloat16 matmuls of
    more than two axes: the stand-in does the same.)"""
    if fused == "1" and not REAL_GPU and compiler() is None:
        pytest.skip("no GPU, and no g++ >= 12 to emulate the CUDA kernels on the CPU")
    from minitf.decode import beam_search, greedy_search
    monkeypatch.setenv("MINITF_FUSED", fused)
    c = cfg(positional=positional)
    gpu = minitf.Transformer(c, device="gpu", dtype="bfloat16", seed=0)
    cpu = minitf.Transformer(c, device="cpu", dtype="float64", seed=0)
    for (_, lc, kc), (_, lg, kg) in zip(cpu.named_parameters(), gpu.named_parameters()):
        lc.params[kc][...] = to_numpy(lg.params[kg]).astype(np.float64)   # the rounded weights (their rounding
        # alone moves this tiny model's gradients by 8-12%)
    assert gpu.forward(SRC, TGT_IN).dtype == dtype_named("bfloat16")
    lc = cpu.forward_loss(SRC, TGT_IN, TGT_OUT)
    lg = float(gpu.forward_loss(SRC, TGT_IN, TGT_OUT))
    assert abs(lc - lg) <= 1e-2 * abs(lc), (lc, lg)
    cpu.backward()
    gpu.backward()
    g64 = np.concatenate([g.ravel() for g in cpu.grad_dict().values()])
    g16 = np.concatenate([to_numpy(g).astype(np.float64).ravel() for g in gpu.grad_dict().values()])
    assert np.linalg.norm(g16 - g64) <= 3e-2 * np.linalg.norm(g64)
    for out in (greedy_search(gpu, SRC, max_len_b=6), beam_search(gpu, SRC, beam_size=3, max_len_b=6)):
        assert len(out) == len(SRC) and all(0 <= t < c.vocab_size for seq in out for t in seq), out


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


@pytest.mark.parametrize("attention", ["general", "additive"])
def test_gpu_rnn_loss_every_gradient_and_decoding_match_cpu(attention):
    """The recurrent baseline (--arch rnn) on CuPy: the same loss, gradients and beam search."""
    from minitf.decode import beam_search
    from minitf.architectures import build_model
    c = cfg(arch="rnn", rnn_hidden=12, attention=attention)
    cpu = build_model(c, device="cpu", dtype="float64", seed=0)
    gpu = build_model(c, device="gpu", dtype="float64", seed=0)
    lc = cpu.forward_loss(SRC, TGT_IN, TGT_OUT)
    lg = float(gpu.forward_loss(SRC, TGT_IN, TGT_OUT))
    assert abs(lc - lg) <= 1e-10 * abs(lc)
    assert_same_gradients(cpu, gpu)
    assert beam_search(gpu, SRC, beam_size=3, max_len_b=5, batch_size=1) == beam_search(cpu, SRC, beam_size=3,
                                                                                        max_len_b=5, batch_size=1)


# ----------------------------------------------------------------------------- fused kernels (kernels.py)
# The tests above already run the fused kernels (the GPU default) against NumPy in float64.
# Here: the kernels at real sizes (full blocks, vocabulary rows longer than a block) against
# CuPy's generic path (MINITF_FUSED=0); forward_backward against forward_loss then backward on the
# fused path (MINITF_FUSED_LOSS=0 too), in float64, float32 and float16; the whole step against the
# generic path in float32, float16 and bfloat16; mixed-precision training against float32's; and
# the kernels compiled and used in each dtype.
def _both_paths(monkeypatch, fn):
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MINITF_FUSED", flag)
        out[flag] = fn()
    return out["1"], out["0"]


def _rel(a, b):
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# real sizes on a GPU; under the emulator rows still longer than what takes them (the softmax's warp of 32
# threads, which rows up to 256 long take; a LayerNorm block of 256; the loss's 512 threads, a 16-byte
# vector each: 4104 values are 513 vectors in 16 bits, 1026 in float32) but few of them
SIZES = dict(batch=4, heads=8, tq=60, tk=70, d_k=64, ln_rows=3000, ln_d=(512, 1024), rows=500, vocab=37000) \
    if REAL_GPU else dict(batch=2, heads=2, tq=9, tk=150, d_k=8, ln_rows=20, ln_d=(300,), rows=30, vocab=4104)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_gpu_kernels_match_generic_at_real_sizes(dtype, tol, monkeypatch, cp):
    from minitf import functional as F
    dtype = dtype_named(dtype)
    from minitf.loss import label_smoothed_nll, label_smoothed_nll_backward
    z = SIZES
    rs = cp.random.default_rng(0)
    # attention: causal + padding, more keys than queries
    b, h, t, s, k = z["batch"], z["heads"], z["tq"], z["tk"], z["d_k"]
    q, key, v = (rs.standard_normal((b, h, t if i == 0 else s, k), dtype=cp.float32).astype(dtype) for i in range(3))
    bias = cp.zeros((b, 1, t, s), dtype=dtype)
    bias[1, ..., s - 20:] = -3e4
    bias += cp.triu(cp.full((t, s), -3e4, dtype=dtype), k=11)
    dout = rs.standard_normal((b, h, t, k), dtype=cp.float32).astype(dtype)

    def attention():
        out, p = F.attention_forward(q, key, v, bias, 0.125)
        return (out, p) + F.attention_backward(dout, q, key, v, p, 0.125)
    for a, b_ in zip(*_both_paths(monkeypatch, attention)):
        assert _rel(a, b_) <= tol
    # LayerNorm over rows of d_model
    for d in z["ln_d"]:
        x = (rs.standard_normal((z["ln_rows"], d), dtype=cp.float32) * 3 + 1).astype(dtype)
        g, b0 = rs.standard_normal(d), rs.standard_normal(d)
        dy = rs.standard_normal((z["ln_rows"], d), dtype=cp.float32).astype(dtype)

        def layernorm():
            y, cache = F.layernorm_forward(x, g.astype(dtype), b0.astype(dtype), 1e-6)
            dg, db = cp.zeros(d, dtype=dtype), cp.zeros(d, dtype=dtype)
            return y, F.layernorm_backward(dy, cache, g.astype(dtype), dg, db), dg, db
        for a, b_ in zip(*_both_paths(monkeypatch, layernorm)):
            assert _rel(a, b_) <= tol
        # a linear layer's backward: its bias gradient is the column sum of dy
        w = rs.standard_normal((d, d), dtype=cp.float32).astype(dtype)

        def linear():
            dw, db = cp.zeros((d, d), dtype=dtype), cp.zeros(d, dtype=dtype)
            return F.linear_backward(dy, x, w, dw, db), dw, db
        for a, b_ in zip(*_both_paths(monkeypatch, linear)):
            assert _rel(a, b_) <= tol
    # the loss over a vocabulary with pad rows
    logits = (rs.standard_normal((z["rows"], z["vocab"]), dtype=cp.float32) * 3).astype(dtype)
    gold = rs.integers(4, z["vocab"], z["rows"])
    gold[::7] = 0

    def loss():
        val, nll, n, cache = label_smoothed_nll(logits.copy(), gold, 0.1, 0)
        return val, nll, n, label_smoothed_nll_backward(cache, 3.0)
    for a, b_ in zip(*_both_paths(monkeypatch, loss)):
        assert _rel(a, b_) <= tol
    # training's loss: every row has one and the forward is given the backward's weight (on the fused
    # path one launch, smoothed_nll_rows_grad_vec, over rows of V_o whole 16-byte vectors; in float32 at
    # the real size longer than the 10 vectors a thread keeps)
    gold = rs.integers(4, z["vocab"], z["rows"])
    scale = cp.asarray([8.0], dtype=np.float32)

    def loss_in_one():
        val, nll, n, cache = label_smoothed_nll(logits.copy(), gold, 0.1, None, grad=(3.0, scale))
        return val, nll, label_smoothed_nll_backward(cache, 3.0, scale)
    for a, b_ in zip(*_both_paths(monkeypatch, loss_in_one)):
        assert _rel(a, b_) <= tol


# attention on packed rows at real sizes on a GPU (heads of 64 values, sentences over a block's 16 rows and a
# tile's 32 keys), smaller under the emulator
ROWS_SIZES = dict(heads=8, d_k=64, lq=[1, 17, 33, 60, 70, 45], lk=[50, 3, 70, 33, 16, 64]) if REAL_GPU else \
    dict(heads=2, d_k=16, lq=[1, 9, 20], lk=[12, 3, 40])


@needs_kernels
@pytest.mark.parametrize("dtype,tol,cores", [("float32", 1e-5, "cuda"), ("float32", 4e-3, "tensor"),
                                             ("float16", 4e-3, "tensor"),
                                             ("float16", 4e-3, "cuda"), ("bfloat16", 3e-2, "tensor"),
                                             ("bfloat16", 3e-2, "cuda")])
@pytest.mark.parametrize("case", ["self", "causal", "cross"])
def test_gpu_attention_rows_match_float64_attention_at_real_sizes(dtype, tol, cores, case, cp, monkeypatch):
    """kernels.attention_rows and attention_rows_backward on the device against float64 NumPy per sentence
    and head: the output and the gradients of q, k and v, within `tol` of the largest value; in 16 bits and in
    float32 with TF32 products (CUPY_TF32=1) on tensor cores (attention_rows_*_mma, mma.sync) and on CUDA cores
    (MINITF_FUSED_ATTN_MMA=0)."""
    from minitf.packing import Spans
    from test_kernels import attention_cores, attention_reference
    attention_cores(monkeypatch, dtype_named(dtype), cores)
    launched = record_launches(monkeypatch)
    h, k = ROWS_SIZES["heads"], ROWS_SIZES["d_k"]
    lq = np.array(ROWS_SIZES["lq"])
    lk = lq if case != "cross" else np.array(ROWS_SIZES["lk"])
    dt = dtype_named(dtype)
    rng = np.random.default_rng(6)
    host = [rng.standard_normal((int(n.sum()), h * k)).astype(dt) for n in (lq, lk, lk, lq)]
    biases = [rng.standard_normal(h * k).astype(dt) * 0.5 for _ in range(3)]
    spans = [Spans(cp.asarray(np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int32)),
                   cp.asarray(n.astype(np.int32)), len(n), int(n.max())) for n in (lq, lk)]
    q, kk, v, dout = (cp.asarray(a) for a in host)
    bs = tuple(cp.asarray(b) for b in biases)
    scale = 1 / np.sqrt(k)
    out, lse = kernels.attention_rows(q, kk, v, bs, spans[0], spans[1], h, case == "causal", scale)
    grads = [cp.empty_like(a) for a in (q, kk, v)]
    kernels.attention_rows_backward(dout, out, lse, q, kk, v, bs, spans[0], spans[1], h, case == "causal", scale,
                                    *grads)
    want_out, _, want = attention_reference(*host[:3], biases, lq, lk, h, case == "causal", scale, host[3])
    want = [want_out] + want
    for got, ref in zip([out] + grads, want):
        got = to_numpy(got).astype(np.float64)
        assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    mma = "_mma" if kernels.attention_tensor_cores(q, k) else ""     # 16 bits or TF32, not switched off, sm_80+
    assert launched == ["attention_rows_forward" + mma, "attention_rows_backward" + mma]
    assert mma == ("" if cores == "cuda" or REAL_GPU and kernels._arch(q) < 80 else "_mma")


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-6), ("float16", 1e-3)])
def test_gpu_forward_backward_gives_forward_loss_then_backward_in_fewer_launches(dtype, tol, monkeypatch):
    """Seq2Seq.forward_backward (training's update) on the device: the loss and every gradient of
    forward_loss then backward, with dropout and (float16) the loss scale kept on the device; the
    loss's gradient is written by its forward kernel (smoothed_nll_rows_grad_vec), so no
    smoothed_nll_backward runs, but with MINITF_FUSED_LOSS=0. Bit for bit under the stand-in; on a
    GPU to `tol` (cuBLAS may take another algorithm from one call to the next)."""
    monkeypatch.setenv("MINITF_FUSED_VEC", "1")
    model = minitf.Transformer(cfg(vocab_size=32, dropout=0.1), device="gpu", dtype=dtype, seed=0)
    scale = model.xp.asarray([1024.0], dtype=np.float32) if dtype == "float16" else None
    launched = record_launches(monkeypatch)

    def update(how):
        model.zero_grad()
        model.forward_count = 0
        launched.clear()
        if how == "apart":
            loss = model.forward_loss(SRC, TGT_IN, TGT_OUT)
            model.backward(loss_weight=0.5, loss_scale=scale)
        else:
            loss = model.forward_backward(SRC, TGT_IN, TGT_OUT, loss_weight=0.5, loss_scale=scale)
        return float(loss), to_numpy(model.flat_grads).astype(np.float64), [n for n in launched if "nll" in n]
    (want_loss, want, apart), (loss, grads, together) = update("apart"), update("together")
    assert apart == ["smoothed_nll_rows_vec", "smoothed_nll_backward_vec"]
    assert together == ["smoothed_nll_rows_grad_vec"]
    monkeypatch.setenv("MINITF_FUSED_LOSS", "0")      # the switch: the backward computes it, as apart
    _, switched, launches = update("together")
    assert launches == apart and np.abs(want).max() > 0
    for got in (grads, switched):
        if REAL_GPU:
            assert _rel(got, want) <= tol and abs(loss - want_loss) <= tol * abs(want_loss)
        else:
            np.testing.assert_array_equal(got, want)
            assert loss == want_loss


@needs_kernels
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_gpu_relu_backward_inside_the_bias_sums_gives_the_same_update(dtype, monkeypatch):
    """MINITF_FUSED_RELUSUMS=1: each feed-forward's ReLU backward done inside its first bias's column sums
    (kernels.relu_backward_sums, one launch where relu_backward and column_sums_into were two): the loss and
    every gradient of an update with ReLU dropout as without it, bit for bit under the stand-in (the same
    kernels' arithmetic), to rounding on a GPU (cuBLAS may take another algorithm from one call to the next)."""
    launched = record_launches(monkeypatch)

    def update(flag):
        monkeypatch.setenv("MINITF_FUSED_RELUSUMS", flag)
        launched.clear()
        return gpu_update(cfg(dropout=0.1, relu_dropout=0.1), dtype, loss_weight=0.5) + (list(launched),)
    (l0, g0, k0), (l1, g1, k1) = update("0"), update("1")
    relu = [n for n in k0 if n.startswith("relu_backward")]
    assert len(relu) == 4 and not any(n.startswith("relu_backward") for n in k1)      # 2 encoder + 2 decoder layers
    assert len(k1) == len(k0) - 4 and k1.count("column_sums_relu_into") == 4
    assert k1.count("column_sums_into") == k0.count("column_sums_into") - 4
    if REAL_GPU:
        assert abs(l1 - l0) <= 1e-6 * abs(l0) and _rel(g1, g0) <= {"float64": 1e-12}.get(dtype, 1e-3)
    else:
        assert l1 == l0
        np.testing.assert_array_equal(g1, g0)


def gpu_update(c, dtype, loss_weight=1.0):
    """Config c's model (seed 0) on the GPU path in `dtype`, one update's forward and backward on SRC, TGT_IN,
    TGT_OUT as training makes it (Seq2Seq.forward_backward): (the loss, the flat gradients in float64)."""
    m = minitf.Transformer(c, device="gpu", dtype=dtype, seed=0)
    m.zero_grad()
    loss = m.forward_backward(SRC, TGT_IN, TGT_OUT, loss_weight=loss_weight)
    return float(loss), to_numpy(m.flat_grads).astype(np.float64)


def cpu_and_gpu_agree(c, src, tgt_in, tgt_out, monkeypatch):
    """Config c's float64 models on the CPU and on the GPU path (seed 0): the loss to 1e-10 and every gradient
    (assert_same_gradients); returns the names of the kernels the GPU path launched."""
    cpu = minitf.Transformer(c, device="cpu", dtype="float64", seed=0)
    gpu = minitf.Transformer(c, device="gpu", dtype="float64", seed=0)
    launched = record_launches(monkeypatch)
    lc = cpu.forward_loss(src, tgt_in, tgt_out)
    lg = float(gpu.forward_loss(src, tgt_in, tgt_out))
    assert abs(lc - lg) <= 1e-10 * abs(lc)
    assert_same_gradients(cpu, gpu)
    return launched


# the switches that are off by default (not faster on the GPUs that timed them, or not yet timed), all on at once
OPT_IN = {"MINITF_FUSED_ATTN": "1", "MINITF_FUSED_RELUSUMS": "1", "MINITF_SPLITK": "1"}


@needs_kernels
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_split_k_weight_gradients_add_what_one_gemm_adds(dtype, cp, monkeypatch):
    """gemm.accumulate_at_b with MINITF_SPLITK=1: a Linear's dW += x^T dy over 1,030 rows as 8 runs of 128 in one
    strided-batched GEMM and one add_partials launch, which adds the runs and the 6 rows left over; stacked q|k|v
    planes (x shared, the planes `stride` apart in one buffer, a bias between them) a GEMM a plane and one
    add_partials, the values between the planes untouched; without the switch one GEMM each."""
    rng = np.random.default_rng(3)
    n, d_in, d_out, planes = 1030, 24, 40, 3
    x, dy = rng.normal(size=(n, d_in)), rng.normal(size=(planes, n, d_out))
    stride = d_in * d_out + d_out                  # a weight, then its bias, as the flat parameter buffer holds them
    flat = rng.normal(size=planes * stride)
    tol = 1e-12 if dtype == "float64" else 2e-5
    x_d, dy_d, flat_d = (cp.asarray(a.astype(dtype)) for a in (x, dy, flat))
    want = flat.astype(dtype).astype(np.float64).copy()
    for p in range(planes):
        want[p * stride:p * stride + d_in * d_out] += (x.astype(dtype).astype(np.float64).T
                                                        @ dy[p].astype(dtype).astype(np.float64)).ravel()
    monkeypatch.setattr(gemm, "SPLIT_ROWS", 100)
    launched = record_launches(monkeypatch)
    for split in ("1", "0"):
        monkeypatch.setenv("MINITF_SPLITK", split)
        assert gemm.split_parts(n, d_in, d_out, np.dtype(dtype)) == (8 if split == "1" else 1)
        launched.clear()
        before = cp.launches() if hasattr(cp, "launches") else None
        dw = flat_d[:d_in * d_out].copy().reshape(d_in, d_out)
        got = to_numpy(gemm.accumulate_xt_dy(dw, x_d, dy_d[0])).astype(np.float64)
        assert np.abs(got.ravel() - want[:d_in * d_out]).max() <= tol * np.abs(want).max()
        stacked = flat_d.copy()
        out = gemm.accumulate_at_b(gemm.Mat(x_d, n, d_in, d_in, 0), dy_d,
                                   gemm.Mat(stacked, d_in, d_out, d_out, stride), batch=planes)
        assert out is stacked
        got = to_numpy(stacked).astype(np.float64)
        assert np.abs(got - want).max() <= tol * np.abs(want).max()
        for p in range(planes):                    # the biases between the planes: not touched
            assert np.array_equal(to_numpy(stacked)[p * stride + d_in * d_out:(p + 1) * stride],
                                  to_numpy(flat_d)[p * stride + d_in * d_out:(p + 1) * stride])
        assert launched == (["add_partials", "add_partials"] if split == "1" else [])
        if before is not None:
            gemms = {k: v for k, v in cp.launches_between(before, cp.launches())[0].items() if k.startswith("cublas.")}
            assert gemms == ({"cublas.gemmStridedBatchedEx": 1 + planes} if split == "1" else
                             {"cublas.gemmEx": 1, "cublas.gemmStridedBatchedEx": 1})
    monkeypatch.setenv("MINITF_SPLITK", "1")       # 16-bit products, and outputs of many tiles, stay one GEMM
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm.accumulate_at_b(x_d.T, dy_d[0], flat_d[:d_in * d_out].reshape(d_in, d_out))
    assert gemm.split_parts(n, d_in, d_out, np.dtype("float16")) == 1
    assert gemm.split_parts(n, 37000, 512, np.dtype("float32")) == 1
    assert gemm.split_parts(150, d_in, d_out, np.dtype("float32")) == 1


@needs_kernels
def test_split_k_reads_and_writes_matrices_where_they_lie(cp, monkeypatch):
    """accumulate_at_b's split-K on matrices inside larger buffers: a, b and c at offsets, leading dimensions wider
    than their columns, a (the input) with a plane stride of its own, 3 planes; 1,031 rows as 8 runs and 7 left over.
    Every plane of c equals float64's a_p^T b_p added to what it held, and nothing outside c's matrices changes."""
    rng = np.random.default_rng(5)
    n, d_in, d_out, planes = 1031, 12, 20, 3
    lda, ldb, a_stride, b_stride, c_stride = d_in + 3, d_out + 5, n * (d_in + 3) + 7, n * (d_out + 5) + 2, 300
    a_off, b_off, c_off = 4, 9, 11
    abuf = rng.normal(size=a_off + (planes - 1) * a_stride + n * lda)
    bbuf = rng.normal(size=b_off + (planes - 1) * b_stride + n * ldb)
    cbuf = rng.normal(size=c_off + (planes - 1) * c_stride + d_in * d_out + 13)
    want = cbuf.copy()
    for p in range(planes):
        ap = abuf[a_off + p * a_stride:][:n * lda].reshape(n, lda)[:, :d_in]
        bp = bbuf[b_off + p * b_stride:][:n * ldb].reshape(n, ldb)[:, :d_out]
        want[c_off + p * c_stride:][:d_in * d_out] += (ap.T @ bp).ravel()
    monkeypatch.setenv("MINITF_SPLITK", "1")
    monkeypatch.setattr(gemm, "SPLIT_ROWS", 100)
    c_d = cp.asarray(cbuf)
    gemm.accumulate_at_b(gemm.Mat(cp.asarray(abuf), n, d_in, lda, a_stride, a_off),
                         gemm.Mat(cp.asarray(bbuf), n, d_out, ldb, b_stride, b_off),
                         gemm.Mat(c_d, d_in, d_out, d_out, c_stride, c_off), batch=planes)
    assert np.abs(to_numpy(c_d) - want).max() <= 1e-12 * np.abs(want).max()


@needs_kernels
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_gpu_every_opt_in_kernel_at_once_gives_the_cpus_float64_loss_and_every_gradient(norm, monkeypatch):
    """Attention on packed rows, ReLU's backward inside the bias sums and the weight gradients' split-K switched on
    together (OPT_IN), beside the warp-per-row LayerNorms (the default): the CPU's float64 loss and every gradient,
    each of them launched."""
    for k, v in OPT_IN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(gemm, "SPLIT_ROWS", 2)     # split-K over this batch's few rows (runs of 2 or 3, rows left over)
    launched = cpu_and_gpu_agree(cfg(norm_position=norm, d_model=32, n_heads=2, d_ff=32), SRC, TGT_IN, TGT_OUT,
                                 monkeypatch)
    for name in ("attention_rows_forward", "attention_rows_backward", "column_sums_relu_into",
                 "layernorm_backward_warp", "add_partials"):
        assert name in launched, name


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [("float16", 5e-3), ("bfloat16", 3e-2)])
def test_gpu_every_opt_in_kernel_at_once_is_as_close_to_float64_in_16_bits(dtype, tol, monkeypatch):
    """OPT_IN with heads of 16 values (attention on tensor cores where the GPU has them) in the 16-bit dtypes: the
    update's loss and every gradient within `tol` of the float64 model's (the largest difference relative to the
    largest gradient). On this tiny model the default kernels' bfloat16 gradients are further from float64 than
    that: the head layout rounds the scores to bfloat16 before the softmax; the kernels on packed rows keep them
    in float32."""
    def update(env, dt):
        for k in OPT_IN:
            monkeypatch.setenv(k, env.get(k, "0"))
        return gpu_update(cfg(d_model=32, n_heads=2, d_ff=32), dt)
    (lo, go), (l64, g64) = update(OPT_IN, dtype), update({}, "float64")
    assert abs(lo - l64) <= tol * abs(l64) and np.abs(go - g64).max() <= tol * np.abs(g64).max()


@needs_kernels
@pytest.mark.parametrize("batch", ["padded", "pre_norm", "keys_differ", "source_unpadded", "unpadded"])
def test_gpu_attention_on_packed_rows_gives_the_cpus_float64_loss_and_every_gradient(batch, monkeypatch):
    """MINITF_FUSED_ATTN=1: the attention of every layer on packed rows (kernels.attention_rows, one
    launch forward, one backward: 6 each for 2 encoder and 2 decoder layers) gives the CPU's float64 loss
    and every gradient, with post-norm and pre-norm blocks, and where a side has no padding (its packed
    rows are then every position: packing.make_rows' `whole`). Where the target side cannot take it, a
    position kept for its tgt_out but a pad in tgt_in (a key the padding bias hides), the decoder's 4
    attentions run in the head layout as before."""
    src, tgt_in, tgt_out = SRC.copy(), TGT_IN.copy(), TGT_OUT.copy()
    fused = 6
    if batch == "keys_differ":
        tgt_in[0, 3], fused = 0, 2
    if batch in ("source_unpadded", "unpadded"):
        src = SRC[:, 1:].copy()
        src[0, -1] = 5
    if batch == "unpadded":
        tgt_in[0, -1], tgt_out[0, -1] = 9, 3
    monkeypatch.setenv("MINITF_FUSED_ATTN", "1")
    launched = cpu_and_gpu_agree(cfg(norm_position="pre" if batch == "pre_norm" else "post"), src, tgt_in, tgt_out,
                                 monkeypatch)
    names = [n for n in launched if n.startswith("attention_rows")]
    assert names.count("attention_rows_forward") == fused
    assert names.count("attention_rows_backward") == fused
    assert sum(n.startswith("masked_softmax") for n in launched) == 6 - fused


@needs_kernels
@pytest.mark.parametrize("dtype,tol,tf32", [("float32", 1e-5, False), ("float32", 5e-3, True), ("float16", 5e-3, False),
                                            ("bfloat16", 3e-2, False)])
@pytest.mark.parametrize("heads", [4, 1])
def test_gpu_attention_on_packed_rows_matches_the_head_layout(dtype, tol, tf32, heads, monkeypatch):
    """The update with MINITF_FUSED_ATTN=1 against the one without (the heads unpacked, the products and
    the softmax apart), in the storage dtypes: the loss and every gradient to rounding (the fused
    kernel keeps the scores in float32 where the head layout rounds them to the storage dtype). Heads of
    4 values run on CUDA cores; one head of 16 in float16 and bfloat16 on tensor cores (attention_rows_*_mma), and
    in float32 where its products run on TF32 (CUPY_TF32=1). With attention dropout (its mask lives on [B, H, T, S])
    the attention stays as it was."""
    if tf32:     # (gemm keeps each dtype's compute type from its first product: a fresh one, put back after)
        monkeypatch.setenv("CUPY_TF32", "1")
        monkeypatch.setattr(gemm, "_TYPES", {})

    def update(flag, attention_dropout=0.0):
        monkeypatch.setenv("MINITF_FUSED_ATTN", flag)
        m = minitf.Transformer(cfg(attention_dropout=attention_dropout, n_heads=heads), device="gpu", dtype=dtype,
                               seed=0)
        m.zero_grad()
        loss = m.forward_loss(SRC, TGT_IN, TGT_OUT)
        m.backward(loss_weight=64.0 if dtype == "float16" else 1.0)
        return float(loss), to_numpy(m.flat_grads).astype(np.float64)
    launched = record_launches(monkeypatch)
    (lf, gf), (lh, gh) = update("1"), update("0")
    assert abs(lf - lh) <= tol * abs(lh) and _rel(gf, gh) <= tol
    tensor = heads == 1 and (dtype != "float32" or tf32) and kernels._arch(backend.cupy.zeros(1)) >= 80   # sm_80+
    mma = "_mma" if tensor else ""
    assert [n for n in launched if n.startswith("attention_rows")] == 6 * ["attention_rows_forward" + mma] + \
        6 * ["attention_rows_backward" + mma]
    launched.clear()
    (ld, gd), (ldh, gdh) = update("1", 0.1), update("0", 0.1)
    assert not any(n.startswith("attention_rows") for n in launched)
    assert abs(ld - ldh) <= 1e-6 * abs(ldh) and _rel(gd, gdh) <= 1e-6   # the same path twice


@needs_kernels
@pytest.mark.parametrize("attn", ["0", "1"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_the_reference_gives_the_gpu_paths_loss_and_every_gradient(attn, positional, monkeypatch):
    """minitf/reference.py, the whole step written plainly, against the GPU path in float64 (the fused
    kernels, the attention in the head layout or on packed rows: MINITF_FUSED_ATTN=1), on
    tests/test_reference.py's batch (padding on both sides, one source without it): the loss and every
    gradient to 1e-10. Without dropout: the device draws its masks by hashing (functional.hash_bits),
    not from the CPU's generator the reference is given."""
    from test_reference import assert_same_grads, batch, config, reference_step
    monkeypatch.setenv("MINITF_FUSED_ATTN", attn)
    cfg = config(positional)
    model = minitf.Transformer(cfg, device="gpu", dtype="float64", seed=4)
    params = {n: to_numpy(p).copy() for n, p in model.state_dict().items()}
    launched = record_launches(monkeypatch)
    model.zero_grad()
    loss = float(model.forward_loss(*batch()))
    model.backward()
    ref_loss, _, ref_grads = reference_step(cfg, params, 0, model.seed)
    assert abs(ref_loss - loss) <= 1e-10 * abs(loss)
    assert_same_grads(ref_grads, {n: to_numpy(g) for n, g in model.grad_dict().items()})
    assert launched.count("attention_rows_forward") == (6 if attn == "1" else 0)


@needs_kernels
def test_gpu_sides_without_padding_become_packed_rows_only_for_the_attention_on_rows(monkeypatch):
    """With MINITF_FUSED_ATTN=1 a source without padding is taken as packed rows (every position), which the
    attention on packed rows reads; with attention dropout, which keeps the head layout, or with the
    switch off, it stays unpacked ([B, S, D] as it is, no copies)."""
    src = SRC[:, 1:].copy()
    src[0, -1] = 5
    for flag, attention_dropout, packed in (("1", 0.0, True), ("1", 0.1, False), ("0", 0.0, False)):
        monkeypatch.setenv("MINITF_FUSED_ATTN", flag)
        m = minitf.Transformer(cfg(attention_dropout=attention_dropout), device="gpu", dtype="float32", seed=0)
        m.forward_loss(src, TGT_IN, TGT_OUT)
        assert (m._cache["src_rows"] is not None) == packed, (flag, attention_dropout)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 3e-2), ("bfloat16", 6e-2)])
def test_gpu_fused_step_matches_generic_step(dtype, tol, monkeypatch):
    def step():
        m = minitf.Transformer(cfg(), device="gpu", dtype=dtype, seed=0)
        m.zero_grad()
        loss = m.forward_loss(SRC, TGT_IN, TGT_OUT)
        m.backward(loss_weight=64.0 if dtype == "float16" else 1.0)
        return loss, m.flat_grads.astype(np.float32)
    (lf, gf), (lg, gg) = _both_paths(monkeypatch, step)
    assert abs(float(lf) - float(lg)) <= tol * abs(float(lg))
    assert _rel(gf, gg) <= tol


def test_gpu_fused_dropout_masks_and_mixed_precision_training():
    """Mixed precision on the GPU (fused kernels, dropout on): the loss falls like float32's, in
    float16 (loss-scaled) and in bfloat16 (no scaling)."""
    from minitf.optim import LossScaler
    finals = {}
    for dtype in ("float32", "float16", "bfloat16"):
        m = minitf.Transformer(cfg(dropout=0.1), device="gpu", dtype=dtype, seed=0)
        opt, scaler = minitf.Adam(m, lr=3e-3), LossScaler(init_scale=2.0 ** 12) if dtype == "float16" else None
        losses = []
        for _ in range(80):
            m.zero_grad()
            losses.append(float(m.forward_loss(SRC, TGT_IN, TGT_OUT)))
            scale = scaler.scale if scaler else 1.0
            m.backward(loss_weight=scale)
            if scaler is None or scaler.update(bool(m.xp.isfinite(m.flat_grads).all())):
                opt.step(grad_divisor=scale)
        assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), dtype
        finals[dtype] = np.mean(losses[-10:])
    for half in ("float16", "bfloat16"):
        assert abs(finals[half] - finals["float32"]) < 0.25 * finals["float32"], half


@needs_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_fused_kernels_compile_and_are_used(dtype, monkeypatch, cp):
    """The fused path is really taken on this GPU (a compile failure would fall back to
    the generic path with a warning, and the comparisons above would compare it with itself)."""
    monkeypatch.delenv("MINITF_FUSED", raising=False)
    assert kernels.enabled(cp.zeros(3, dtype=dtype_named(dtype))), kernels.COMPILE_ERRORS.get(dtype)
