"""The GPU path (`--device gpu`) end to end on tests/strict_cupy.py, the CuPy stand-in on NumPy,
on every machine (a real GPU cannot count transfers): device-to-host copies per training update
and per decoding step, no float64 array on the float32 and float16 paths, and train_wmt.py and
`python -m minitf translate` as commands (training, --fp16, exact resume, averaging, scoring,
beam and greedy decoding of both architectures, two ranks over the stand-in's NCCL).
The subprocesses select the stand-in with MINITF_CUPY_MODULE=strict_cupy."""
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minitf
import strict_cupy
from minitf import backend
from minitf.checkpoint import load_checkpoint, save_checkpoint
from minitf.data.tokenizer import Tokenizer

from cuda_emulator import compiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EN = "a the man woman dog cat sees eats red big small house runs".split()
DE = "ein der mann frau hund katze sieht isst rot gross klein haus rennt".split()

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ >= 12 to emulate the CUDA kernels on the CPU")


def tiny(arch="transformer", dtype="float32", **kw):
    from minitf.architectures import build_model
    base = dict(vocab_size=23, d_model=16, n_heads=4, d_ff=24, n_layers=2, dropout=0.1, max_len=64, arch=arch,
                rnn_hidden=12)
    base.update(kw)
    return build_model(minitf.Config(**base), device="gpu", dtype=dtype, seed=0)


# ----------------------------------------------------------------------------- dropout
def held_mask(drop, d=16):
    """A Dropout layer's mask from the last forward, on the host: the array it holds, or the one its
    KeyedMask stands for (a post-norm block's fused LayerNorm keeps the key, not the [N, D] mask)."""
    m = drop.cache
    if type(m) is minitf.kernels.KeyedMask:
        m = minitf.functional.mask_array(m, backend.cupy.empty((m.rowpos.size, d), dtype=np.float32))
    return backend.to_numpy(m)


class NoRandom:
    """cupy.random for a test that must draw nothing from it."""
    def __getattr__(self, name):
        raise AssertionError(f"cupy.random.{name} used: a generator set up on the device")


@pytest.mark.parametrize("fused", ["1", "0"])
def test_training_with_dropout_sets_up_no_generator_and_both_paths_drop_the_same(standin, monkeypatch, fused):
    """CuPy's default_rng is an XORWOW generator whose set-up initialises ~270k cuRAND states: it
    must not run per forward (nor any other device generator). A mask is a hash of (seed,
    forward, site, position): the fused kernel and the generic xp path give the same masks."""
    monkeypatch.setattr(strict_cupy, "random", NoRandom())
    monkeypatch.setenv("MINITF_FUSED", fused)
    model = tiny(dropout=0.3)
    for _ in range(3):
        model.zero_grad()
        model.forward_loss(SRC[:, 1:], SRC[:, :-1], SRC[:, 1:])
        masks = [held_mask(layer.drop1) for layer in model.encoder.layer_list]
        model.backward()
    assert model.forward_count == 3
    assert all(0.5 < (m != 0).mean() < 0.9 for m in masks)
    if fused == "1":
        monkeypatch.setenv("MINITF_FUSED", "0")
        generic = tiny(dropout=0.3)
        generic.forward_count = 2
        generic.zero_grad()
        generic.forward_loss(SRC[:, 1:], SRC[:, :-1], SRC[:, 1:])
        for layer, m in zip(generic.encoder.layer_list, masks):
            np.testing.assert_array_equal(held_mask(layer.drop1), m)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_attention_and_relu_dropout_on_the_device_draw_hashed_masks(standin, monkeypatch, fused):
    """Attention dropout ([B, H, T, S] weights) and ReLU dropout (the packed [N, F] hidden rows)
    take the hashed masks on the device too: no generator, about the rate dropped, and the same
    loss and gradients with and without the fused kernels."""
    monkeypatch.setattr(strict_cupy, "random", NoRandom())
    monkeypatch.setenv("MINITF_FUSED", fused)
    model = tiny(dtype="float64", attention_dropout=0.3, relu_dropout=0.3)
    model.forward_count = 4
    model.zero_grad()
    loss = float(model.forward_loss(SRC[:, 1:], SRC[:, :-1], SRC[:, 1:]))
    layer = model.decoder.layer_list[0]
    masks = [backend.to_numpy(layer.self_attn.cache.drop_mask), backend.to_numpy(layer.ffn.drop.cache)]
    model.backward()
    assert all(0.15 < (m == 0).mean() < 0.45 for m in masks)
    grads = backend.to_numpy(model.flat_grads)
    assert np.isfinite(grads).all()
    if fused == "1":
        monkeypatch.setenv("MINITF_FUSED", "0")
        generic = tiny(dtype="float64", attention_dropout=0.3, relu_dropout=0.3)
        generic.forward_count = 4
        generic.zero_grad()
        assert float(generic.forward_loss(SRC[:, 1:], SRC[:, :-1], SRC[:, 1:])) == pytest.approx(loss, rel=1e-12)
        generic.backward()
        np.testing.assert_allclose(backend.to_numpy(generic.flat_grads), grads, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("attention_dropout", [0.0, 0.3])
def test_the_head_layouts_attention_weights_lie_a_pitch_apart(standin, monkeypatch, dtype, attention_dropout):
    """The head layout's attention weights (6 keys and queries here: whole 16-byte vectors in no dtype) lie in rows
    kernels.row_pitch apart: the cache's p is the [B, H, T, S] view of its weights [B, H, T, P], P > S, and each of an
    attention's six products reads or writes them with P as leading dimension and T P as batch stride, with attention
    dropout too (p * mask pitched as well); the loss and every gradient the same bits as with rows S apart
    (MINITF_ATTN_PITCH=0, where the products are given S and T S)."""
    from minitf import gemm
    matmul, calls = gemm.matmul, []

    def recording(a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, batch=1):
        calls.append((a, b, c, batch))
        return matmul(a, b, c, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, batch=batch)
    monkeypatch.setattr(gemm, "matmul", recording)

    def run(pitch):
        monkeypatch.setenv("MINITF_ATTN_PITCH", pitch)
        calls.clear()
        model = tiny(dtype=dtype, attention_dropout=attention_dropout)
        model.forward_count = 1
        model.zero_grad()
        loss = float(model.forward_loss(SRC[:, 1:], SRC[:, :-1], SRC[:, 1:]))
        cache = model.decoder.layer_list[0].self_attn.cache
        model.backward()
        # the products over the weights: those of B*H matrices, one operand T x S (or S x T) with the weights' memory
        geometry = [(m.rows, m.cols, m.ld, m.stride) for a, b, c, batch in calls if batch == b_h
                    for m in (a, b, c) if type(m) is gemm.Mat and m.array.shape[:3] == (b_h // 4, 4, t)]
        return loss, backend.to_numpy(model.flat_grads), cache, geometry

    b_h, t, s = SRC.shape[0] * 4, SRC.shape[1] - 1, SRC.shape[1] - 1
    pitch = minitf.kernels.row_pitch(s, np.dtype(dtype))
    assert pitch > s
    loss, grads, cache, geometry = run("1")
    assert cache.weights.shape == (SRC.shape[0], 4, t, pitch) and cache.p.shape == (SRC.shape[0], 4, t, s)
    # 3 attentions a layer pair (encoder, decoder self, cross) x 2 layers x 6 products
    assert len(geometry) == 36 and set(geometry) == {(t, s, pitch, t * pitch)}, set(geometry)
    tight_loss, tight_grads, _, tight = run("0")
    assert tight == [(t, s, s, t * s)] * 36 and tight_loss == loss and tight_grads.tobytes() == grads.tobytes()


# ----------------------------------------------------------------------------- decoding
SRC = np.array([[5, 6, 7, 8, 3, 0, 0], [9, 10, 5, 6, 7, 8, 3], [4, 3, 0, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 3],
                [12, 13, 3, 0, 0, 0, 0]])


def mark_steps(model, monkeypatch):
    """A mark at every decoding step (the decoder's `logits`)."""
    decoder = type(model.incremental_decoder(backend.to_device(SRC[:1], model.xp), 2, beam=1))
    real = decoder.logits

    def marked(self, tokens):
        strict_cupy.mark("step")
        return real(self, tokens)
    monkeypatch.setattr(decoder, "logits", marked)


def steps_and_copies(model, search):
    """Runs search(model) under count_transfers; returns (the device->host copies of each
    decoding step, all of the search's)."""
    with strict_cupy.count_transfers() as t:
        search(model)
        strict_cupy.mark("end")
    return t.segments("step", "end"), t.d2h


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_a_decoding_step_reads_back_one_array(standin, monkeypatch, arch):
    """Beam search needs each step's best candidates on the host (its bookkeeping runs there):
    values, beams and tokens of the 2k best, the EOS scores at the length limit, come back in ONE
    copy per step (backend.to_numpy_all), also at the steps where new sentences join (continuous
    batching: batch_size 2 of 5); greedy search reads back its argmax (with scores, beside the argmax's and the
    EOS's log-probabilities, in the same copy: it had made a second). Nothing else: the source lengths are measured
    on the host, so a search of n steps makes exactly n copies."""
    from minitf.decode import beam_search, greedy_search
    model = tiny(arch)
    mark_steps(model, monkeypatch)
    for search in (lambda m: beam_search(m, SRC, beam_size=3, max_len_b=4, batch_size=2),
                   lambda m: greedy_search(m, SRC, max_len_b=4, batch_size=2),
                   lambda m: greedy_search(m, SRC, max_len_b=4, batch_size=2, scores=True)):
        steps, every = steps_and_copies(model, search)
        assert len(steps) >= 8                                  # several admissions and the length limit
        assert all(len(s) == 1 for s in steps), [s for s in steps if len(s) != 1]
        assert len(every) == len(steps), every


def device_equals_cpu(**kw):
    """A device model of tiny(**kw) and the CPU model with its weights: the same loss and every
    gradient on a batch with a reference piece 12, and the same beam search; returns (cpu model,
    hypotheses)."""
    from minitf.decode import beam_search
    from minitf.architectures import build_model
    bias_values = kw.pop("bias_values", False)
    gpu = tiny(**kw)
    if bias_values:   # a logit bias that is not zero, so a wrong index into it shows
        gpu.embedding.params["bias"][:] = gpu.xp.asarray(np.random.default_rng(3).standard_normal(
            gpu.cfg.vocab_size), dtype=gpu.embedding.params["bias"].dtype)
    cpu = build_model(gpu.cfg, device="cpu", seed=0)
    cpu.load_state_dict({n: backend.to_numpy(a) for n, a in gpu.state_dict().items()})
    tgt = np.array([[5, 12, 7, 3], [9, 6, 3, 0]])
    src, tgt_in = SRC[:2, :5], np.concatenate([np.full((2, 1), 2), tgt[:, :-1]], axis=1)
    losses = []
    for model in (gpu, cpu):
        model.zero_grad()
        losses.append(float(model.forward_loss(src, tgt_in, tgt)))
        model.backward()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    np.testing.assert_allclose(backend.to_numpy(gpu.flat_grads), cpu.flat_grads, rtol=1e-4, atol=1e-6)
    hyps = [beam_search(m, SRC, beam_size=3, max_len_b=5) for m in (gpu, cpu)]
    assert hyps[0] == hyps[1]
    return cpu, hyps[0]


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_a_second_backward_on_the_device_adds_to_the_gradients(standin, monkeypatch, fused, norm):
    """Backward accumulates (+=) on the device path too: two backwards of one batch give twice one backward's
    gradients, every parameter. The GEMMs that add into a gradient buffer (beta = 1), the bias and LayerNorm column
    sums and the embedding's scatter each write over the buffer if they go wrong, which a single backward after
    zero_grad never shows (a weight GEMM with beta = 0 had been caught only by a 2-rank training run)."""
    monkeypatch.setenv("MINITF_FUSED", fused)
    model = tiny(dropout=0.0, norm_position=norm, d_model=32, d_ff=64)
    tgt = np.array([[5, 12, 7, 3], [9, 6, 3, 0]])
    src, tgt_in = SRC[:2, :5], np.concatenate([np.full((2, 1), 2), tgt[:, :-1]], axis=1)
    model.zero_grad()
    model.forward_loss(src, tgt_in, tgt)
    model.backward()
    once = backend.to_numpy(model.flat_grads).copy()
    model.forward_loss(src, tgt_in, tgt)
    model.backward()
    twice = backend.to_numpy(model.flat_grads)
    for name in model.names:   # each parameter by name, so a failure says which
        a, b = (model.view(g, name) for g in (once, twice))
        assert np.abs(a).max() > 0, name
        np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_an_output_vocabulary_on_the_device_gives_the_cpus_loss_gradients_and_decoding(standin, monkeypatch, fused):
    """--output-vocab target on the device path (the fused loss kernel, or the generic one): the CPU
    model's loss and every gradient, one reference piece (12) outside the output vocabulary; beam
    search emits only its pieces, as on the CPU."""
    monkeypatch.setenv("MINITF_FUSED", fused)
    _, hyps = device_equals_cpu(dropout=0.0, output_vocab="1,3-11,13-17")
    assert all(set(h) <= set(range(1, 18)) - {2, 12} for h in hyps)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_pre_norm_model_on_the_device_gives_the_cpus_loss_gradients_and_decoding(standin, monkeypatch, fused):
    """--norm pre on the device path (fused LayerNorm kernels, or the generic xp ones): the CPU
    model's loss and every gradient (the stacks' final LayerNorms included), and its beam search."""
    monkeypatch.setenv("MINITF_FUSED", fused)
    cpu, _ = device_equals_cpu(dropout=0.0, norm_position="pre")
    assert np.abs(cpu.grad_dict()["decoder.norm.weight"]).max() > 0


@pytest.mark.parametrize("fused", ["1", "0"])
def test_marians_swish_and_logit_bias_on_the_device_give_the_cpus_loss_gradients_and_decoding(standin, monkeypatch,
                                                                                            fused):
    """An imported Marian model's options (docs/interop.md) on the device path: a swish FFN (the
    generic path: the fused bias-and-ReLU kernel does not apply) and a logit bias over an output
    vocabulary: the CPU model's loss, every gradient (the bias's included) and beam search."""
    monkeypatch.setenv("MINITF_FUSED", fused)
    cpu, _ = device_equals_cpu(dropout=0.0, activation="swish", output_bias=True, output_vocab="1,3-11,13-17",
                               bias_values=True)
    assert np.abs(cpu.grad_dict()["embedding.bias"]).max() > 0


def test_attention_on_packed_rows_without_cublas_keeps_the_decoders_mask(standin, monkeypatch):
    # MINITF_FUSED_ATTN=1 with MINITF_CUBLAS=0 (bench/gpu_ab.py's `before` variant under an opt-in switch): the model
    # had left out the causal bias for the packed-rows kernels, which only the cuBLAS route reaches: a NaN loss
    monkeypatch.setenv("MINITF_FUSED_ATTN", "1")
    monkeypatch.setenv("MINITF_CUBLAS", "0")
    device_equals_cpu(dropout=0.0)


@pytest.mark.parametrize("takes_a_float", [False, True], ids=["ml_dtypes<0.7", "ml_dtypes>=0.7"])
def test_a_swish_model_trains_and_decodes_in_bfloat16_on_the_device(standin, monkeypatch, takes_a_float):
    # swish multiplied bfloat16 by Python floats, which CuPy computes in float32 with ml_dtypes before 0.7: the
    # feed-forward's output left bfloat16 and the next kernel refused it (an imported Marian model under --bf16).
    # From ml_dtypes 0.7 on the product stays bfloat16: both rules give the same model here.
    monkeypatch.setattr(standin, "BFLOAT16_TAKES_A_PYTHON_FLOAT", takes_a_float)
    from minitf.architectures import build_model
    from minitf.decode import beam_search
    gpu = tiny(dtype="bfloat16", activation="swish", dropout=0.0)
    cpu = build_model(gpu.cfg, device="cpu", dtype="float32", seed=0)
    cpu.load_state_dict({n: backend.to_numpy(a).astype(np.float32) for n, a in gpu.state_dict().items()})
    tgt = np.array([[5, 12, 7, 3], [9, 6, 3, 0]])
    src, tgt_in = SRC[:2, :5], np.concatenate([np.full((2, 1), 2), tgt[:, :-1]], axis=1)
    losses = []
    for model in (gpu, cpu):
        losses.append(float(model.forward_loss(src, tgt_in, tgt)))
        model.backward()
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)
    assert np.isfinite(backend.to_numpy(gpu.flat_grads).astype(np.float32)).all()
    assert len(beam_search(gpu, SRC, beam_size=2, max_len_b=5)) == len(SRC)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_loss_scale_of_another_dtype_is_refused(standin, device):
    # the GPU kernels read the scale's bits as the accumulation dtype: a float64 scale for a float32 model would have
    # been read as two float32 values there (the stand-in refused the pointer; the CPU took it)
    from minitf.architectures import build_model
    model = build_model(tiny().cfg, device=device)
    tgt = np.array([[5, 12, 7, 3]])
    src, tgt_in = SRC[:1, :5], np.array([[2, 5, 12, 7]])
    with pytest.raises(TypeError, match=r"loss_scale must be a \[1\] float32 array on the model's device"):
        model.forward_backward(src, tgt_in, tgt, loss_scale=model.xp.asarray([8.0], dtype=np.float64))
    model.forward_loss(src, tgt_in, tgt)
    with pytest.raises(TypeError, match="loss_scale must be"):
        model.backward(1.0, model.xp.asarray([8.0, 1.0], dtype=np.float32))
    model.forward_loss(src, tgt_in, tgt)
    model.backward(1.0, model.xp.asarray([8.0], dtype=np.float32))


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Multi30k-shaped folder: word-by-word 'translations' (as tests/test_train.py makes it)."""
    d = tmp_path_factory.mktemp("m30k")
    rng = np.random.default_rng(0)
    for split, n in (("train", 240), ("val", 12), ("test_2016_flickr", 8)):
        idx = [rng.integers(0, len(EN), size=rng.integers(2, 7)) for _ in range(n)]
        for lang, words in (("en", EN), ("de", DE)):
            with gzip.open(d / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(" ".join(words[i] for i in row) + "\n" for row in idx))
    return d


TRAIN = ["--dataset", "multi30k", "--preset", "tiny", "--vocab-size", "60", "--device", "gpu", "--quiet",
         "--max-tokens", "160", "--log-every", "1", "--beam", "2", "--decode-batch", "8"]


COMPUTE = {None: "float32", "fp16": "float16", "bf16": "bfloat16"}   # mixed-precision flag -> activations' dtype


@pytest.mark.parametrize("flags,env,said", [
    ([], None, "float32 products on TF32 tensor cores (--no-tf32 for full float32)"),
    (["--no-tf32"], None, "float32 products in full float32 (--no-tf32)"),
    (["--no-tf32"], "1", "float32 products in full float32 (--no-tf32)"),
    ([], "0", "float32 products in full float32 (the environment's CUPY_TF32)"),
    ([], "", "float32 products on TF32 tensor cores (--no-tf32 for full float32)"),   # an empty value says nothing
    (["--fp16"], None, None),      # 16-bit products: CUPY_TF32 left as it was
])
def test_training_on_a_gpu_runs_float32_products_on_tf32_unless_told(standin, monkeypatch, capsys, flags, env, said):
    """train_wmt.py --device gpu in float32 sets CUPY_TF32 before its first product (the GEMMs' compute type and the
    attention's tensor cores follow it), says so in one line, and leaves it to --no-tf32 or the environment to say
    otherwise; mixed precision leaves it alone."""
    import numpy
    from minitf import distributed, gemm, kernels, train
    from minitf.train_cli import parse_args
    if env is not None:
        monkeypatch.setenv("CUPY_TF32", env)
    assert gemm._types(numpy.dtype("float32"))[1] == (gemm.COMPUTE_32F_FAST_TF32 if env == "1" else gemm.COMPUTE_32F)
    args = parse_args(["--dataset", "multi30k", "--device", "gpu", *flags])
    train._prepare_device(args, distributed.World())
    err = capsys.readouterr().err
    if said is None:
        assert "CUPY_TF32" not in os.environ and "float32 products" not in err
        return
    tf32 = said.startswith("float32 products on TF32")
    assert said in err and os.environ["CUPY_TF32"] == ("1" if tf32 else "0") and kernels.tf32() == tf32
    assert gemm._types(numpy.dtype("float32"))[1] == (gemm.COMPUTE_32F_FAST_TF32 if tf32 else gemm.COMPUTE_32F)


def test_training_on_a_gpu_says_what_tf32_cannot_do(standin, monkeypatch, capsys):
    """A CUPY_TF32 that is not a whole number is one clear error before training starts (CuPy would fail at its first
    float32 product); a GPU older than Ampere has no TF32: the log says it runs full float32, and the products ask
    cuBLAS for full float32 there."""
    from minitf import distributed, train
    from minitf.train_cli import parse_args
    args = parse_args(["--dataset", "multi30k", "--device", "gpu"])
    monkeypatch.setenv("CUPY_TF32", "yes")
    with pytest.raises(minitf.ConfigError, match=r"CUPY_TF32='yes' in the environment: expected a whole number"):
        train._prepare_device(args, distributed.World())
    monkeypatch.setenv("CUPY_TF32", "1")
    monkeypatch.setenv("STRICT_CUPY_COMPUTE_CAPABILITY", "75")
    train._prepare_device(args, distributed.World())
    assert "float32 products in full float32 (TF32 needs an Ampere GPU or newer; this one is sm_75)" in \
        capsys.readouterr().err
    from minitf import gemm    # ... and so they do: cuBLAS is asked for full float32 there, as CuPy asks it
    assert gemm._types(np.dtype("float32"))[1] == gemm.COMPUTE_32F
    gemm._TYPES.clear()
    monkeypatch.setenv("STRICT_CUPY_COMPUTE_CAPABILITY", "80")
    assert gemm._types(np.dtype("float32"))[1] == gemm.COMPUTE_32F_FAST_TF32


@pytest.mark.parametrize("capability,warned", [("75", True), ("80", False), ("90", False)])
def test_bf16_on_a_gpu_without_bfloat16_tensor_cores_says_fp16_is_faster(standin, monkeypatch, capsys, capability,
                                                                         warned):
    """Before Ampere (sm_80) a GPU has no bfloat16 tensor cores: --bf16 runs there, slower, and the log says that
    --fp16 is the faster choice; from sm_80 on it says nothing of the kind."""
    from minitf import distributed, train
    from minitf.train_cli import parse_args
    monkeypatch.setenv("STRICT_CUPY_COMPUTE_CAPABILITY", capability)
    train._prepare_device(parse_args(["--dataset", "multi30k", "--device", "gpu", "--bf16"]), distributed.World())
    err = capsys.readouterr().err
    assert (f"warning: --bf16 on sm_{capability}: this GPU has no bfloat16 tensor cores" in err) == warned, err
    assert ("--fp16 is the faster choice here" in err) == warned


def marked_train_wmt(tmp_path, monkeypatch):
    """train_wmt.py as a module of this process, its training marked for count_transfers: "forward_backward"
    where an update begins, "save" where training has ended (the final save)."""
    import importlib.util
    import minitf.train as train
    for name in ("forward_backward", "save"):
        real = getattr(train, name)
        monkeypatch.setattr(train, name, lambda *a, _real=real, _name=name, **k: (strict_cupy.mark(_name), _real(*a, **k))[1])
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("train_wmt", os.path.join(ROOT, "train_wmt.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


@pytest.mark.parametrize("arch,half", [("transformer", None), ("transformer", "fp16"), ("transformer", "bf16"),
                                       ("rnn", None)])
def test_no_sync_per_update_and_no_float64_array(corpus, tmp_path, standin, monkeypatch, arch, half):
    """train_wmt.py's loop on the stand-in, in this process: no update (forward, backward, the
    float16 overflow check, Adam, the log line of every step) copies anything to the host
    synchronously; each queues ONE asynchronous copy, UpdateCheck's outcome, which the host reads
    an update later (the stand-in fills it with NaN until an event says it has landed, so a read
    too early would show as non-finite losses); and no float64 array is made on the device, in
    training nor in the final averaging and decoding."""
    from minitf.optim import Adam
    cli = marked_train_wmt(tmp_path, monkeypatch)
    steps = []
    monkeypatch.setattr(Adam, "step", lambda self, *a, _real=Adam.step, **k: (steps.append(1), _real(self, *a, **k))[1])
    with strict_cupy.count_transfers() as t, strict_cupy.record_dtypes() as dtypes:
        code = cli.main(["--data-dir", str(corpus), *TRAIN, "--out", str(tmp_path / "run"), "--max-steps", "5",
                         "--save-every", "1000", "--valid-every", "0", "--average-last", "1", "--arch", arch,
                         *([f"--{half}"] if half else [])])
    assert code == 0
    updates = t.segments("forward_backward", "save")
    assert len(updates) >= 5 and len(steps) == len(updates)    # fp16: skipped overflow updates come on top
    assert all(u == [] for u in updates), updates
    assert len(t.d2h_async) == len(updates), t.d2h_async
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r and "event" not in r]
    assert len(losses) == 5 and all(np.isfinite(losses)), log   # every update's outcome read after it landed
    assert not any(r.get("event") == "nonfinite_loss_skipped" for r in log), log
    assert "float64" not in dtypes, dtypes.get("float64")
    assert {COMPUTE[half]} <= set(dtypes)


def test_minitf_host_check_reads_each_outcome_at_once(corpus, tmp_path, standin, monkeypatch):
    """MINITF_HOST_CHECK=1 ends each GPU update on the host, as the CPU does (bench/gpu_ab.py's
    comparison): one synchronous copy per update, train.step_stats', and the same training as the
    update ended on the device (the same final weights, float64, no dropout)."""
    from minitf.checkpoint import load_checkpoint
    cli = marked_train_wmt(tmp_path, monkeypatch)
    runs = {}
    for host in ("1", "0"):
        monkeypatch.setenv("MINITF_HOST_CHECK", host)
        with strict_cupy.count_transfers() as t:
            assert cli.main(["--data-dir", str(corpus), *TRAIN, "--out", str(tmp_path / host), "--max-steps", "4",
                             "--save-every", "4", "--valid-every", "0", "--average-last", "1", "--dtype", "float64",
                             "--dropout", "0"]) == 0
        runs[host] = (t, load_checkpoint(str(tmp_path / host / "checkpoint_0000004.npz")).params)
    updates = runs["1"][0].segments("forward_backward", "save")
    assert len(updates) == 4 and all(len(u) == 1 and "step_stats" in u[0] for u in updates), updates
    assert not runs["1"][0].d2h_async and len(runs["0"][0].d2h_async) == 4
    for name, value in runs["1"][1].items():
        assert np.array_equal(value, runs["0"][1][name]), name


# ----------------------------------------------------------------------------- the commands
def standin_env(tmp_path, **extra):
    """The environment of a command on the stand-in (its kernels compiled once per machine)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                MINITF_CUPY_MODULE="strict_cupy", MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0",
                OMP_NUM_THREADS="1", **extra)


def run_bench(tmp_path, script, *args, **env):
    """bench/<script> with `args` on the stand-in, from the project's root, `env` set too: the finished process (its
    output kept)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *map(str, args)], capture_output=True,
                          text=True, env=standin_env(tmp_path, **env), timeout=600, cwd=ROOT)


def run_train(corpus, tmp_path, out, *extra, launch=(), **env):
    """train_wmt.py on the stand-in into tmp_path/out; asserts it succeeded with the fused kernels.
    Returns (the folder, the stand-in's report of each rank: strict_cupy STRICT_CUPY_REPORT)."""
    cmd = [*launch, sys.executable, os.path.join(ROOT, "train_wmt.py"), "--data-dir", str(corpus), *TRAIN,
           "--out", str(tmp_path / out), *map(str, extra)]
    report = tmp_path / f"{out}.report.json"
    r = subprocess.run(cmd, capture_output=True, text=True, env=standin_env(tmp_path, STRICT_CUPY_REPORT=str(report),
                                                                            **env), timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device gpu" in r.stderr and "did not compile" not in r.stderr, r.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"{out}.report.json*"))]
    assert reports and all(rep["launches"].get("residual_layernorm") or rep["launches"].get("residual_layernorm_warp")
                           for rep in reports)   # the kernels ran
    return tmp_path / out, reports


def logged_losses(out):
    with open(out / "train_log.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.parametrize("half", [None, "fp16", "bf16"])
def test_train_resume_average_and_score_on_the_gpu_path(corpus, tmp_path, half):
    """train_wmt.py --device gpu: 6 updates with checkpoints every 2, averaged and scored; the
    same run stopped after 4 and resumed equals it exactly (losses and parameters); its
    checkpoints load on the CPU (host arrays) and give the GPU run's validation loss there."""
    args = ["--save-every", 2, "--keep-last", 5, "--average-last", 2, "--valid-every", 3, *([f"--{half}"] if half else [])]
    straight, _ = run_train(corpus, tmp_path, "straight", "--max-steps", 6, *args)
    run_train(corpus, tmp_path, "split", "--max-steps", 4, *args)
    split, _ = run_train(corpus, tmp_path, "split", "--max-steps", 6, "--resume", *args)
    res = json.loads((straight / "results.json").read_text())
    assert res["steps"] == 6 and set(res["bleu"]) == {"valid", "test_2016_flickr"}
    assert res["averaged_checkpoints"] == ["checkpoint_0000004.npz", "checkpoint_0000006.npz"]
    assert len((straight / "test_2016_flickr.hyp.de").read_text().splitlines()) == 8
    a, b = logged_losses(straight), logged_losses(split)
    assert sorted(a) == list(range(1, 7)) and [a[s] for s in (5, 6)] == [b[s] for s in (5, 6)]
    pa, pb = load_checkpoint(straight / "checkpoint_0000006.npz"), load_checkpoint(split / "checkpoint_0000006.npz")
    for name in pa.params:
        assert isinstance(pa.params[name], np.ndarray)
        np.testing.assert_array_equal(pa.params[name], pb.params[name])
    # the averaged checkpoint on the CPU: the validation loss the GPU run reported
    from minitf.data.batching import training_batch
    from minitf.validation import evaluate_loss
    from minitf.data import TokenPairs
    from minitf.data.tokenizer import Tokenizer
    ck = load_checkpoint(straight / "averaged.npz")
    tok = Tokenizer.from_bytes(ck.tokenizer)
    src, ref = (gzip.open(corpus / f"val.{lang}.gz", "rt").read().splitlines() for lang in ("en", "de"))
    pairs = TokenPairs.from_lists(tok.encode(src), tok.encode(ref))
    cpu_loss, _ = evaluate_loss(ck.build_model(device="cpu"), [training_batch(pairs, np.arange(len(src)), tok)])
    assert abs(cpu_loss - res["valid_loss"]) <= 1e-3 * res["valid_loss"]


def test_patience_ends_the_gpu_path_where_the_host_check_ends_it(corpus, tmp_path):
    """--patience on the GPU path: the validation that ends the run is settled while the next update is
    queued, which is then dropped. The run ends at the update, with the weights, Adam state and train
    state, that ending each update on the host (MINITF_HOST_CHECK=1) gives."""
    args = ["--max-steps", 12, "--valid-every", 2, "--patience", 1, "--save-every", 2, "--keep-last", 10]
    runs = {}
    for host in ("1", "0"):
        out, _ = run_train(corpus, tmp_path, f"p{host}", *args, MINITF_HOST_CHECK=host)
        last = sorted(out.glob("checkpoint_0*.npz"))[-1]
        runs[host] = (last.name, load_checkpoint(last), json.loads((out / "results.json").read_text()))
    (name1, ck1, res1), (name0, ck0, res0) = runs["1"], runs["0"]
    assert name1 == name0 and res1["steps"] == res0["steps"] < 12, (name1, name0, res1["steps"])
    assert ck1.train_state["step"] == ck0.train_state["step"] and ck1.train_state["batch"] == ck0.train_state["batch"]
    assert ck1.train_state["forward_count"] == ck0.train_state["forward_count"]
    for name in ck1.params:
        np.testing.assert_array_equal(ck1.params[name], ck0.params[name])
    assert ck1.optimizer["step"] == ck0.optimizer["step"] == ck1.train_state["step"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Untrained tiny checkpoints with a tokenizer, of each architecture (conftest's recipe)."""
    from conftest import make_tiny_checkpoint
    d = tmp_path_factory.mktemp("translate")
    path, lines = make_tiny_checkpoint(d)
    ck = load_checkpoint(path)
    rnn = minitf.Config(**{**ck.config.to_dict(), "arch": "rnn", "rnn_hidden": 16, "attention": "additive"})
    from minitf.architectures import build_model
    save_checkpoint(d / "rnn.npz", build_model(rnn, seed=1), tokenizer=ck.tokenizer)
    (d / "src.txt").write_text("\n".join(lines[:6]) + "\n")
    return {"transformer": path, "rnn": d / "rnn.npz"}, d / "src.txt"


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_translate_on_the_gpu_path_equals_the_cpu(checkpoints, tmp_path, arch):
    """`python -m minitf translate --device gpu`, beam and greedy: the CPU's translations."""
    paths, src = checkpoints
    for beam in (3, 1):
        out = {}
        for device in ("gpu", "cpu"):
            r = subprocess.run([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(paths[arch]), "--input",
                                str(src), "--beam", str(beam), "--max-len-b", "4", "--batch-size", "4", "--quiet",
                                "--device", device], capture_output=True, text=True, env=standin_env(tmp_path),
                               timeout=300, cwd=ROOT)
            assert r.returncode == 0, r.stderr[-3000:]
            out[device] = r.stdout
        assert len(out["gpu"].splitlines()) == 6 and out["gpu"] == out["cpu"], (beam, out)
    # scoring those translations: the CPU's scores
    (tmp_path / "hyp.txt").write_text(out["cpu"])
    scores = {}
    for device in ("gpu", "cpu"):
        r = subprocess.run([sys.executable, "-m", "minitf", "score", "--checkpoint", str(paths[arch]), "--src", str(src),
                            "--tgt", str(tmp_path / "hyp.txt"), "--batch-size", "4", "--quiet", "--device", device],
                           capture_output=True, text=True, env=standin_env(tmp_path), timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        scores[device] = [float(x) for x in r.stdout.split()]
    assert len(scores["gpu"]) == 6 and np.allclose(scores["gpu"], scores["cpu"], atol=2e-4), scores


@pytest.mark.skipif(shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
                    is None or __import__("importlib").util.find_spec("mpi4py") is None,
                    reason="mpi4py or mpiexec not installed (pip install -e '.[dist]')")
def test_two_gpu_ranks_over_nccl_equal_one_gpu_with_twice_the_update_freq(corpus, tmp_path):
    """mpiexec -n 2 train_wmt.py --device gpu, the gradients summed by the stand-in's NCCL (over
    MPI, each rank on its own device), equals one process accumulating 2 batches per update, as
    tests/test_distributed.py checks it on the CPU (float64, no dropout)."""
    from test_distributed import _same
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    args = ["--max-steps", 3, "--save-every", 3, "--average-last", 1, "--dtype", "float64", "--dropout", 0,
            "--valid-every", 0, "--beam", 1]
    one, _ = run_train(corpus, tmp_path, "one", "--update-freq", 2, *args)
    two, reports = run_train(corpus, tmp_path, "two", *args, launch=(mpiexec, "-n", "2"), STRICT_CUPY_DEVICES="2")
    _same(load_checkpoint(one / "checkpoint_0000003.npz").params, load_checkpoint(two / "checkpoint_0000003.npz").params)
    # two per update: the gradients, then the loss sums UpdateCheck decides the outcome from
    assert len(reports) == 2 and all(rep["launches"]["nccl.allReduce"] == 6 for rep in reports)


_UPDATES = {}   # (preset, mode, the MINITF_ and CUPY_ variables) -> (launches by name, total, device-to-host copies)


def counted_update(preset, fp16, env=None):
    """bench.launches.count_update's ({kernel: launches}, total) of one update and the device-to-host copies it made
    (strict_cupy.count_transfers), for `preset`, `fp16` and the environment (every MINITF_ and CUPY_ variable as set
    now, `env` over them): counted once a test run, and the same for every test that asks for the same."""
    from bench.launches import count_update
    now = {k: v for k, v in os.environ.items() if k.startswith(("MINITF_", "CUPY_"))}
    key = (preset, repr(fp16), tuple(sorted({**now, **(env or {})}.items())))
    if key not in _UPDATES:
        with strict_cupy.count_transfers() as t:
            by_name, total = count_update(preset, fp16, env=env)
        _UPDATES[key] = (dict(by_name), total, list(t.d2h))
    by_name, total, d2h = _UPDATES[key]
    return dict(by_name), total, list(d2h)


def test_performance_md_quotes_the_launch_and_allocation_counts_of_a_base_update(standin, monkeypatch):
    """docs/performance.md's counts of one `base` update (bench/launches.py, the default switches): the
    launches, the GEMMs among them, the other launches and the RawKernels among those (all but a
    `fill` and an add of CuPy's), the pack/unpack, gradient-sum, LayerNorm and softmax launches, and
    the arrays with memory of their own, as the stand-in counts them now."""
    sys.path.insert(0, ROOT)
    from bench.launches import count_allocations
    monkeypatch.delenv("MINITF_FUSED_VEC", raising=False)
    monkeypatch.delenv("MINITF_FUSED_ATTN", raising=False)
    by_name, total, _ = counted_update("base", False)
    assert [counted_update("base", mode)[1] for mode in (True, "bfloat16")] == [total, total]   # the page: all three
    merged = {}
    for name, count in by_name.items():
        merged[name.removesuffix("_vec")] = merged.get(name.removesuffix("_vec"), 0) + count
    gemms = sum(n for k, n in by_name.items() if k.startswith("cublas."))
    others = total - gemms
    raw = others - by_name.get("cupy.ndarray.fill", 0) - by_name.get("cupy_add", 0)
    heads = merged.get("unpack_heads", 0) + merged.get("pack_heads", 0)
    norms = sum(n for k, n in merged.items() if k.startswith(("layernorm", "residual_layernorm")))
    softmax = sum(n for k, n in by_name.items() if "softmax" in k)
    allocations = count_allocations("base", False)[1]
    page = " ".join((Path(ROOT) / "docs" / "performance.md").read_text(encoding="utf-8").split())
    for quote in (f"{total} now in float32, `--fp16` and `--bf16`",
                  f"Of the {total}: {gemms} GEMMs, {heads} head pack/unpack passes, "
                  f"{merged['column_sums_into']} gradient-sum launches",
                  f"{norms} LayerNorm launches, {softmax} softmax launches",
                  f"the {gemms} cuBLAS calls", f"the stand-in now counts {raw}",
                  f"the stand-in's other 2 of its {others} non-GEMM launches",
                  f"the stand-in counts {allocations} arrays an update"):
        assert quote in page, quote


@pytest.mark.parametrize("fp16,vec", [(False, "0"), (True, "0"), (True, "1"), ("bfloat16", "0"), ("bfloat16", "1")])
def test_a_base_update_launches_at_most_650_kernels_and_reads_nothing_back(standin, fp16, vec, monkeypatch):
    """One `base` update (forward, backward, Adam) on the GPU path, counted as CuPy would launch
    it (bench/launches.py): at most 650 kernels (1,929 in float32 and 2,256 under --fp16 in the step
    before the fusions existed; 1,877 and 2,204 with every switch at 0 today), the attention's products and the stacked projections as single cuBLAS
    calls, a post-norm block's bias, dropout, sum and LayerNorm as one kernel, and no
    device-to-host copy inside the update (its outcome is decided on the device: optim.UpdateCheck)."""
    sys.path.insert(0, ROOT)
    # "1": the 16-byte kernels (the default: the variable unset), launched as often as the others (but the loss: one
    # launch, smoothed_nll_rows_grad_vec, for two)
    if vec == "1":
        monkeypatch.delenv("MINITF_FUSED_VEC", raising=False)
    else:
        monkeypatch.setenv("MINITF_FUSED_VEC", vec)
    monkeypatch.delenv("MINITF_FUSED_ATTN", raising=False)
    by_name, total, d2h = counted_update("base", fp16)
    if vec == "1":   # (and the LayerNorms a warp a row, which load 16 bytes a lane)
        assert {"bias_relu_vec", "relu_backward_vec", "unpack_heads_vec", "pack_heads_vec", "layernorm_backward_warp",
                "residual_layernorm_warp"} <= set(by_name)
        merged = {}
        for name, count in by_name.items():
            base = name.removesuffix("_vec").removesuffix("_warp")
            merged[base] = merged.get(base, 0) + count
        by_name = merged
    assert total <= 650, sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    assert by_name.get("residual_layernorm") == 2 * 6 + 3 * 6 and "dropout_add" not in by_name
    assert by_name.get("layernorm_backward") == 30 and by_name.get("loss_totals") == 1
    assert by_name.get("update_check") == 1 and by_name.get("adam_update") == 1
    # the loss's forward and backward: one launch over the logits with the 16-byte loads, else two
    loss_kernels = {k: v for k, v in by_name.items() if k.startswith("smoothed_nll")}
    assert loss_kernels == ({"smoothed_nll_rows_grad": 1} if vec == "1" else
                            {"smoothed_nll_rows": 1, "smoothed_nll_backward": 1})
    # QK^T, PV, dV, dP, dQ, dK in each of 18 attentions; q|k|v (12 self-attentions) and k|v (6 cross)
    # projected, and their weight gradients taken, by one batched GEMM each
    assert by_name.get("cublas.gemmStridedBatchedEx") == 6 * 18 + 2 * 12 + 2 * 6
    assert by_name.get("unpack_heads") == 12 * 2 + 6 * 3 and by_name.get("pack_heads") == 12 * 2 + 6 * 3
    assert "cupy_copy" not in by_name and "cupy_scatter_add" not in by_name
    assert not d2h, d2h
    off = {k: "0" for k in ("MINITF_CUBLAS", "MINITF_FUSED_RELU", "MINITF_FUSED_ADAM", "MINITF_FUSED_GRADS",
                            "MINITF_FUSED_EMBED", "MINITF_FUSED_NORM", "MINITF_FUSED_LOSS")}
    all_off = counted_update("base", fp16, env=off)[1]
    assert all_off > 1.8 * total
    if fp16 is False and vec == "0":   # the page: float32's and --fp16's with every switch at 0
        fp16_off = counted_update("base", True, env=off)[1]
        page = " ".join((Path(ROOT) / "docs" / "performance.md").read_text(encoding="utf-8").split())
        assert f"with every switch at 0 today, {all_off:,} and {fp16_off:,}" in page


@pytest.mark.parametrize("fp16", [False, True, "bfloat16"])
def test_a_base_update_with_attention_on_packed_rows_launches_fewer_kernels(standin, fp16, monkeypatch):
    """MINITF_FUSED_ATTN=1: each of the 18 attentions of a `base` update is one kernel forward and one
    backward on the packed rows (kernels.attention_rows), instead of 2 + 4 batched products, 2 softmax
    launches and the head unpacks and packs around them; the stacked projections stay (one batched GEMM
    each way for q|k|v and k|v); still no device-to-host copy. docs/performance.md quotes the count."""
    sys.path.insert(0, ROOT)
    from bench.launches import count_allocations
    monkeypatch.setenv("MINITF_FUSED_ATTN", "1")
    by_name, total, d2h = counted_update("base", fp16)
    assert {k: v for k, v in by_name.items() if k.startswith("attention_rows")} == {
        "attention_rows_forward": 18, "attention_rows_backward": 18}
    assert by_name.get("cublas.gemmStridedBatchedEx") == 2 * 12 + 2 * 6
    assert not [k for k in by_name if "softmax" in k or "pack_heads" in k or k == "cupy_add"]   # nor the masks' sum
    assert not d2h, d2h
    monkeypatch.delenv("MINITF_FUSED_ATTN")
    # gone: 6 products and 2 softmax launches an attention, 4 head passes a self-attention and 6 a cross-attention,
    # and the decoder's causal + padding bias (the spans mask)
    assert total == counted_update("base", fp16)[1] - 18 * (6 + 2) - 12 * 4 - 6 * 6 + 18 * 2 - 1
    page = " ".join((Path(ROOT) / "docs" / "performance.md").read_text(encoding="utf-8").split())
    assert f"{total} with `MINITF_FUSED_ATTN=1`" in page
    strided = counted_update("base", fp16)[0]["cublas.gemmStridedBatchedEx"]
    assert (f"{by_name['cublas.gemmStridedBatchedEx']} strided-batched GEMMs, the stacked projections', where the head "
            f"layout takes {strided}; the {by_name['cublas.gemmEx']} other GEMMs stay") in page
    monkeypatch.setenv("MINITF_FUSED_ATTN", "1")
    assert f"{count_allocations('base', fp16)[1]} with `MINITF_FUSED_ATTN=1`, by call site" in page


@pytest.mark.parametrize("capability,tensor", [("90", True), ("80", True), ("75", False)])
def test_attention_on_packed_rows_takes_tensor_cores_only_where_the_device_has_them(standin, monkeypatch, capability,
                                                                                    tensor):
    """float16 and bfloat16 heads of 16 to 64 values (multiples of 16) run attention_rows_*_mma on a device of compute
    capability 8.0 or newer: mma.sync m16n8k16 needs sm_80, and the tensor-core kernels' bodies are empty below it
    (launched there, they would write nothing); so do float32's where float32 products run on TF32 (CUPY_TF32, which
    tests/conftest.py unsets; mma.sync m16n8k8). Other dtypes and widths, and MINITF_FUSED_ATTN_MMA=0, keep the
    CUDA-core kernels."""
    from minitf import kernels
    from minitf.backend import dtype_named
    monkeypatch.setenv("STRICT_CUPY_COMPUTE_CAPABILITY", capability)
    monkeypatch.setattr(kernels, "_ARCH", {})
    x = {d: standin.zeros((4, 64), dtype=dtype_named(d)) for d in ("float16", "bfloat16", "float32", "float64")}
    for d, k in (("float16", 16), ("bfloat16", 64), ("float16", 32)):
        assert kernels.attention_tensor_cores(x[d], k) == tensor, (d, k)
    assert not any(kernels.attention_tensor_cores(x[d], 16) for d in ("float32", "float64"))
    assert not any(kernels.attention_tensor_cores(x["float16"], k) for k in (8, 24, 80))
    monkeypatch.setenv("CUPY_TF32", "1")
    assert kernels.attention_tensor_cores(x["float32"], 64) == tensor
    assert not kernels.attention_tensor_cores(x["float64"], 64)
    assert not kernels.attention_tensor_cores(x["float32"], 24)
    monkeypatch.setenv("MINITF_FUSED_ATTN_MMA", "0")
    assert not any(kernels.attention_tensor_cores(x[d], 64) for d in ("float16", "float32"))


def test_a_base_update_with_relu_backward_inside_the_bias_sums_launches_12_fewer(standin, monkeypatch):
    """MINITF_FUSED_RELUSUMS=1: the 12 feed-forwards' ReLU backward goes into their first bias's column sums
    (kernels.relu_backward_sums, column_sums_relu_into): 12 launches fewer, no relu_backward; alone and with
    attention on packed rows. docs/performance.md quotes the counts."""
    sys.path.insert(0, ROOT)
    monkeypatch.delenv("MINITF_FUSED_ATTN", raising=False)
    monkeypatch.delenv("MINITF_FUSED_RELUSUMS", raising=False)
    before, total0, _ = counted_update("base", True)
    after, total, _ = counted_update("base", True, env={"MINITF_FUSED_RELUSUMS": "1"})
    both = counted_update("base", True, env={"MINITF_FUSED_RELUSUMS": "1", "MINITF_FUSED_ATTN": "1"})[1]
    attn = counted_update("base", True, env={"MINITF_FUSED_ATTN": "1"})[1]
    assert total == total0 - 12 and both == attn - 12
    assert before.get("relu_backward_vec") == 12 and not any(k.startswith("relu_backward") for k in after)
    assert after["column_sums_relu_into"] == 12 and after["column_sums_into"] == before["column_sums_into"] - 12
    page = " ".join((Path(ROOT) / "docs" / "performance.md").read_text(encoding="utf-8").split())
    assert f"{total} with `MINITF_FUSED_RELUSUMS=1` (ReLU's backward inside the 12 feed-forwards' first bias sums), " \
           f"{both} with both" in page


def test_gpu_ab_times_the_update_ended_on_the_device_against_the_host(tmp_path, standin, monkeypatch):
    """bench/gpu_ab.py --steps-per-round 2 with MINITF_HOST_CHECK=1 as a variant, on the stand-in: both
    variants are timed, give the same gradients, and the host variant's runner reads each outcome
    (train.step_stats) while the default one decides it on the device (UpdateCheck)."""
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--rounds", "2", "--steps-per-round", "2",
                  "--variant", "now=", "--variant", "host=MINITF_HOST_CHECK=1", "--modes", "fp16",
                  "--out", tmp_path / "ab")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^  (now|host) +[\d.]+ ms .* grad diff (\S+)$", r.stdout, re.M)
    assert [name for name, _ in rows] == ["now", "host"] and all(float(d) == 0.0 for _, d in rows), r.stdout
    sys.path.insert(0, ROOT)
    from bench.train_step import MinitfRunner
    from bench.data import wmt_batch
    cfg = minitf.Config.preset("tiny", vocab_size=64)
    for host, on_device in (("0", True), ("1", False)):
        monkeypatch.setenv("MINITF_HOST_CHECK", host)
        runner = MinitfRunner(cfg, "gpu", wmt_batch(cfg, 120), 1e-4, True)
        assert (runner.check is not None) is on_device and runner.read_on_host
        with strict_cupy.count_transfers() as t:
            runner.step()
            runner.step()
        assert len(t.d2h) == (0 if on_device else 2) and len(t.d2h_async) == (2 if on_device else 0)


def test_the_attention_bench_times_both_paths_of_each_attention(tmp_path):
    """bench/attention_rows.py --smoke on the stand-in: the three attentions in the three modes, each timed in
    the head layout (its weights a pitch apart, and S apart) and on packed rows (in 16 bits, and in float32 with TF32
    products, the script's default, on tensor cores and on CUDA cores; in float32 without TF32 on CUDA cores only),
    with the other paths' input gradients as close to the head layout's as the mode allows."""
    r = run_bench(tmp_path, "attention_rows.py", "--smoke")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^  (\w+) +(encoder self|decoder self|cross) +head layout +[\d.]+ ms +rows S apart +[\d.]+ ms "
                      r"x[\d.]+ +packed rows +[\d.]+ ms x[\d.]+(  on CUDA cores +[\d.]+ ms x[\d.]+)? +input gradients "
                      r"differ by (\S+)$", r.stdout, re.M)
    assert [(m, bool(cuda)) for m, _, cuda, _ in rows] == [(m, True) for m in ("float32", "fp16", "bf16")
                                                         for _ in range(3)], r.stdout
    rows = [(m, a, d) for m, a, _, d in rows]
    assert [(m, a) for m, a, _ in rows] == [(m, a) for m in ("float32", "fp16", "bf16")
                                           for a in ("encoder self", "decoder self", "cross")], r.stdout
    tol = {"float32": 5e-3, "fp16": 5e-3, "bf16": 3e-2}     # float32: TF32 products
    assert all(float(d) <= tol[m] for m, _, d in rows), r.stdout
    r = run_bench(tmp_path, "attention_rows.py", "--smoke", "--modes", "float32", CUPY_TF32="0")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^  float32 +(encoder self|decoder self|cross) +head layout +[\d.]+ ms +rows S apart +[\d.]+ ms "
                      r"x[\d.]+ +packed rows +[\d.]+ ms x[\d.]+ +input gradients differ by (\S+)$", r.stdout, re.M)
    assert len(rows) == 3 and all(float(d) <= 1e-5 for _, d in rows), r.stdout


def test_the_column_sums_bench_times_each_sum_against_another_kernels_file(tmp_path):
    """bench/column_sums.py --smoke --against FILE on the stand-in: each of the step's seven sums in the three modes,
    timed in this version and in FILE's (here the same file: the same bits); a file that is not there is named, and
    one that would launch its sums another way is refused."""
    r = run_bench(tmp_path, "column_sums.py", "--smoke", "--against", os.path.join(ROOT, "minitf", "kernels.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^  (\w+) +(.+?) +[\d.]+ us  against +[\d.]+ us x[\d.]+  same bits: (yes|no)$", r.stdout, re.M)
    assert [m for m, _, _ in rows] == [m for m in ("float32", "fp16", "bf16") for _ in range(7)], r.stdout
    assert {same for _, _, same in rows} == {"yes"}, r.stdout
    r = run_bench(tmp_path, "column_sums.py", "--smoke", "--against", str(tmp_path / "none.py"))
    assert r.returncode != 0 and "none.py: no such file" in r.stderr and "Traceback" not in r.stderr
    other = tmp_path / "other_kernels.py"      # a version that would launch its sums with other slabs: refused
    other.write_text((Path(ROOT) / "minitf" / "kernels.py").read_text().replace("COLUMN_MIN_ROWS = 64", "COLUMN_MIN_ROWS = 32"))
    r = run_bench(tmp_path, "column_sums.py", "--smoke", "--against", str(other))
    assert r.returncode != 0 and "COLUMN_MIN_ROWS is 32 there, 64 here" in r.stderr and "Traceback" not in r.stderr
    r = run_bench(tmp_path, "column_sums.py", "--rows", "0")
    assert r.returncode == 2 and "--rows must be at least 1, got 0" in r.stderr


def test_the_allocations_bench_times_the_pool_against_a_kept_buffer(tmp_path):
    """bench/allocations.py --smoke on the stand-in: each shape in float16 and float32, an array from the pool and a
    view of a kept buffer, with what the difference comes to an update."""
    r = run_bench(tmp_path, "allocations.py", "--smoke")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = re.findall(r"^  (float16|float32) +\[[\d, ]+\] +pool +[\d.]+ us  slice +[\d.]+ us \(saves [-+][\d.]+ ms an "
                      r"update\)$", r.stdout, re.M)
    assert rows == ["float16"] * 2 + ["float32"] * 2, r.stdout
    r = run_bench(tmp_path, "allocations.py", "--calls", "0")
    assert r.returncode == 2 and "--calls must be at least 1, got 0" in r.stderr


def test_the_gemm_bench_times_every_product_of_an_update(tmp_path, standin):
    """bench/gemm_shapes.py --smoke on the stand-in: in each mode one row per distinct cuBLAS call of an update,
    their calls adding up to the update's GEMMs as bench/launches.py counts them, each with its time, rate and
    the host's time to issue it, then the totals; a bad count is refused by name."""
    sys.path.insert(0, ROOT)
    from bench.launches import count_update
    r = run_bench(tmp_path, "gemm_shapes.py", "--smoke", "--no-torch", "--top", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    for mode, fp16 in (("float32", False), ("fp16", True), ("bf16", "bfloat16")):
        block = r.stdout.split(f"## {mode}: ")[1].split("## ")[0]
        total, distinct = map(int, re.match(r"(\d+) GEMMs an update, (\d+) distinct", block).groups())
        rows = re.findall(r"^ +(\d+) +[\d.]+ +[\d.]+ +[\d.]+% +[\d.]+  (\d+ x \d+ x \d+.*)$", block, re.M)
        assert len(rows) == distinct and len(set(label for _, label in rows)) == distinct, block
        assert sum(int(n) for n, _ in rows) == total, block
        assert total == sum(n for k, n in count_update("tiny", fp16)[0].items() if k.startswith("cublas.")), block
        assert re.search(r"^  all minitf: [\d.]+ ms an update, each call timed alone \([\d.]+ TFLOP/s\), [\d.]+ ms "
                         r"of the host's to issue them$", block, re.M), block
        assert re.search(r"^  a square 64 x 64 x 64 product: minitf [\d.]+ TFLOP/s$", block, re.M), block
    r = run_bench(tmp_path, "gemm_shapes.py", "--calls", "0")
    assert r.returncode == 2 and "--calls must be at least 1, got 0" in r.stderr


def test_the_gemm_bench_makes_the_same_product_in_both_engines(standin):
    """bench/gemm_shapes.py's two ways to make a recorded call, gemm.matmul on the stand-in and PyTorch's
    addmm_/baddbmm_ on strided views (here on the CPU), give the same c: transposes, alpha, beta = 1, and batches
    whose matrices interleave (heads side by side in a row, as the attention's products address them)."""
    torch = pytest.importorskip("torch", reason="PyTorch is optional: this cross-check of the bench needs it")
    sys.path.insert(0, ROOT)
    from bench import gemm_shapes
    rng = np.random.default_rng(0)
    keys = [("float32", False, False, 1.0, 0.0, 1, (5, 7, 7, 35), (7, 3, 3, 21), (5, 3, 3, 15)),
            ("float32", True, False, 1.0, 1.0, 1, (7, 5, 9, 63), (7, 3, 3, 21), (5, 3, 4, 20)),
            ("float32", False, True, 0.5, 0.0, 1, (5, 7, 7, 35), (3, 7, 7, 21), (5, 3, 3, 15)),
            # 3 heads of 4 values side by side in rows of 12 (stride 4), c [3, 5, 6] contiguous
            ("float32", False, True, 0.25, 0.0, 3, (5, 4, 12, 4), (6, 4, 12, 4), (5, 6, 6, 30)),
            ("float32", True, False, 1.0, 1.0, 3, (6, 5, 5, 30), (6, 4, 12, 4), (5, 4, 4, 20))]
    for key in keys:
        host = gemm_shapes.operands(key, rng)
        run, c = gemm_shapes.minitf_call(standin, key, host)
        run()
        run_t, c_t = gemm_shapes.torch_call(torch, key, host, device="cpu")
        run_t()
        np.testing.assert_allclose(backend.to_numpy(c), c_t.numpy(), rtol=1e-5, atol=1e-6, err_msg=str(key))
        assert not np.allclose(backend.to_numpy(c), host[2]), key      # c was written
    for engine in (lambda k: gemm_shapes.minitf_call(standin, k),
                   lambda k: gemm_shapes.torch_call(torch, k, device="cpu")):
        run, c = engine(keys[-1])                      # the timed calls: values drawn on the device
        before = np.array(backend.to_numpy(c) if not hasattr(c, "numpy") else c.numpy())
        run()
        after = backend.to_numpy(c) if not hasattr(c, "numpy") else c.numpy()
        assert np.all(np.abs(before) <= 0.1) and not np.allclose(before, after)


def test_the_gpu_reports_kernel_tables_cover_float32_and_fp16():
    """The kernels section profiles float32 and --fp16 (the modes of bench/gpu_report.py's KERNEL_MODES)
    and the report prints a table for each, minitf's largest kernels beside PyTorch's."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_report", os.path.join(ROOT, "bench", "gpu_report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert [mode for mode, _ in report.KERNEL_MODES] == ["float32", "fp16"]
    table = {"wall_ms": 45.1, "busy_ms": 38.2, "kernels": 697, "top": [["gemm", 3.2, 0.1, 12.0], ["softmax", 1.0, 0.03, 18.0]]}
    lines = report.kernel_tables({"preset": "base", "steps": 3, "modes": {m: {"minitf": table, "torch": table}
                                                                          for m, _ in report.KERNEL_MODES}})
    heads = [line for line in lines if line.startswith("**Where a step's GPU time goes**")]
    assert len(heads) == 2 and "float32" in heads[0] and "fp16" in heads[1]
    assert sum(line.startswith("| `softmax`") for line in lines) == 2
    # report.json keeps more kernels than the tables show
    many = dict(table, top=[[f"k{i}", 1.0, 0.01, 1.0] for i in range(40)])
    lines = report.kernel_tables({"preset": "base", "steps": 3, "modes": {"fp16": {"minitf": many, "torch": many}}})
    assert sum(line.startswith("| `k") for line in lines) == report.TABLE_ROWS == 12


def test_the_gpu_report_runs_its_sections(tmp_path):
    """bench/gpu_report.py, the one command for a GPU, at tiny sizes on the stand-in: the training
    step, beam search and the WMT14-shaped run each give their figures (the suite section is
    this test suite itself); PyTorch columns are '-' where torch is absent; the step's rounds of two
    consecutive steps are said so."""
    r = run_bench(tmp_path, "gpu_report.py", "--smoke", "--skip", "suite", "--steps-per-round", "2",
                  "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(rep["sections"]) == {"launches", "step", "kernels", "beam", "wmt"}
    assert not [name for name, sec in rep["sections"].items() if "error" in sec], rep["sections"]
    for mode in ("float32", "fp16", "bf16"):   # one line each, the count the launch test holds
        assert re.search(rf"^launches per update: base {mode} \d+$", r.stdout, re.M), r.stdout[-2000:]
    try:
        import torch
        cuda_torch = torch.cuda.is_available()
    except ImportError:
        cuda_torch = False
    if not cuda_torch:      # no torch, or a CPU-only build: the columns are absent and the report says why
        assert "The PyTorch columns are absent" in r.stdout
    kern = rep["sections"]["kernels"]   # PyTorch's profiler needs CUDA: skipped here unless a GPU is present
    assert ("minitf" in kern and kern["minitf"]["top"]) or "PyTorch with CUDA" in kern["skipped"], kern
    assert rep["sections"]["step"]["tiny"]["fp16"]["minitf"]["tgt_tokens_per_s"] > 0
    assert rep["sections"]["step"]["tiny"]["bf16"]["minitf"]["dtype"] == "bfloat16"
    assert rep["sections"]["beam"]["sentences_per_s"] > 0 and rep["sections"]["wmt"]["updates_per_s"] > 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**Training step**" in md and "**Beam search**" in md and "**A WMT14-shaped run**" in md
    assert rep["steps_per_round"] == 2 and "alternating rounds of 2 consecutive steps, a step's share" in md
    # the command as run, and the switches it ran under (the stand-in's here)
    assert "`python bench/gpu_report.py --smoke --skip suite --steps-per-round 2 --out " in md
    assert "` with MINITF_CUPY_MODULE=strict_cupy" in md
    assert "**Where a step's GPU time goes**" in md


def test_the_gpu_report_keeps_what_it_measured_when_stopped_and_says_what_it_left_out(tmp_path, standin, monkeypatch,
                                                                                       capsys):
    """bench/gpu_report.py writes report.json and report.md again after every section: a command stopped in a later
    section (its timeout) leaves the sections before it, marked as the report so far; a --budget too short for the
    WMT14-shaped run leaves that run out and says why."""
    sys.path.insert(0, ROOT)
    from bench import gpu_report

    def stopped(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(gpu_report, "section_beam", stopped)
    with pytest.raises(KeyboardInterrupt):
        gpu_report.main(["--smoke", "--skip", "suite,step,kernels", "--out", str(tmp_path / "a")])
    got = json.loads((tmp_path / "a" / "report.json").read_text())
    assert list(got["sections"]) == ["launches"] and "complete" not in got
    assert (tmp_path / "a" / "report.md").read_text().startswith("(the report so far: sections launches)")
    assert "launches per update: base fp16" in (tmp_path / "a" / "report.md").read_text()
    rep = gpu_report.main(["--smoke", "--skip", "suite,launches,step,kernels,beam", "--budget", "0", "--out",
                           str(tmp_path / "b")])
    assert rep["complete"] and "left of --budget 0; the run needs at least" in rep["sections"]["wmt"]["skipped"]
    md = (tmp_path / "b" / "report.md").read_text()
    assert not md.startswith("(the report so far"), md[:200]
    assert "**A WMT14-shaped run**: skipped (0 s left of --budget 0" in md


def run_same_training(tmp_path, *extra):
    """bench/same_training.py on the stand-in over a tiny corpus and tokenizer made in tmp_path (once): 3 updates of
    the tiny preset, then `extra`; the finished process."""
    from conftest import write_multi30k
    data = tmp_path
    if not (tmp_path / "tok.model").exists():
        write_multi30k(data, sizes=(("train", 200), ("val", 20)))
        lines = [ln for lang in ("en", "de") for ln in gzip.open(data / f"train.{lang}.gz", "rt").read().splitlines()]
        Tokenizer.train(lines, tmp_path / "tok.model", vocab_size=40)
    return run_bench(tmp_path, "same_training.py", "--train-src", data / "train.en.gz", "--train-tgt",
                     data / "train.de.gz", "--valid-src", data / "val.en.gz", "--valid-tgt", data / "val.de.gz",
                     "--tokenizer", tmp_path / "tok.model", "--preset", "tiny", "--updates", "3", "--max-tokens", "160",
                     *extra)


@pytest.mark.parametrize("half,tol", [("--fp16", 1e-3), ("--bf16", 1e-2)])
def test_same_training_holds_the_variants_to_one_validation_loss(tmp_path, half, tol):
    """bench/same_training.py on the stand-in: a few float16 (or bfloat16) updates of the GPU step as
    it is and with every fusion switched off, from the same weights on the same batches, reach the
    same validation NLL (the same arithmetic up to rounding); the dropout-seed runner differs."""
    r = run_same_training(tmp_path, half, "--no-torch", "--also-seed", "1", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {x["runner"]: x for x in json.loads((tmp_path / "o" / "same_training.json").read_text())["runners"]}
    assert list(runs) == ["now", "now@seed1", "before"]
    assert all(x["updates"] + x["skipped"] == 3 and np.isfinite(x["valid_nll"]) for x in runs.values())
    assert abs(runs["before"]["valid_nll_rel_diff"]) < tol, runs
    assert runs["now@seed1"]["valid_nll"] != runs["now"]["valid_nll"]


def test_same_training_judges_engines_over_their_seeds(tmp_path):
    """--seeds 2: every variant with dropout seeds 0 and 1, seed by seed, then each engine's mean validation NLL,
    its spread and the means' relative difference; the two fusion settings reach the same means."""
    r = run_same_training(tmp_path, "--fp16", "--no-torch", "--seeds", "2", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "o" / "same_training.json").read_text())
    runs = {x["runner"]: x["valid_nll"] for x in info["runners"]}
    assert list(runs) == ["now", "before", "now@seed1", "before@seed1"]
    assert runs["now@seed1"] != runs["now"]
    now, before = info["engines"]
    assert (now["engine"], now["seeds"], before["engine"], before["seeds"]) == ("now", 2, "before", 2)
    assert now["valid_nll_mean"] == pytest.approx((runs["now"] + runs["now@seed1"]) / 2, rel=1e-12)
    assert now["valid_nll_min"] == min(runs["now"], runs["now@seed1"]) < now["valid_nll_max"]
    assert now["mean_rel_diff"] == 0 and abs(before["mean_rel_diff"]) < 1e-3
    assert re.search(r"^now\s+2\s+\d\.\d{4} \(\d\.\d{4}-\d\.\d{4}\)\s+\+0\.00%$", r.stdout, re.M), r.stdout
    # the names' column as wide as the longest name ("before@seed1"): each run's count of updates ends under "made"
    table = r.stdout[r.stdout.index("runner "):].splitlines()[:5]
    ends = {line.index("made") + 4 if i == 0 else re.match(r"\S+ +\d+", line).end() for i, line in enumerate(table)}
    assert len(ends) == 1, table
    bad = run_same_training(tmp_path, "--seeds", "0")
    assert bad.returncode == 2 and "argument --seeds: must be an integer >= 1, got 0" in bad.stderr


def test_same_training_stores_float32_gradients_as_float16_would(tmp_path):
    """--grad-float16 SCALE: before each update minitf's float32 gradients become what a float16 buffer at loss scale
    SCALE holds (rounded to float16's 11 bits, 0 below its smallest subnormal, infinite above its largest value), and
    the run trains on them; with --fp16 or --bf16, or a scale that is not positive, it is refused."""
    sys.path.insert(0, ROOT)
    from bench.same_training import float16_stored
    g = np.array([1.0 + 2.0 ** -12, 2e-11, 1e-3, 7e4, -2.5e-6], dtype=np.float32)
    got = float16_stored(g.copy(), 1024.0)
    want = (g * 1024).astype(np.float16).astype(np.float32) / 1024
    np.testing.assert_array_equal(got, want)
    assert got[0] == 1.0 and got[1] == 0 and np.isinf(got[3]) and got[2] != g[2] and abs(got[2] - g[2]) < 1e-3 * 2 ** -10
    base = run_same_training(tmp_path, "--device", "cpu", "--no-torch", "--variant", "now=", "--out", tmp_path / "a")
    q = run_same_training(tmp_path, "--device", "cpu", "--no-torch", "--variant", "now=", "--grad-float16", "1",
                          "--out", tmp_path / "b")
    assert base.returncode == 0 and q.returncode == 0, q.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "same_training.json").read_text()) for d in "ab")
    assert b["grad_float16"] == 1.0 and a["grad_float16"] is None
    assert a["runners"][0]["valid_nll"] != b["runners"][0]["valid_nll"]     # scale 1: the small gradients are lost
    for bad in (["--fp16", "--grad-float16", "1024"], ["--grad-float16", "0"]):
        r = run_same_training(tmp_path, *bad)
        assert r.returncode == 2 and "--grad-float16 takes a positive loss scale and float32" in r.stderr


def test_same_training_rounds_every_layernorm_output_to_float16(tmp_path):
    """--norm-float16: every LayerNorm of minitf's float32 model (each post-norm block's output, the residual stream)
    gives values float16 holds, and the run trains on them; refused with --fp16."""
    sys.path.insert(0, ROOT)
    from bench.same_training import norms_in_float16
    from minitf.layers.layernorm import LayerNorm
    cfg = minitf.Config.preset("tiny", vocab_size=40)
    model = norms_in_float16(minitf.Transformer(cfg, seed=0))
    norms = [layer for layer in model.layers() if isinstance(layer, LayerNorm)]
    assert len(norms) == 5
    x = np.random.default_rng(0).standard_normal((3, cfg.d_model)).astype(np.float32)
    y = norms[0].forward(x)
    assert y.dtype == np.float32 and np.array_equal(y, y.astype(np.float16).astype(np.float32))
    plain = minitf.Transformer(cfg, seed=0)
    assert not np.array_equal(y, [n for n in plain.layers() if isinstance(n, LayerNorm)][0].forward(x))
    src, tgt_in, tgt_out = (np.array([[5, 6, 7, 2]]), np.array([[1, 8, 9]]), np.array([[8, 9, 2]]))
    model.eval(), plain.eval()
    assert model.forward_loss(src, tgt_in, tgt_out) != plain.forward_loss(src, tgt_in, tgt_out)
    base = run_same_training(tmp_path, "--device", "cpu", "--no-torch", "--variant", "now=", "--out", tmp_path / "a")
    q = run_same_training(tmp_path, "--device", "cpu", "--no-torch", "--variant", "now=", "--norm-float16",
                          "--out", tmp_path / "b")
    assert base.returncode == 0 and q.returncode == 0, q.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "same_training.json").read_text()) for d in "ab")
    assert b["norm_float16"] is True and a["norm_float16"] is False
    assert a["runners"][0]["valid_nll"] != b["runners"][0]["valid_nll"]
    r = run_same_training(tmp_path, "--fp16", "--norm-float16")
    assert r.returncode == 2 and "--norm-float16 is for float32" in r.stderr


def test_same_training_runs_a_variant_of_another_copy_of_the_kernels(tmp_path):
    """--variant NAME=KERNELS=FILE trains with FILE's CUDA (bench/gpu_ab.py's variants): a copy of kernels.py
    reaches the same validation NLL to the bit; a missing file is refused before anything runs."""
    copy = tmp_path / "copy.py"
    copy.write_text(Path(ROOT, "minitf", "kernels.py").read_text())
    r = run_same_training(tmp_path, "--fp16", "--no-torch", "--variant", "now=", "--variant", f"copy=KERNELS={copy}",
                          "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {x["runner"]: x for x in json.loads((tmp_path / "o" / "same_training.json").read_text())["runners"]}
    assert list(runs) == ["now", "copy"] and runs["copy"]["valid_nll"] == runs["now"]["valid_nll"]
    gone = run_same_training(tmp_path, "--variant", f"old=KERNELS={tmp_path / 'no.py'}")
    assert gone.returncode == 1 and f"KERNELS={tmp_path / 'no.py'}: no such file" in gone.stderr


def test_same_training_reports_a_failing_runner_and_runs_the_others(tmp_path, standin, monkeypatch, capsys):
    """bench/same_training.py: a runner that fails is printed as FAILED with its error and listed under "failed";
    the runners after it still train, and the first runner that finished is the yardstick."""
    from conftest import write_multi30k
    sys.path.insert(0, ROOT)
    import bench.same_training as same
    data = write_multi30k(tmp_path, sizes=(("train", 60), ("val", 10)))
    lines = [ln for lang in ("en", "de") for ln in gzip.open(data / f"train.{lang}.gz", "rt").read().splitlines()]
    Tokenizer.train(lines, tmp_path / "tok.model", vocab_size=40)
    train_minitf = same.train_minitf

    def failing_attn(name, *rest):
        if name == "attn":
            raise MemoryError("Out of memory allocating 1,073,741,824 bytes")
        return train_minitf(name, *rest)
    monkeypatch.setattr(same, "train_minitf", failing_attn)
    info = same.main(["--train-src", str(data / "train.en.gz"), "--train-tgt", str(data / "train.de.gz"),
                      "--valid-src", str(data / "val.en.gz"), "--valid-tgt", str(data / "val.de.gz"),
                      "--tokenizer", str(tmp_path / "tok.model"), "--preset", "tiny", "--updates", "2",
                      "--max-tokens", "160", "--fp16", "--no-torch", "--variant", "attn=MINITF_FUSED_ATTN=1",
                      "--variant", "now=", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "attn        FAILED: MemoryError: Out of memory allocating 1,073,741,824 bytes" in out, out
    assert [r["runner"] for r in info["runners"]] == ["now"] and info["runners"][0]["valid_nll_rel_diff"] == 0
    saved = json.loads((tmp_path / "o" / "same_training.json").read_text())
    assert saved["failed"] == [{"runner": "attn", "error": "MemoryError: Out of memory allocating 1,073,741,824 "
                                                         "bytes"}]


def test_gpu_ab_reports_a_failing_mode_and_runs_the_others(tmp_path, standin, monkeypatch, capsys):
    """A preset and mode whose run fails (a first run of new kernels on a GPU, say) is printed as FAILED with
    its error and written to ab.json as such; the modes after it still run."""
    sys.path.insert(0, ROOT)
    import bench.gpu_ab as gpu_ab
    compare = gpu_ab.compare

    def failing_in_bf16(cfg, batch, fp16, *rest):
        if fp16 == "bfloat16":
            raise RuntimeError("NVRTC_ERROR_COMPILATION: the bfloat16 kernels did not compile")
        return compare(cfg, batch, fp16, *rest)
    monkeypatch.setattr(gpu_ab, "compare", failing_in_bf16)
    gpu_ab.main(["--smoke", "--no-torch", "--rounds", "2", "--variant", "now=", "--modes", "bf16,fp16",
                 "--out", str(tmp_path / "ab")])
    out = capsys.readouterr().out
    assert "## tiny bf16: FAILED: RuntimeError: NVRTC_ERROR_COMPILATION" in out
    assert re.search(r"^## tiny fp16 .*\n  now +[\d.]+ ms", out, re.M), out
    results = json.loads((tmp_path / "ab" / "ab.json").read_text())["results"]
    assert results["tiny bf16"] == {"error": "RuntimeError: NVRTC_ERROR_COMPILATION: the bfloat16 kernels did not "
                                             "compile"}
    assert results["tiny fp16"]["time"]["now"]["step_ms"] > 0


def test_gpu_ab_leaves_a_variant_that_raises_out_of_that_mode_and_the_others_go_on(tmp_path):
    """bench/gpu_ab.py on the stand-in with a copy of the kernels whose bfloat16 source does not build, between two
    variants that do: in --bf16 that copy is FAILED with the compiler's error and the variant after it is still
    compared and timed; in --fp16 all three run."""
    from cuda_emulator import compiler
    if compiler() is None:
        pytest.skip("needs g++ >= 12 to emulate the CUDA kernels on the CPU")
    broken = tmp_path / "broken_kernels.py"
    text = open(os.path.join(ROOT, "minitf", "kernels.py")).read()
    assert text.count('MINITF_STORAGE16(bf16_t, f2bf, bf2f)\n"""') == 1
    broken.write_text(text.replace('MINITF_STORAGE16(bf16_t, f2bf, bf2f)\n"""',
                                   'MINITF_STORAGE16(bf16_t, f2bf, bf2f)\nnot_a_type x;\n"""'))
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--modes", "bf16,fp16", "--variant", "now=",
                  "--variant", f"broken=KERNELS={broken}", "--variant", "lnblock=MINITF_FUSED_LNWARP=0",
                  "--out", tmp_path / "ab")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "ab" / "ab.json").read_text())["results"]
    bf16, fp16 = results["tiny bf16"], results["tiny fp16"]
    assert list(bf16["failed"]) == ["broken"] and "did not build" in bf16["failed"]["broken"], bf16
    assert set(bf16["time"]) == set(bf16["same"]) == {"now", "lnblock"} and bf16["same"]["lnblock"]["finite"]
    assert "failed" not in fp16 and set(fp16["time"]) == {"now", "broken", "lnblock"}
    assert "  broken   FAILED: RuntimeError: the emulator's library for kernels_bfloat16 did not build" in r.stdout


def test_gpu_ab_launches_a_copy_of_the_kernels_with_its_own_softmax_rows_a_warp(tmp_path):
    """A copy of the kernels whose warp softmax takes a row a warp (WARP_ROW_RUN = 1, as before it took two; in the
    CUDA and the Python both) runs under gpu_ab with its own grid: the same loss and gradients, bit for bit, as
    minitf's (each row is computed alike either way). Launched with minitf's grid, half its rows were never
    written."""
    from cuda_emulator import compiler
    if compiler() is None:
        pytest.skip("needs g++ >= 12 to emulate the CUDA kernels on the CPU")
    text = open(os.path.join(ROOT, "minitf", "kernels.py")).read()
    cuda, python = "#define WARP_ROW_RUN 2 ", "WARP_ROW_RUN = 2 "
    assert text.count(cuda) == 1 and text.count(python) == 1
    one = tmp_path / "one_row_a_warp.py"
    one.write_text(text.replace(cuda, "#define WARP_ROW_RUN 1 ").replace(python, "WARP_ROW_RUN = 1 "))
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--modes", "float32", "--rounds", "1",
                  "--steps-per-round", "1", "--variant", "now=", "--variant", f"one=KERNELS={one}",
                  "--out", tmp_path / "ab")
    assert r.returncode == 0, r.stderr[-3000:]
    same = json.loads((tmp_path / "ab" / "ab.json").read_text())["results"]["tiny float32"]["same"]
    assert same["one"]["finite"] and same["one"]["grad_rel_diff"] == 0.0 and same["one"]["loss_rel_diff"] == 0.0, same


def test_gpu_ab_times_a_copy_whose_softmax_takes_rows_n_apart_with_tight_rows(tmp_path):
    """A copy of the kernels from before the head layout's weights lay in rows of whole 16-byte vectors (its softmax
    kernels without the trailing pitch: rows n apart) runs under gpu_ab where MINITF_ATTN_PITCH=0 makes every pitch n
    (launched without that argument): the same loss and gradients, bit for bit, as minitf's own kernels with tight
    rows, and as with rows a pitch apart; without MINITF_ATTN_PITCH=0 it is refused before anything runs."""
    from cuda_emulator import compiler
    if compiler() is None:
        pytest.skip("needs g++ >= 12 to emulate the CUDA kernels on the CPU")
    text = open(os.path.join(ROOT, "minitf", "kernels.py")).read()
    assert len(re.findall(r",\s*long long pitch\)", text)) == 4 and text.count("* pitch;") == 7
    old = tmp_path / "rows_n_apart.py"
    old.write_text(re.sub(r",\s*long long pitch\)", ")", text).replace("* pitch;", "* n;"))
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--modes", "fp16", "--rounds", "1",
                  "--steps-per-round", "1", "--variant", "now=", "--variant", "tight=MINITF_ATTN_PITCH=0",
                  "--variant", f"old=KERNELS={old},MINITF_ATTN_PITCH=0", "--out", tmp_path / "ab")
    assert r.returncode == 0, r.stderr[-3000:]
    same = json.loads((tmp_path / "ab" / "ab.json").read_text())["results"]["tiny fp16"]["same"]
    for name in ("tight", "old"):
        assert same[name]["finite"] and same[name]["grad_rel_diff"] == 0.0 and same[name]["loss_rel_diff"] == 0.0, same
    bad = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--variant", "now=", "--variant",
                    f"old=KERNELS={old}")
    assert bad.returncode == 1 and f"KERNELS={old}: that file's softmax takes rows n apart" in bad.stderr, bad.stderr


def test_gpu_ab_drops_a_variant_that_raises_in_its_timed_rounds(tmp_path, standin, monkeypatch, capsys):
    """A variant that passed the comparison and raises in a later round (its second of --smoke's three: a warm-up and
    two timed) is dropped from the mode, out of
    its "same" and "time" both, its error in "failed" on one line; the variant after it is timed against now."""
    sys.path.insert(0, ROOT)
    import bench.gpu_ab as gpu_ab
    rounds = {}
    timed_round = gpu_ab.timed_round

    def raising_in_bads_second_round(runner, steps):
        rounds[runner.name] = rounds.get(runner.name, 0) + 1
        if runner.name == "bad" and rounds["bad"] == 2:
            raise RuntimeError("boom\n  in its second round")
        return timed_round(runner, steps)
    monkeypatch.setattr(gpu_ab, "timed_round", raising_in_bads_second_round)
    gpu_ab.main(["--smoke", "--no-torch", "--modes", "fp16", "--variant", "now=", "--variant",
                 "bad=MINITF_FUSED_LNWARP=0", "--variant", "other=MINITF_FUSED_RELUSUMS=1", "--out", str(tmp_path / "ab")])
    entry = json.loads((tmp_path / "ab" / "ab.json").read_text())["results"]["tiny fp16"]
    assert entry["failed"] == {"bad": "RuntimeError: boom in its second round"}
    assert set(entry["same"]) == set(entry["time"]) == {"now", "other"} and rounds == {"now": 3, "bad": 2, "other": 3}
    assert entry["time"]["other"]["speed_vs_now"] > 0
    assert "  bad      FAILED: RuntimeError: boom in its second round" in capsys.readouterr().out


def test_gpu_ab_times_the_cuda_of_another_copy_of_the_kernels(tmp_path):
    """A variant's KERNELS=FILE runs the CUDA of FILE (another minitf/kernels.py) under minitf's launchers: a copy
    gives the same gradients to the bit, a copy whose block LayerNorm adds 0.25 to the variance other ones; a file
    whose kernels take other arguments, or none, is refused before anything runs."""
    src = Path(ROOT, "minitf", "kernels.py").read_text()
    line = "A rs = (A)1 / a_sqrt(block_sum(v, buf) / d + eps);"
    assert src.count(line) == 1
    same, off, other = tmp_path / "same.py", tmp_path / "off.py", tmp_path / "other.py"
    same.write_text(src)
    off.write_text(src.replace(line, line.replace("+ eps)", "+ eps + (A)0.25)")))
    other.write_text(src.replace("extern \"C\" __global__ void bias_relu(T* x,", "extern \"C\" __global__ void bias_relu(A* x,"))
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--rounds", "2", "--modes", "fp16",
                  "--variant", "now=", "--variant", f"same=KERNELS={same}", "--variant", f"off=KERNELS={off},MINITF_FUSED_LNWARP=0")   # the block LayerNorms
    assert r.returncode == 0, r.stderr[-3000:]
    rows = dict(re.findall(r"^  (now|same|off) +[\d.]+ ms .* grad diff (\S+)$", r.stdout, re.M))
    assert float(rows["now"]) == 0 and float(rows["same"]) == 0 and float(rows["off"]) > 1e-3, r.stdout
    bad = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--variant", "now=", "--variant",
                    f"other=KERNELS={other}")
    assert bad.returncode == 1 and f"KERNELS={other}: kernels there take other arguments than minitf's launchers " \
        "pass, or are missing (bias_relu)" in bad.stderr, bad.stderr
    gone = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--variant", f"old=KERNELS={tmp_path / 'no.py'}")
    assert gone.returncode == 1 and f"gpu_ab: KERNELS={tmp_path / 'no.py'}: no such file" in gone.stderr
    warp = tmp_path / "warp.py"      # a copy whose tensor-core attention takes a warp a block, as before blocks of 4
    assert src.count("\nMMA_WARPS = ") == 1
    warp.write_text(src.replace("\nMMA_WARPS = ", "\nATT_MMA_BLOCK = "))
    one = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--variant", "now=", "--variant",
                    f"old=KERNELS={warp},MINITF_FUSED_ATTN=1")
    assert one.returncode == 1 and f"gpu_ab: old: KERNELS={warp} with MINITF_FUSED_ATTN=1: that file's tensor-core " \
        "attention takes a warp a block" in one.stderr, one.stderr


def test_gpu_ab_refuses_an_unknown_mode_before_running_anything(tmp_path):
    r = run_bench(tmp_path, "gpu_ab.py", "--smoke", "--no-torch", "--modes", "fp16,bf61")
    assert r.returncode == 2 and "gpu_ab.py: error: --modes: unknown mode 'bf61' (float32, fp16, bf16)" in r.stderr, \
        r.stderr[-2000:]


class _Ranks:
    """MPI.COMM_WORLD as ranks whose others hold `others` (the stand-in's NCCL sums through it)."""

    def __init__(self, *others):
        self.others = others

    def allgather(self, mine):
        return [mine, *(o.astype(mine.dtype) for o in self.others)]

    def Allreduce(self, _in_place, work, op=None):
        for o in self.others:
            work += o.astype(work.dtype)


def test_bfloat16_gradients_are_summed_over_gpus_in_float32_and_float16_in_16_bits(standin):
    """NCCL sums a 16-bit buffer in 16 bits, rounding after each rank's addition (the stand-in now models that: it had
    summed in float32, so no test could see the difference). minitf sums --bf16 gradients through a float32 buffer,
    rounding once; --fp16's stay 16-bit on the wire. Three ranks holding 1, u/2 and u/2 (u: the unit after 1): 1
    added rank by rank (1 + u/2 rounds to 1), 1 + u at once."""
    import types
    import numpy
    from minitf.distributed import MPIWorld
    cp = backend.cupy
    nccl = cp.cuda.nccl
    world = object.__new__(MPIWorld)
    world._wide = None
    for dtype, kind, u in ((numpy.float16, nccl.NCCL_FLOAT16, 2.0 ** -10), (strict_cupy.BFLOAT16, None, 2.0 ** -7)):
        half = numpy.array([u / 2], dtype=dtype)
        comm = object.__new__(strict_cupy._NcclCommunicator)
        comm.comm, comm.MPI = _Ranks(half, half), types.SimpleNamespace(IN_PLACE=None, SUM=None)
        world._nccl = (nccl, comm)
        if kind is not None:   # the stand-in's NCCL on a 16-bit buffer: rounded per rank, as NCCL does
            a = cp.asarray(numpy.array([1.0], dtype=dtype))
            comm.allReduce(a.data.ptr, a.data.ptr, a.size, kind, nccl.NCCL_SUM, 0)
            assert float(backend.to_numpy(a)[0]) == 1.0
        for _ in range(2):     # (bfloat16: the float32 buffer made once, then reused)
            g = cp.asarray(numpy.array([1.0], dtype=dtype))
            world.allreduce_sum(g)
            assert g.dtype == dtype
            assert float(backend.to_numpy(g)[0]) == (1.0 if dtype == numpy.float16 else 1.0 + u)
    assert world._wide.dtype == numpy.float32
