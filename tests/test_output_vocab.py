"""An output vocabulary (config `output_vocab`, `--output-vocab target`): the output layer scores K of
the V joint pieces. The loss is the label-smoothed loss over those K columns of the joint model's
logits, decoding never emits another piece, and a training run takes the target side's pieces."""
import json

import numpy as np
import pytest

import minitf
from minitf.checkpoint import load_checkpoint
from minitf.config import id_ranges, parse_id_ranges
from minitf.data.tokenizer import Tokenizer
from minitf.decode import beam_search, greedy_search
from minitf.architectures import build_model
from minitf.errors import ConfigError
from minitf.loss import label_smoothed_nll

from test_train import corpus, run_train   # noqa: F401 (the module's corpus fixture)

V = 13
IDS = np.array([1, 3, 4, 5, 7, 8, 11])          # UNK 1 and EOS 3 among them


def cfg(**kw):
    return minitf.Config(**{**dict(vocab_size=V, d_model=8, n_heads=2, d_ff=12, n_layers=1, dropout=0.0,
                                              label_smoothing=0.1, max_len=16), **kw})


def batch():
    src = np.array([[5, 6, 7, 9, 3], [9, 10, 5, 3, 0]])
    tgt_in = np.array([[2, 4, 6, 8], [2, 7, 11, 0]])   # 6 is outside IDS
    tgt_out = np.array([[4, 6, 8, 3], [7, 11, 3, 0]])
    return src, tgt_in, tgt_out


def pair(**kw):
    """A joint model and the same weights with the output vocabulary IDS."""
    joint = minitf.Transformer(cfg(**kw), dtype="float64", seed=4)
    restricted = minitf.Transformer(cfg(output_vocab=id_ranges(IDS), **kw), dtype="float64", seed=4)
    restricted.load_state_dict(joint.state_dict())
    return joint, restricted


def test_id_ranges_round_trip_and_bad_values_are_config_errors():
    ids = [1, 3, 4, 5, 9, 10, 12]
    assert id_ranges(ids) == "1,3-5,9-10,12"
    assert parse_id_ranges("1,3-5,9-10,12", 13).tolist() == ids
    for bad in ("", "3-1", "1,1", "4,2", "1-13", "-1", "x", "1-"):
        with pytest.raises(ConfigError, match="output_vocab"):
            parse_id_ranges(bad, 13)
    with pytest.raises(ConfigError, match="must hold eos_id"):
        cfg(output_vocab="1,4-5")
    with pytest.raises(ConfigError, match="must hold unk_id"):
        cfg(output_vocab="3-5")
    with pytest.raises(ConfigError, match="bpe_dropout_target"):
        cfg(output_vocab="1,3", bpe_dropout_target=0.1)


def test_the_loss_is_the_joint_models_logits_over_the_output_columns():
    """loss(restricted) = label-smoothed loss of the joint model's logits[..., IDS], a reference piece
    outside IDS (6) scored as UNK's column; the restricted forward's logits are the joint ones on IDS
    and -inf elsewhere."""
    joint, restricted = pair()
    src, tgt_in, tgt_out = batch()
    full = joint.forward(src, tgt_in)                                          # [B, T, V]
    columns = np.full(V, np.searchsorted(IDS, 1))
    columns[IDS] = np.arange(IDS.size)
    gold = np.where(tgt_out == 0, -1, columns[tgt_out])
    expected = float(label_smoothed_nll(full[..., IDS], gold, 0.1, -1)[0])
    assert restricted.forward_loss(src, tgt_in, tgt_out) == pytest.approx(expected, rel=1e-12)
    assert restricted.forward_loss(src, tgt_in, tgt_out, packed=False) == pytest.approx(expected, rel=1e-12)
    assert restricted.last_stats["n_tokens"] == 7
    logits = restricted.forward(src, tgt_in)
    np.testing.assert_allclose(logits[..., IDS], full[..., IDS], rtol=1e-12)
    assert np.isneginf(np.delete(logits, IDS, axis=-1)).all()
    # without the restriction the loss differs (it also scores the 6 other pieces)
    assert joint.forward_loss(src, tgt_in, tgt_out) != pytest.approx(expected, rel=1e-3)


def test_gradients_reach_only_the_output_rows_through_the_projection():
    """With no input using them, the rows outside IDS get no gradient at all; the others do."""
    _, restricted = pair()
    src = np.array([[5, 7, 3]])
    tgt_in, tgt_out = np.array([[2, 4, 8]]), np.array([[4, 8, 3]])
    restricted.zero_grad()
    restricted.forward_loss(src, tgt_in, tgt_out)
    restricted.backward()
    d = restricted.grad_dict()["embedding.weight"]
    unused = np.setdiff1d(np.arange(V), np.concatenate([IDS, [2]]))              # 2: BOS, an input
    assert np.all(d[unused] == 0) and np.abs(d[IDS]).sum(axis=1).min() > 0


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_decoding_emits_only_output_pieces_and_the_cache_gives_the_forwards_logits(arch):
    model = build_model(cfg(arch=arch, output_vocab=id_ranges(IDS)), dtype="float64", seed=5)
    # push the pieces outside IDS up: a joint output would emit them
    w = model.state_dict()["embedding.weight"]
    outside = np.setdiff1d(np.arange(V), IDS)
    w[outside] *= 50
    src = np.array([[5, 6, 7, 9, 3], [9, 10, 5, 3, 0]])
    hyps = greedy_search(model, src, max_len_a=0, max_len_b=6) + beam_search(model, src, 3, max_len_a=0, max_len_b=6)
    assert sum(map(len, hyps)) > 4
    for hyp in hyps:
        assert set(hyp) <= set(IDS.tolist()), hyp
    dec = model.incremental_decoder(src, 4)
    tokens = np.array([2, 2])
    step = dec.logits(tokens)
    full = model.forward(src, tokens[:, None])[:, 0]
    np.testing.assert_allclose(step, full, rtol=1e-9)
    assert np.isneginf(step[:, outside]).all()


def test_checkpoint_and_average_keep_the_output_vocabulary(tmp_path):
    model = minitf.Transformer(cfg(output_vocab=id_ranges(IDS)), seed=1)
    from minitf.checkpoint import average_checkpoints, save_checkpoint
    for i in range(2):
        save_checkpoint(tmp_path / f"c{i}.npz", model)
    average_checkpoints([tmp_path / "c0.npz", tmp_path / "c1.npz"], tmp_path / "avg.npz")
    back = load_checkpoint(tmp_path / "avg.npz")
    assert back.config.output_ids().tolist() == IDS.tolist()
    assert back.build_model().embedding.output_ids.tolist() == IDS.tolist()
    other = minitf.Transformer(cfg(), seed=1)
    save_checkpoint(tmp_path / "joint.npz", other)
    with pytest.raises(minitf.errors.CheckpointError, match="output_vocab") as e:
        average_checkpoints([tmp_path / "c0.npz", tmp_path / "joint.npz"], tmp_path / "bad.npz")
    for name, ids in (("few.npz", IDS), ("many.npz", np.arange(1, 120, 2))):   # many: 60 ids, 60 runs
        save_checkpoint(tmp_path / name, minitf.Transformer(cfg(vocab_size=120, output_vocab=id_ranges(ids)), seed=1))
    with pytest.raises(minitf.errors.CheckpointError, match="output_vocab") as e:
        average_checkpoints([tmp_path / "few.npz", tmp_path / "many.npz"], tmp_path / "bad.npz")
    assert str(e.value).endswith(f"output_vocab <60 pieces: 1,3,5,7,...> vs {id_ranges(IDS)}") and len(str(e.value)) < 300


def test_one_output_vocabulary_has_one_spelling_in_averages_and_resumes(tmp_path):
    """"1,3,4,5,7,8" (how an older import wrote it) and "1,3-5,7-8" are one vocabulary: the config spells it the
    second way, an average takes both, and a run whose config.json has the first resumes from a checkpoint."""
    from minitf.checkpoint import average_checkpoints, save_checkpoint
    from minitf.runfolder import check_resumed
    assert cfg(output_vocab="1,3,4,5,7,8").output_vocab == "1,3-5,7-8" == id_ranges([1, 3, 4, 5, 7, 8])
    model = minitf.Transformer(cfg(output_vocab="1,3-5,7-8"), seed=1)
    save_checkpoint(tmp_path / "checkpoint_0000001.npz", model, train_state={"step": 1})
    save_checkpoint(tmp_path / "spelled.npz", minitf.Transformer(cfg(output_vocab="1,3,4,5,7,8"), seed=2))
    average_checkpoints([tmp_path / "checkpoint_0000001.npz", tmp_path / "spelled.npz"], tmp_path / "avg.npz")
    ckpt = load_checkpoint(tmp_path / "checkpoint_0000001.npz")
    for spelled, same in (("1,3,4,5,7,8", True), ("1,3,4,5,7", False)):
        (tmp_path / "config.json").write_text(json.dumps({"model": dict(model.cfg.to_dict(), output_vocab=spelled), "args": {}}))
        if same:
            check_resumed(str(tmp_path), ckpt)
        else:
            with pytest.raises(ConfigError, match="output_vocab '1,3-5,7' in config.json, '1,3-5,7-8' in the"):
                check_resumed(str(tmp_path), ckpt)


def test_training_with_output_vocab_target(corpus, tmp_path):   # noqa: F811
    """The run's output vocabulary is the target side's pieces with UNK and EOS; it trains, scores,
    resumes with it, and refuses a resume that asks for the joint one."""
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 4, "--output-vocab", "target", "--valid-every", 2, "--save-every", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = load_checkpoint(out / "checkpoint_0000004.npz")
    ids = ckpt.config.output_ids()
    tok = Tokenizer.from_bytes(ckpt.tokenizer)
    import gzip
    with gzip.open(corpus / "train.de.gz", "rt") as f:
        pieces = {i for ids in tok.encode([line.strip() for line in f]) for i in ids}
    assert set(ids.tolist()) == pieces | {1, 3} and ids.size < tok.vocab_size
    assert json.loads((out / "config.json").read_text())["model"]["output_vocab"] == ckpt.config.output_vocab
    assert f"output layer over {ids.size:,} of the {tok.vocab_size:,} pieces" in r.stderr
    res = json.loads((out / "results.json").read_text())
    assert 0 <= res["bleu"]["valid"] <= 100
    r = run_train(corpus, out, "--max-steps", 5, "--resume", "--output-vocab", "joint", "--valid-every", 0)
    assert r.returncode == 2 and "--output-vocab joint: the checkpoint" in r.stderr and "Traceback" not in r.stderr
    r = run_train(corpus, out, "--max-steps", 6, "--resume", "--valid-every", 0, "--save-every", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_checkpoint(out / "checkpoint_0000006.npz").config.output_vocab == ckpt.config.output_vocab
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--output-vocab", "target", "--bpe-dropout-target", 0.1)
    assert r.returncode == 2 and "use one or the other" in r.stderr


def test_the_output_layer_comes_from_the_flag_or_else_the_preset(monkeypatch, tmp_path):
    """build_config: --output-vocab, else the preset's output_layer; "target" fills output_vocab from the
    data; a preset's "target" gives way to --bpe-dropout-target (with a note), an explicit one cannot."""
    from minitf.config import PRESETS
    from minitf.recipe import build_config
    from minitf.train_cli import parse_args
    pieces = lambda both: "1,3-9"                                             # noqa: E731
    base = ["--dataset", "multi30k", "--data-dir", str(tmp_path), "--preset", "tiny", "--out", str(tmp_path / "o")]
    c = build_config(parse_args(base), V, pieces)
    assert (c.output_layer, c.output_vocab) == ("joint", None)
    c = build_config(parse_args(base + ["--output-vocab", "target"]), V, pieces)
    assert (c.output_layer, c.output_vocab) == ("target", "1,3-9")
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "output_layer": "target"})
    c = build_config(parse_args(base), V, pieces)
    assert (c.output_layer, c.output_vocab) == ("target", "1,3-9")
    c = build_config(parse_args(base + ["--output-vocab", "joint"]), V, pieces)
    assert (c.output_layer, c.output_vocab) == ("joint", None)
    notes = []
    c = build_config(parse_args(base + ["--bpe-dropout-target", "0.1", "--subword", "bpe"]), V, pieces, note=notes.append)
    assert (c.output_layer, c.output_vocab, c.bpe_dropout_target) == ("joint", None, 0.1)
    assert len(notes) == 1 and "--output-vocab joint" in notes[0]
    with pytest.raises(SystemExit):
        parse_args(base + ["--bpe-dropout-target", "0.1", "--output-vocab", "target"])


def test_scoring_a_piece_outside_the_output_vocabulary_scores_the_unknown_piece():
    from minitf.translate import score_ids
    _, restricted = pair()
    src = [[5, 6, 7, 9, 3]]
    outside, unk = 6, 1
    assert outside not in IDS and unk in IDS
    (as_unk,) = score_ids(restricted, src, [[4, unk, 8]])
    (mine,) = score_ids(restricted, src, [[4, outside, 8]])
    assert np.isfinite(mine).all() and mine[1] == as_unk[1]
    assert mine[2] != as_unk[2]   # the next position reads the piece itself as its input


def test_init_from_a_model_with_an_output_vocabulary_widens_it_to_the_new_corpus(corpus, tmp_path):   # noqa: F811
    """--init-from a model whose output layer scores its training targets' pieces: the new run's scores those and
    the new corpus's targets' (with --bidirectional-epochs its sources' too); --bpe-dropout-target is refused."""
    import os
    import subprocess
    import sys
    from test_train import ROOT
    first = tmp_path / "first"
    r = run_train(corpus, first, "--max-steps", 2, "--output-vocab", "target", "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-2000:]
    source = load_checkpoint(first / "model.npz")
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"))

    def fine_tune(out, *extra):
        return subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k",
                               "--data-dir", str(corpus), "--preset", "tiny", "--device", "cpu", "--init-from",
                               str(first / "model.npz"), "--out", str(out), "--quiet", "--valid-every", "0", "--beam",
                               "1", "--max-steps", "1", *map(str, extra)], capture_output=True, text=True, env=env,
                              timeout=600)
    tok = Tokenizer.from_bytes(source.tokenizer)
    import gzip
    with gzip.open(corpus / "train.en.gz", "rt") as f:
        source_side = {i for ids in tok.encode([line.strip() for line in f]) for i in ids}
    same = fine_tune(tmp_path / "same")
    assert same.returncode == 0, same.stderr[-2000:]
    assert load_checkpoint(tmp_path / "same" / "model.npz").config.output_vocab == source.config.output_vocab
    both = fine_tune(tmp_path / "both", "--bidirectional-epochs", 1)
    assert both.returncode == 0, both.stderr[-2000:]
    ids = set(load_checkpoint(tmp_path / "both" / "model.npz").config.output_ids().tolist())
    assert ids == set(source.config.output_ids().tolist()) | source_side and not source_side <= set(
        source.config.output_ids().tolist())
    bad = fine_tune(tmp_path / "bad", "--bpe-dropout-target", 0.1)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error")]
    assert bad.returncode == 2 and len(errors) == 1 and "--init-from" in errors[0] and "use one or the other" in errors[0]
