"""The plain reference (minitf/reference.py) and the engine (minitf.Transformer, minitf.Adam)
compute the same training step: loss, logits and every parameter gradient in float64 to
1e-10, both positional kinds, padding on both sides, dropout off and on (the reference gets
the engine's masks through its mask_fn), the engine's packed default and its plain path;
and the same parameters after Adam steps with the warmup schedule; then over random
configurations (heads, widths, d_k, pad id, label smoothing, eps, depths) and batches."""
import numpy as np
import pytest

import minitf
from minitf import reference as ref
from minitf.functional import DropoutSites, dropout_mask

TOL = 1e-10


def config(positional="sinusoidal", dropout=0.0, n_layers=2, n_decoder_layers=None):
    return minitf.Config(vocab_size=17, d_model=16, n_heads=2, d_ff=24, n_layers=n_layers,
                                    n_decoder_layers=n_decoder_layers, dropout=dropout, label_smoothing=0.1,
                                    positional=positional, max_len=12)


def batch():
    """Padding in the source and the target (tgt_in = BOS + target, tgt_out = target + EOS),
    repeated tokens (the embedding's scatter-add), one source without padding."""
    src = np.array([[5, 6, 7, 5, 3, 0, 0], [9, 10, 11, 12, 13, 14, 3], [8, 3, 0, 0, 0, 0, 0]])
    tgt_in = np.array([[2, 4, 6, 4, 0], [2, 7, 8, 9, 16], [2, 15, 0, 0, 0]])
    tgt_out = np.array([[4, 6, 4, 3, 0], [7, 8, 9, 16, 3], [15, 3, 0, 0, 0]])
    return src, tgt_in, tgt_out


def engine_masks(cfg, seed, forward_index):
    """The engine's dropout masks of training forward `forward_index` as the reference's
    mask_fn (None without dropout), and the stream (its `site` counts the sites drawn)."""
    if cfg.dropout == 0.0:
        return None, None
    stream = DropoutSites(seed, forward_index)

    def mask_fn(site, shape):
        assert site == stream.site, f"the reference asked for site {site}, the engine's next is {stream.site}"
        return dropout_mask(stream, shape, cfg.dropout, np.float64)
    return mask_fn, stream


def reference_step(cfg, params, forward_index, seed):
    mask_fn, stream = engine_masks(cfg, seed, forward_index)
    loss, logits, cache = ref.forward(params, *batch(), cfg.n_heads, mask_fn, cfg.label_smoothing, cfg.pad_id,
                                      cfg.layer_norm_eps)
    if stream is not None:
        # every site of the engine's forward, in its order: 2 embeddings, 2 per encoder and 3 per decoder layer
        assert stream.site == 2 + 2 * cfg.n_layers + 3 * cfg.n_decoder_layers
    return loss, logits, ref.backward(params, cache)


def rel_err(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)


def assert_same_grads(got, want):
    assert list(got) == list(want)
    total = np.sqrt(sum(np.linalg.norm(g) ** 2 for g in want.values()))
    for name in want:
        a, b = got[name], want[name]
        if name.endswith(".k.bias"):   # 0 up to round-off in both: softmax ignores a shift of its row
            assert max(np.linalg.norm(a), np.linalg.norm(b)) < 1e-13 * total, name
            continue
        assert rel_err(a, b) <= TOL, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("stacks", [(2, None), (2, 1), (1, 3)])
def test_init_params_names_and_shapes_are_the_engines(stacks):
    for positional in ("sinusoidal", "learned"):
        cfg = config(positional, n_layers=stacks[0], n_decoder_layers=stacks[1])
        model = minitf.Transformer(cfg, dtype="float64")
        params = ref.init_params(cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_layers, np.random.default_rng(0),
                                 cfg.max_len if positional == "learned" else None, stacks[1])
        assert [(n, p.shape) for n, p in params.items()] == [(n, p.shape) for n, p in model.state_dict().items()]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_the_reference_gives_the_engines_loss_logits_and_every_gradient(positional, dropout, packed):
    cfg = config(positional, dropout)
    model = minitf.Transformer(cfg, dtype="float64", seed=4)
    params = {n: p.copy() for n, p in model.state_dict().items()}
    model.zero_grad()
    loss = model.forward_loss(*batch(), packed=packed)   # training forward 0
    model.backward()
    model.forward_count = 0                                # forward 0's masks again, on the padded path
    logits = model.forward(*batch()[:2])
    ref_loss, ref_logits, ref_grads = reference_step(cfg, params, 0, model.seed)
    assert abs(ref_loss - loss) <= TOL * abs(loss)
    assert rel_err(ref_logits, logits) <= TOL
    assert_same_grads(ref_grads, {n: g.copy() for n, g in model.grad_dict().items()})
    if dropout:   # the masks matter: without them the loss is another
        assert abs(ref.forward(params, *batch(), cfg.n_heads)[0] - loss) > 1e-3


@pytest.mark.parametrize("stacks", [(2, 1), (1, 3)])
def test_stacks_of_different_depths_give_the_engines_step(stacks):
    """n_decoder_layers: the reference counts each stack's layers in the parameters."""
    cfg = config(dropout=0.3, n_layers=stacks[0], n_decoder_layers=stacks[1])
    model = minitf.Transformer(cfg, dtype="float64", seed=5)
    params = {n: p.copy() for n, p in model.state_dict().items()}
    assert (ref.n_layers(params, "encoder"), ref.n_layers(params, "decoder")) == stacks
    model.zero_grad()
    loss = model.forward_loss(*batch())
    model.backward()
    ref_loss, _, ref_grads = reference_step(cfg, params, 0, model.seed)
    assert abs(ref_loss - loss) <= TOL * abs(loss)
    assert_same_grads(ref_grads, {n: g.copy() for n, g in model.grad_dict().items()})


def test_the_tied_embedding_collects_three_shares():
    """d embedding.weight = the output projection's share + the lookups' shares: a row no
    lookup reaches with a gradient (a token not in the batch; the pad token, whose positions
    no other position reads) has the projection's share alone; the BOS row (every tgt_in
    starts with it) and the rows of tokens only in the source or only in the target have more."""
    cfg = config()
    model = minitf.Transformer(cfg, dtype="float64", seed=1)
    params = {n: p.copy() for n, p in model.state_dict().items()}
    src, tgt_in, tgt_out = batch()
    _, _, cache = ref.forward(params, src, tgt_in, tgt_out, cfg.n_heads)
    full = ref.backward(params, cache)["embedding.weight"]
    dlogits = ref.label_smoothed_loss_backward(cache["loss"])
    projection = dlogits.reshape(-1, cfg.vocab_size).T @ cache["h"].reshape(-1, cfg.d_model)
    lookups = np.linalg.norm(full - projection, axis=1) / np.linalg.norm(full)    # per row of [V, D]
    unused = np.setdiff1d(np.arange(cfg.vocab_size), np.r_[src.ravel(), tgt_in.ravel()])
    only_src, only_tgt = np.setdiff1d(src, tgt_in), np.setdiff1d(tgt_in, src)
    assert unused.size and only_src.size and cfg.bos_id in only_tgt
    assert lookups[np.r_[unused, cfg.pad_id]].max() < 1e-12
    assert lookups[np.r_[only_src, only_tgt]].min() > 1e-4


@pytest.mark.parametrize("positional, weight_decay", [("sinusoidal", 0.0), ("learned", 0.0), ("sinusoidal", 0.1)])
def test_adam_steps_with_the_schedule_give_the_engines_parameters(positional, weight_decay):
    cfg = config(positional, dropout=0.3)
    model = minitf.Transformer(cfg, dtype="float64", seed=2)
    params = {n: p.copy() for n, p in model.state_dict().items()}
    warmup, factor = 3, 2.0
    opt = minitf.Adam(model, lr=minitf.NoamSchedule(cfg.d_model, warmup, factor), weight_decay=weight_decay)
    state = ref.adam_state(params)
    for step in range(3):
        model.zero_grad()
        loss = model.forward_loss(*batch())
        model.backward()
        lr = opt.step()
        mask_fn, _ = engine_masks(cfg, model.seed, step)
        params, ref_loss = ref.train_step(params, state, *batch(), cfg.n_heads, warmup, factor, mask_fn, weight_decay,
                                          label_smoothing=cfg.label_smoothing, pad_id=cfg.pad_id,
                                          ln_eps=cfg.layer_norm_eps)
        assert lr == ref.noam(step + 1, cfg.d_model, warmup, factor)
        assert abs(ref_loss - loss) <= TOL * abs(loss)
        for name, p in model.state_dict().items():
            if name.endswith(".k.bias"):
                # the key bias's gradient is round-off (softmax ignores a shift of its row), so
                # Adam moves it by about lr * 1e-8 in each: equal to that, not relatively
                assert np.abs(params[name] - p).max() <= 1e-6 * lr
                continue
            assert rel_err(params[name], p) <= TOL, f"step {step + 1}, {name}: {rel_err(params[name], p):.2e}"


def test_the_reference_schedule_is_the_engines_rate_in_warmup_and_in_decay():
    """reference.noam against schedule.learning_rate, the one function training, `plot lr` and the docs
    use: both branches of eq. 3 (the Adam test above stays inside warmup), the peak, and a factor;
    a t^-0.4 decay in either would fail here."""
    from minitf.schedule import learning_rate
    for step in (1, 2, 100, 3999, 4000, 4001, 10_000, 100_000):
        for factor in (1.0, 2.0):
            assert ref.noam(step, 512, 4000, factor) == learning_rate(step, 512, 4000, factor)
    assert learning_rate(16_000, 512, 4000) == pytest.approx(learning_rate(4000, 512, 4000) / 2)   # sqrt(w / t)
    assert learning_rate(10, 512, 4000, 1.0, 0.5, 0.75) == pytest.approx(learning_rate(10, 512, 4000) / 2)   # fade


def random_batch(rng, cfg):
    """2-3 sentences of random lengths and pieces (none special), each source with one piece at least, padded at
    the end with cfg.pad_id; tgt_in = BOS + target, tgt_out = target + EOS."""
    specials = {cfg.pad_id, cfg.bos_id, cfg.eos_id, cfg.unk_id}
    pieces = np.array([i for i in range(cfg.vocab_size) if i not in specials])
    b = int(rng.integers(2, 4))
    src_lens, tgt_lens = rng.integers(1, 7, size=b), rng.integers(1, 6, size=b)
    src = np.full((b, src_lens.max()), cfg.pad_id)
    tgt_in = np.full((b, tgt_lens.max() + 1), cfg.pad_id)
    tgt_out = tgt_in.copy()
    for i in range(b):
        src[i, :src_lens[i]] = rng.choice(pieces, src_lens[i])
        words = rng.choice(pieces, tgt_lens[i])
        tgt_in[i, :tgt_lens[i] + 1] = np.r_[cfg.bos_id, words]
        tgt_out[i, :tgt_lens[i] + 1] = np.r_[words, cfg.eos_id]
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("seed", range(10))
def test_the_reference_gives_the_engines_step_over_random_configurations(seed):
    """Beyond the fixed batch above: random head counts (1 to 4), widths, a d_k set apart from D / H (Table 3 row
    (B)), a pad id other than 0, label smoothing 0 to 0.3, the LayerNorm's eps, both positions, dropout, stack depths,
    packed or padded, on random batches. Gradients are compared against the whole gradient's norm (a tensor that is
    round-off in both, as the key biases are, has no relative error worth the name)."""
    rng = np.random.default_rng(seed)
    h, d = (1, 2, 4)[seed % 3], (8, 12, 16)[seed % 3 - 1]      # every head count, with each width but one
    d_k = None if seed % 4 < 2 else int(rng.integers(1, 6))     # d_k set apart in 2 of 4
    cfg = minitf.Config(vocab_size=19, d_model=d, n_heads=h, d_k=d_k, d_ff=int(rng.choice([8, 24])),
                        n_layers=int(rng.integers(1, 3)), n_decoder_layers=int(rng.integers(1, 3)),
                        dropout=(0.0, 0.3)[seed // 2 % 2], label_smoothing=(0.0, 0.1, 0.3)[seed % 3 - 2],
                        layer_norm_eps=float(rng.choice([1e-6, 1e-5, 0.1])), pad_id=(0, 4)[seed // 4 % 2],
                        positional=("sinusoidal", "learned")[seed % 2], max_len=12)
    model = minitf.Transformer(cfg, dtype="float64", seed=seed)
    params = {n: p + rng.normal(0, 0.05, p.shape) for n, p in model.state_dict().items()}   # biases and gains not 0, 1
    model.load_state_dict(params)
    src, tgt_in, tgt_out = random_batch(rng, cfg)
    model.zero_grad()
    loss = model.forward_loss(src, tgt_in, tgt_out, packed=bool(rng.random() < 0.5))
    model.backward()
    model.forward_count = 0
    logits = model.forward(src, tgt_in)
    mask_fn, _ = engine_masks(cfg, model.seed, 0)
    ref_loss, ref_logits, cache = ref.forward(params, src, tgt_in, tgt_out, cfg.n_heads, mask_fn,
                                              cfg.label_smoothing, cfg.pad_id, cfg.layer_norm_eps)
    ref_grads = ref.backward(params, cache)
    grads = model.grad_dict()
    assert abs(ref_loss - loss) <= 1e-12 * abs(loss)
    assert rel_err(ref_logits, logits) <= 1e-12
    total = np.sqrt(sum(np.linalg.norm(g) ** 2 for g in ref_grads.values()))
    assert list(ref_grads) == list(grads)
    for name, g in ref_grads.items():
        assert np.linalg.norm(g - grads[name]) <= 1e-12 * total, f"{name}: {np.linalg.norm(g - grads[name]):.2e}"


def test_the_references_sinusoids_written_position_by_position_are_the_engines_table():
    """The positions have no gradient, so no gradient check reaches a wrong table: the reference writes 3.5's formula
    one position and feature at a time (it had been the engine's array code, copied), the engine with arrays; odd
    widths and positions past any max_len included."""
    from minitf.layers.positional import sinusoid_table
    for length, d in ((50, 16), (7, 9), (300, 64), (1, 2)):
        np.testing.assert_allclose(ref.sinusoids(length, d), sinusoid_table(length, d), rtol=0, atol=1e-15)
    pe = ref.sinusoids(3, 4)
    assert pe[2, 0] == np.sin(2.0) and pe[2, 1] == np.cos(2.0) and pe[2, 2] == np.sin(2.0 / 100.0)   # 10000^(2/4)
