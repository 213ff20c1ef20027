"""minitf.viz: the numbers behind the pictures (no matplotlib needed) and `python -m minitf plot`."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny_checkpoint

from minitf import viz
from minitf.cli import main
from minitf.errors import ConfigError, DataError, MinitfError
from minitf.layers.positional import sinusoid_table
from minitf.schedule import noam

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def needs_matplotlib():
    pytest.importorskip("matplotlib", reason="matplotlib (the viz extra) is needed to write pictures")


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert 1000 < len(data) < 500_000, f"{path} has {len(data)} bytes"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minitf", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


# ------------------------------------------------------------------------------ positional encoding
@pytest.mark.parametrize("n,d", [(10, 10), (100, 128), (50, 512), (7, 2)])
def test_every_position_has_norm_sqrt_d_over_2(n, d):
    norms = viz.pe_norms(sinusoid_table(n, d))
    assert norms.shape == (n,)
    np.testing.assert_allclose(norms, math.sqrt(d / 2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,d", [(10, 10), (100, 128)])
def test_distance_depends_only_on_the_offset(n, d):
    t = sinusoid_table(n, d)
    base = viz.pe_distance_by_offset(t)
    assert base.shape == (n,) and base[0] == 0.0
    for p in range(1, n):
        np.testing.assert_allclose(viz.pe_distance_by_offset(t, p), base[: n - p], rtol=0, atol=1e-12)
    # closed form: ||PE(p) - PE(p+k)||^2 = 4 sum_i sin^2(k w_i / 2), w_i = 10000^(-2i/d)
    w = 10000.0 ** (-np.arange(0, d, 2) / d)
    k = np.arange(n)[:, None]
    np.testing.assert_allclose(base, np.sqrt(4 * (np.sin(k * w / 2) ** 2).sum(axis=1)), rtol=0, atol=1e-12)
    m = viz.pe_distance_matrix(t)   # symmetric Toeplitz: entry (p, q) depends on |p - q| only
    for p in range(n):
        np.testing.assert_allclose(m[p], base[np.abs(np.arange(n) - p)], rtol=0, atol=1e-6)


def test_distance_by_offset_for_10_positions_d_10_is_not_monotonic():
    """What is actually true at n = 10, d = 10: the distance grows over offsets 0..3 only, then
    falls, and offset 6 is closer than offset 1 (sin(pos), cos(pos) repeat every 2*pi = 6.28)."""
    by_k = viz.pe_distance_by_offset(sinusoid_table(10, 10))
    np.testing.assert_allclose(by_k, [0.0, 0.9722, 1.7130, 2.0513, 1.9252, 1.4299, 0.9701, 1.2781, 1.9328, 2.3636],
                               atol=5e-5)
    steps = np.diff(by_k)
    assert (steps[:3] > 0).all()                 # 0 < d(1) < d(2) < d(3)
    assert (steps[3:6] < 0).all()                # d(3) > d(4) > d(5) > d(6)
    assert (steps[6:] > 0).all()                 # d(6) < d(7) < d(8) < d(9)
    assert by_k[6] < by_k[1]                     # near-alias of the fastest sinusoid
    assert by_k.argmax() == 9


def test_pe_report_prints_norms_and_distances():
    text = viz.pe_report(10, 10)
    assert "sqrt(d/2) = 2.2361" in text
    rows = [line for line in text.splitlines() if line[:3].strip().isdigit() and "2.2361" in line]
    assert len(rows) == 10
    assert "0.9722" in text and "2.3636" in text and "not monotonic" in text
    with pytest.raises(ConfigError):
        viz.pe_report(10, 9)                     # odd d: the pairs do not close


# ------------------------------------------------------------------------------ schedule
def test_noam_curve_peaks_at_warmup():
    s, lr = viz.noam_curve(512, 4000, steps=100_000)
    assert s[lr.argmax()] == 4000 and 4000 in s
    assert lr.max() == pytest.approx(512 ** -0.5 * 4000 ** -0.5, rel=1e-12)
    assert lr.max() == noam(4000, 512, 4000)
    assert s[0] == 1 and s[-1] == 100_000 and (np.diff(s) > 0).all()


# ------------------------------------------------------------------------------ training log
LOG = [
    {"step": 50, "epoch": 0.38, "loss": 7.1, "nll": 6.9, "ppl": 990.2, "lr": 1e-4, "tokens_per_s": 1800.0,
     "wall_s": 30.1},
    {"step": 60, "event": "nonfinite_loss_skipped", "count": 1},
    {"step": 100, "epoch": 0.76, "loss": 5.0, "nll": 4.8, "ppl": 121.5, "lr": 2e-4, "tokens_per_s": 1810.0,
     "wall_s": 60.0},
    {"step": 100, "valid_loss": 4.1, "valid_nll": 3.9, "valid_ppl": 49.4, "valid_bleu": 12.5, "valid_bleu_sentences": 500},
    {"step": 150, "epoch": 1.1, "loss": 4.0, "nll": 3.8, "ppl": 44.7, "lr": 3e-4, "tokens_per_s": 1790.0,
     "wall_s": 90.0},
    {"step": 150, "eval": "valid", "model": "last", "bleu": 30.1, "chrf": 55.0, "decode_s": 20.0},
    {"step": 150, "eval": "test_2016_flickr", "model": "last", "bleu": 31.5, "chrf": 57.2, "decode_s": 19.0},
]


def write_log(path, records, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(extra_lines))
    return path


def test_read_train_log_series_and_ignored_lines(tmp_path):
    log = write_log(tmp_path / "train_log.jsonl", LOG, ["\n"])
    d = viz.read_train_log(log)
    assert d["skipped"] == 0
    steps, loss = d["train"]["loss"]
    assert steps.tolist() == [50, 100, 150] and loss.tolist() == [7.1, 5.0, 4.0]   # the event line is ignored
    assert d["train"]["lr"][1].tolist() == [1e-4, 2e-4, 3e-4]
    assert d["valid"]["valid_ppl"][0].tolist() == [100] and d["valid"]["valid_ppl"][1].tolist() == [49.4]
    assert d["eval"] == {"valid": {"step": [150], "bleu": [30.1], "chrf": [55.0], "model": "last"},
                         "test_2016_flickr": {"step": [150], "bleu": [31.5], "chrf": [57.2], "model": "last"}}
    assert d["valid"]["valid_bleu"][1].tolist() == [12.5] and d["valid_bleu_sentences"] == 500
    # the BLEU panel says what was scored, as results.json does: here the last checkpoint, not the average
    assert viz.bleu_title(d) == ("sacreBLEU / chrF: validation during training (greedy, 500 sentences)\nand at the "
                                 "end (beam search, the last checkpoint)")
    averaged = viz.read_train_log(write_log(tmp_path / "avg.jsonl", [dict(r, model="averaged") if "eval" in r else r
                                                                     for r in LOG if "valid_bleu" not in r]))
    assert viz.bleu_title(averaged) == "sacreBLEU / chrF: at the end (beam search, the averaged checkpoints)"
    assert viz.read_train_log(tmp_path)["train"]["loss"][0].tolist() == [50, 100, 150]   # a run folder works too


def test_read_train_log_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    again = dict(LOG[2], loss=4.9)                       # step 100 logged again after a resume
    log = write_log(tmp_path / "log.jsonl", [LOG[0], LOG[2], LOG[4], again])
    steps, loss = viz.read_train_log(log)["train"]["loss"]
    assert steps.tolist() == [50, 100, 150] and loss.tolist() == [7.1, 4.9, 4.0]


def test_read_train_log_skips_a_truncated_line(tmp_path):
    log = write_log(tmp_path / "log.jsonl", LOG[:3], ['{"step": 120, "loss": 4.', "\n"] + [json.dumps(LOG[4]) + "\n"])
    d = viz.read_train_log(log)
    assert d["skipped"] == 1 and d["first_bad_line"] == 4
    assert d["train"]["loss"][0].tolist() == [50, 100, 150]


@pytest.mark.parametrize("content,words", [(None, "not found"), ("", "empty"), ("\n\n", "empty"),
                                           ("not json at all\n\x00\x01garbage\n", "no training"),
                                           ('{"step": 5, "event": "x"}\n[1, 2]\n', "no training")])
def test_read_train_log_errors_name_the_file(tmp_path, content, words):
    path = tmp_path / "train_log.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=words) as e:
        viz.read_train_log(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_log_is_a_one_line_error_with_exit_2(tmp_path):
    for log in (tmp_path / "missing.jsonl", write_log(tmp_path / "garbled.jsonl", [], ["}{ not json\n"])):
        out = run_cli("plot", "curves", "--log", log, "--out", tmp_path / "c.png")
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and log.name in out.stderr and "Traceback" not in out.stderr
        assert not (tmp_path / "c.png").exists()


def test_out_must_be_a_picture_file_in_a_folder_that_exists(tmp_path):
    with pytest.raises(ConfigError, match=r"\.png"):
        viz.plot_lr(tmp_path / "lr.txt")
    with pytest.raises(ConfigError, match="the folder .*typo does not exist; create it first"):
        viz.plot_lr(tmp_path / "typo" / "lr.png")             # not made: a mistyped folder stays a mistake
    assert not (tmp_path / "typo").exists()
    (tmp_path / "file").write_text("")                        # under a file: said so (it had said "does not exist")
    with pytest.raises(ConfigError, match=r"file/lr\.png: .*file is a file, not a folder; fix the path$"):
        viz.plot_lr(tmp_path / "file" / "lr.png")
    (tmp_path / "lr.png").mkdir()
    with pytest.raises(ConfigError, match="is a folder; name the file to write"):
        viz.plot_lr(tmp_path / "lr.png")


# ------------------------------------------------------------------------------ attention
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("viz"), n_layers=2)[0]


def test_attention_maps_are_distributions_with_the_right_masks(ckpt):
    from minitf.translate import load_for_inference, translate_lines
    model, tok = load_for_inference(ckpt)
    model.train()
    m = viz.attention_maps(model, tok, "the cat sees a dog", layer=1, head=1, tgt="a dog runs")
    assert model.training                                    # the caller's mode is restored
    src, tgt = m["src_pieces"], m["tgt_pieces"]
    assert src[-1] == "</s>" and tgt[0] == "<s>" and not m["translated"]
    assert len(src) == len(tok.encode(["the cat sees a dog"])[0]) + 1
    assert len(tgt) == len(tok.encode(["a dog runs"])[0]) + 1
    s, t = len(src), len(tgt)
    assert m["enc_self"].shape == (s, s) and m["dec_self"].shape == (t, t) and m["cross"].shape == (t, s)
    for p in (m["enc_self"], m["dec_self"], m["cross"]):
        np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-5)
        assert (p >= 0).all()
    assert np.triu(m["dec_self"], k=1).max() == 0.0          # causal: no query sees a later key
    assert m["dec_self"][0, 0] == pytest.approx(1.0)
    other = viz.attention_maps(model, tok, "the cat sees a dog", layer=1, head=0, tgt="a dog runs")
    assert not np.allclose(other["enc_self"], m["enc_self"])  # heads differ
    # without a target the source is translated first (greedy with beam 1)
    g = viz.attention_maps(model, tok, "the cat sees a dog", layer=0, head=0, beam_size=1, max_len_b=4)
    assert g["translated"]
    assert g["target"] == translate_lines(model, tok, ["the cat sees a dog"], beam_size=1, max_len_b=4,
                                          progress=False)[0]
    assert len(g["tgt_pieces"]) <= len(src) + 4 + 1


def test_attention_maps_limit_the_length_only_for_learned_positions(ckpt):
    """Sinusoidal positions extend past max_len (as decoding's do); learned ones stop there, one line."""
    from minitf.translate import load_for_inference
    model, tok = load_for_inference(ckpt)
    model.cfg = dataclasses.replace(model.cfg, max_len=4)          # shorter than the sentence below
    long = "the cat sees a dog the cat sees a dog"
    assert model.cfg.positional == "sinusoidal"
    m = viz.attention_maps(model, tok, long, layer=0, head=0, tgt="a dog runs")
    assert len(m["src_pieces"]) > 4
    model.cfg = dataclasses.replace(model.cfg, positional="learned")
    with pytest.raises(ConfigError, match=r"--src has \d+ pieces .*learned positions' max_len 4"):
        viz.attention_maps(model, tok, long, layer=0, head=0, tgt="a dog runs")


def test_attention_layer_and_head_out_of_range(ckpt, tmp_path):
    from minitf.translate import load_for_inference
    model, tok = load_for_inference(ckpt)
    with pytest.raises(ConfigError, match=r"2 layers.*0\.\.1"):
        viz.attention_maps(model, tok, "a cat", layer=2, head=0, tgt="a dog")
    with pytest.raises(ConfigError, match=r"2 heads.*0\.\.1"):
        viz.attention_maps(model, tok, "a cat", layer=0, head=-1, tgt="a dog")
    out = run_cli("plot", "attention", "--checkpoint", ckpt, "--src", "a cat", "--layer", 5, "--out", tmp_path / "a.png")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "0..1" in out.stderr, out.stderr
    # a model of one layer and one head says so in the singular (the range is checked before anything is computed)
    model.cfg = dataclasses.replace(model.cfg, n_layers=1, n_decoder_layers=1, n_heads=1, d_k=model.cfg.d_model)
    with pytest.raises(ConfigError, match=r"this model has 1 layer, valid --layer is 0\.\.0"):
        viz.attention_maps(model, tok, "a cat", layer=1, head=0, tgt="a dog")
    with pytest.raises(ConfigError, match=r"this model has 1 head, valid --head is 0\.\.0"):
        viz.attention_maps(model, tok, "a cat", layer=0, head=1, tgt="a dog")


# ------------------------------------------------------------------------------ matplotlib stays optional
def test_importing_minitf_does_not_import_matplotlib():
    code = ("import sys, minitf, minitf.viz, minitf.cli; minitf.cli.build_parser(); "
            "print(any(m == 'matplotlib' or m.startswith('matplotlib.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MinitfError, match=r"matplotlib is not installed: pip install matplotlib \(in a clone: pip "
                                          r"install -e \"\.\[viz\]\"\)"):
        viz.plot_lr(tmp_path / "lr.png")
    assert not (tmp_path / "lr.png").exists()
    with pytest.raises(MinitfError, match="matplotlib is not installed"):   # said before the table it prints
        viz.plot_pe(tmp_path / "pe.png")


# ------------------------------------------------------------------------------ pictures
def test_plot_pe_writes_a_png_and_prints_the_table(tmp_path, capsys):
    needs_matplotlib()
    assert main(["plot", "pe", "--max-len", "40", "--d-model", "32", "--out", str(tmp_path / "pe.png")]) == 0
    assert_png(tmp_path / "pe.png")
    printed = capsys.readouterr().out
    assert "2.2361" in printed and "0.9722" in printed


def test_plot_lr_writes_a_png(tmp_path, capsys):
    needs_matplotlib()
    args = ["plot", "lr", "--d-model", "512", "--warmup", "4000", "--steps", "20000", "--out", str(tmp_path / "lr.png")]
    assert main(args) == 0
    assert_png(tmp_path / "lr.png")
    assert "6.988e-04 at step 4000" in capsys.readouterr().out


def test_pictures_get_the_umask_permissions_not_0600(tmp_path):
    """Pictures are written atomically through a private temporary file; the result is an
    ordinary file (0666 less the umask), like a checkpoint."""
    needs_matplotlib()
    old = os.umask(0o022)
    try:
        assert main(["plot", "lr", "--d-model", "32", "--warmup", "10", "--steps", "50",
                     "--out", str(tmp_path / "lr.png")]) == 0
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "lr.png").st_mode & 0o777 == 0o644


def test_plot_lr_with_a_fade(tmp_path, capsys):
    """--fade draws train_wmt.py's --lr-fade over a run of --steps updates: the paper's curve until
    the last fraction, then a line to 0 (the curve is minitf.schedule.fade times noam)."""
    from minitf.schedule import noam
    s, lr = viz.noam_curve(256, 400, 0.5, steps=2000, fade=0.3)
    plain = np.array([noam(int(k), 256, 400, 0.5) for k in s])
    before = (s - 1) / 2000 <= 0.7
    assert np.array_equal(lr[before], plain[before])
    assert np.all(np.diff(lr[~before]) < 0) and lr[-1] < 0.002 * plain[-1]
    needs_matplotlib()
    assert main(["plot", "lr", "--d-model", "256", "--warmup", "400", "--factor", "0.5", "--steps", "2000",
                 "--fade", "0.3", "--out", str(tmp_path / "fade.png")]) == 0
    assert_png(tmp_path / "fade.png")
    assert "(the fade's last step; the paper's schedule: 6.988e-04)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="fade 1.5"):
        viz.plot_lr(tmp_path / "x.png", fade=1.5)


def test_plot_curves_writes_a_png(tmp_path):
    needs_matplotlib()
    log = write_log(tmp_path / "train_log.jsonl", LOG)
    assert main(["plot", "curves", "--log", str(log), "--out", str(tmp_path / "curves.png")]) == 0
    assert_png(tmp_path / "curves.png")
    # a log with only training lines (no validation, no BLEU yet) still draws
    log = write_log(tmp_path / "early.jsonl", [LOG[0]])
    assert main(["plot", "curves", "--log", str(log), "--out", str(tmp_path / "early.png")]) == 0
    assert_png(tmp_path / "early.png")


def test_plot_curves_says_what_it_does_not_draw(tmp_path, capsys):
    # skipped updates had been left out of the picture without a word, NaN values dropped with the line drawn across
    # the gap, a perplexity at the log's cap drawn as a flat line of real values, and a run whose every update was
    # skipped called "no training records ... is this a minitf train_log.jsonl?"
    import math
    from minitf.validation import NLL_CAP
    d = viz.read_train_log(write_log(tmp_path / "train_log.jsonl", LOG))
    assert d["skipped_updates"] == [60] and d["not_finite_steps"] == []
    cap = round(math.exp(NLL_CAP), 2)
    odd = LOG + [{"step": 160, "loss": float("nan"), "nll": float("inf"), "ppl": cap, "lr": 3e-4},
                 {"step": 170, "loss": 30.0, "nll": 60.0, "ppl": cap, "lr": 3e-4}]
    log = tmp_path / "odd.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in odd))      # json writes NaN and Infinity as Python does
    d = viz.read_train_log(log)
    assert d["not_finite_steps"] == [160] and d["train"]["loss"][0].tolist() == [50, 100, 150, 170]
    needs_matplotlib()
    capsys.readouterr()
    assert main(["plot", "curves", "--log", str(log), "--out", str(tmp_path / "odd.png")]) == 0
    err = capsys.readouterr().err
    assert "1 update skipped (a non-finite loss or gradient), marked in the loss panel" in err
    assert "values that are NaN or infinite at 1 step (first 160) are left out of the lines" in err
    # a skipped update does not advance the step: five at step 0 are five (they had been counted once)
    diverged = write_log(tmp_path / "train_log.jsonl", [{"step": 0, "event": "nonfinite_loss_skipped", "count": c}
                                                         for c in range(1, 6)])
    assert main(["plot", "curves", "--log", str(diverged), "--out", str(tmp_path / "d.png")]) == 2
    assert "5 updates skipped (a non-finite loss or gradient) and none logged: nothing to draw; the run diverged" \
        in capsys.readouterr().err
    settling = write_log(tmp_path / "train_log.jsonl", [{"step": 0, "event": "overflow_skipped", "loss_scale": 2.0 ** k}
                                                        for k in (16, 15)])   # float16 at its start: nothing wrong
    assert main(["plot", "curves", "--log", str(settling), "--out", str(tmp_path / "d.png")]) == 2
    err = capsys.readouterr().err
    assert "2 updates skipped while the float16 loss scale settled (overflows)" in err and "diverged" not in err


def test_plot_attention_writes_a_png(ckpt, tmp_path, capsys):
    needs_matplotlib()
    out = tmp_path / "att.png"
    assert main(["plot", "attention", "--checkpoint", str(ckpt), "--src", "the big dog eats", "--layer", "1",
                 "--head", "1", "--beam", "2", "--max-len-b", "4", "--out", str(out)]) == 0
    assert_png(out)
    printed = capsys.readouterr().out
    assert "source:" in printed and "beam 2 translation" in printed
    out2 = tmp_path / "att_tgt.png"
    assert main(["plot", "attention", "--checkpoint", str(ckpt), "--src", "the big dog eats", "--tgt",
                 "a red house", "--out", str(out2)]) == 0
    assert_png(out2)
    # a long sentence: the picture stays within ATTENTION_WIDTH (its cells shrink, the axes numbered), not one that
    # grows with the sentence (200 words made 21,378 x 8,314 pixels); an empty --src is refused
    import struct
    long = " ".join(["the big dog eats"] * 60)
    assert main(["plot", "attention", "--checkpoint", str(ckpt), "--src", long, "--tgt", long,
                 "--out", str(tmp_path / "long.png")]) == 0
    assert "too many to label at this size; the axes number them" in capsys.readouterr().err
    width, height = struct.unpack(">II", (tmp_path / "long.png").read_bytes()[16:24])   # the PNG's IHDR
    assert width <= (viz.ATTENTION_WIDTH + 4.5) * viz.DPI + 1 and height <= width
    with pytest.raises(ConfigError, match="--src is empty"):
        viz.plot_attention(ckpt, " ", tmp_path / "empty.png")


def test_plot_cli_end_to_end(tmp_path):
    needs_matplotlib()
    out = run_cli("plot", "lr", "--d-model", "256", "--warmup", "400", "--factor", "0.5", "--steps", "5000",
                  "--out", tmp_path / "lr.png")
    assert out.returncode == 0, out.stderr
    assert_png(tmp_path / "lr.png")
    assert "1.563e-03 at step 400" in out.stdout


def test_mask_grids_are_the_models_masks():
    from minitf.viz import mask_grids
    g = mask_grids([5, 3], [4, 6])
    assert g["encoder"].shape == (2, 5, 5) and g["decoder"].shape == (2, 6, 6) and g["cross"].shape == (2, 6, 5)
    assert g["encoder"][1].sum(axis=1).tolist() == [3] * 5                 # 3 real keys, pads hidden
    dec = g["decoder"][0]                                                  # 4 real target positions
    assert dec[3].tolist() == [True] * 4 + [False] * 2                     # sees itself and the past
    assert not dec[1, 2] and dec[2, 1]                                     # never the future
    assert (g["decoder"][1] == np.tril(np.ones((6, 6), bool))).all()       # no padding: causal only


def test_packing_grid_numbers_the_kept_positions_row_major():
    from minitf.viz import packing_grid
    grid, n = packing_grid([3, 1, 2])
    assert n == 6
    assert grid.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]


def test_plot_masks_and_packing_write_pngs(tmp_path):
    needs_matplotlib()
    assert main(["plot", "masks", "--src-lens", "4", "2", "--tgt-lens", "3", "5", "--out", str(tmp_path / "m.png")]) == 0
    assert_png(tmp_path / "m.png")
    assert main(["plot", "packing", "--lens", "3", "1", "--out", str(tmp_path / "p.png")]) == 0
    assert_png(tmp_path / "p.png")
    assert main(["plot", "packing", "--lens", "0", "--out", str(tmp_path / "q.png")]) == 2


def test_table1_bench_and_its_plot(tmp_path):
    """bench/table1.py at toy sizes writes the JSON `plot table1` draws; the LSTM takes n steps."""
    from bench import table1
    out = tmp_path / "t1.json"
    table1.main(["--n", "4", "8", "--d", "8", "--widths", "8", "16", "--n-fixed", "4", "--rounds", "1",
                 "--batch", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["steps"]["recurrent"] for r in res["by_n"]] == [4, 8]
    assert all(r["steps"]["self-attention"] == 1 for r in res["by_n"] + res["by_d"])
    assert all(r["seconds"]["recurrent"] > 0 for r in res["by_n"])
    with pytest.raises(DataError, match="bench/table1.py"):
        viz.plot_table1(tmp_path / "missing.json", tmp_path / "t.png")
    absent = str(tmp_path / "docs" / "img" / "table1.json")   # the default, installed without the repository's docs/
    import unittest.mock
    with unittest.mock.patch.object(viz, "TABLE1_JSON", absent), pytest.raises(DataError, match="no --results given"):
        viz.read_table1(absent)
    needs_matplotlib()
    viz.plot_table1(out, tmp_path / "t.png")
    assert_png(tmp_path / "t.png")
    # without --results, from any folder: the measurements recorded in the repository
    r = subprocess.run([sys.executable, "-m", "minitf", "plot", "table1", "--out", "recorded.png"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(viz.__file__))))
    assert r.returncode == 0, r.stderr
    assert_png(tmp_path / "recorded.png")


def test_table1_path_gradients_of_both_archs(tmp_path):
    """The path-length part runs the encoder of a checkpoint of each arch (here: untrained)."""
    from bench import table1
    import minitf
    from minitf.checkpoint import save_checkpoint
    from minitf.architectures import build_model
    from minitf.checkpoint import load_checkpoint
    ckpt_t, lines = make_tiny_checkpoint(tmp_path)
    base = load_checkpoint(ckpt_t)
    cfg = minitf.Config.preset("tiny", arch="rnn", vocab_size=base.config.vocab_size)
    rnn_path = tmp_path / "rnn.npz"
    save_checkpoint(rnn_path, build_model(cfg), tokenizer=base.tokenizer, train_state={"step": 0})
    text = tmp_path / "src.txt"
    text.write_text("\n".join(lines) + "\n")
    for path in (rnn_path, ckpt_t):
        res = table1.path_gradients(path, str(text), [2, 6], 2, np.random.default_rng(0))
        assert res["n"] == [2, 6] and all(g > 0 for g in res["grad_norm"])


def test_table1_results_of_another_shape_are_one_line(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"by_n": []}))
    with pytest.raises(DataError, match="no by_d, path"):
        viz.read_table1(bad)


def test_pictures_of_odd_but_valid_input_and_flags_past_their_bounds(ckpt, tmp_path, capsys):
    # a batch without padding (packing had failed on make_rows' None), lists of two lengths (masks had drawn one
    # sentence fewer or failed), a table1 file that is a folder or lacks a layer (tracebacks), numbers past any use
    # (tracebacks from NumPy), a layer only the deeper stack has (refused before)
    needs_matplotlib()
    assert main(["plot", "packing", "--lens", "3", "3", "--out", str(tmp_path / "p.png")]) == 0
    assert_png(tmp_path / "p.png")
    grid, n = viz.packing_grid([3, 3])
    assert n == 6 and grid.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ConfigError, match="--src-lens gives 2 sentences and --tgt-lens 1"):
        viz.plot_masks(tmp_path / "m.png", [5, 3], [4])
    with pytest.raises(ConfigError, match="add up to 300 positions"):
        viz.plot_packing(tmp_path / "p.png", [100, 100, 100])
    with pytest.raises(DataError, match="cannot read it"):
        viz.plot_table1(tmp_path, tmp_path / "t.png")
    (tmp_path / "t.json").write_text('{"by_n": [{"n": 8, "d": 4, "seconds": {}, "steps": {}}], "by_d": [], "path": []}')
    with pytest.raises(DataError, match="a row of by_n lacks the seconds or steps"):
        viz.plot_table1(tmp_path / "t.json", tmp_path / "t.png")
    for args in (["lr", "--steps", "99999999999999999999"], ["pe", "--max-len", "99999999999"],
                 ["masks", "--src-lens", "99999999999999999999", "--tgt-lens", "3"], ["packing", "--lens", "101"]):
        r = run_cli("plot", *args, "--out", tmp_path / "x.png")
        assert r.returncode == 2 and "must be an integer in [" in r.stderr and "Traceback" not in r.stderr, r.stderr
    from minitf.checkpoint import load_checkpoint, save_checkpoint
    import minitf
    c = load_checkpoint(ckpt)
    deep = minitf.Transformer(minitf.Config(**{**c.config.to_dict(), "n_layers": 3, "n_decoder_layers": 1}))
    save_checkpoint(tmp_path / "deep.npz", deep, tokenizer=c.tokenizer)
    capsys.readouterr()
    assert main(["plot", "attention", "--checkpoint", str(tmp_path / "deep.npz"), "--src", "the big dog eats",
                 "--tgt", "a red house", "--layer", "2", "--out", str(tmp_path / "a.png")]) == 0
    assert_png(tmp_path / "a.png")
    assert "note: layer 2 is the encoder's alone (this model has 3 encoder and 1 decoder layers)" in capsys.readouterr().err
    from minitf.translate import load_for_inference
    model, tok = load_for_inference(tmp_path / "deep.npz")
    m = viz.attention_maps(model, tok, "the big dog eats", layer=2, head=0, tgt="a red house")
    assert "enc_self" in m and "dec_self" not in m and "cross" not in m
    with pytest.raises(ConfigError, match=r"3 encoder and 1 decoder layers, valid --layer is 0\.\.2"):
        viz.attention_maps(model, tok, "a cat", layer=3, head=0, tgt="a dog")
