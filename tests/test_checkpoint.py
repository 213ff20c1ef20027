"""Checkpoints: round trip, fresh-process load, averaging, truncation and tampering."""
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import minitf
from minitf.checkpoint import average_checkpoints, load_checkpoint, save_checkpoint
from minitf.fileio import WriteFailed


def tiny_model(seed=0):
    cfg = minitf.Config(vocab_size=17, d_model=16, n_heads=2, d_ff=24, n_layers=1, dropout=0.1)
    return minitf.Transformer(cfg, seed=seed)


SRC = np.array([[5, 6, 7, 3, 0], [9, 10, 5, 6, 3]])
TGT = np.array([[2, 4, 6, 8], [2, 7, 5, 0]])


def test_round_trip_params_optimizer_and_state(tmp_path):
    model = tiny_model()
    opt = minitf.Adam(model, lr=1e-3)
    model.forward_loss(SRC, TGT, TGT)
    model.backward()
    opt.step()
    path = tmp_path / "c.npz"
    save_checkpoint(path, model, opt, tokenizer=b"\x01\x02spm", train_state={"step": 1, "epoch": 0, "batch": 7})
    ck = load_checkpoint(path)
    assert ck.train_state == {"step": 1, "epoch": 0, "batch": 7} and ck.tokenizer == b"\x01\x02spm"
    assert ck.config == model.cfg
    model.eval()
    loaded = ck.build_model()
    np.testing.assert_array_equal(loaded.forward(SRC, TGT), model.forward(SRC, TGT))
    opt2 = minitf.Adam(loaded, lr=1e-3)
    opt2.load_state_dict(ck.optimizer)
    assert opt2.step_count == 1
    np.testing.assert_array_equal(opt2._m, opt._m)
    np.testing.assert_array_equal(opt2._v, opt._v)
    assert not any(name.endswith(".tmp") or name.startswith(".tmp-") for name in os.listdir(tmp_path))


def test_load_in_a_fresh_process_gives_identical_logits(tmp_path):
    model = tiny_model(seed=4).eval()
    path = tmp_path / "c.npz"
    save_checkpoint(path, model)
    np.save(tmp_path / "expected.npy", model.forward(SRC, TGT))
    code = ("import numpy as np, sys; from minitf.checkpoint import load_checkpoint; "
            "m = load_checkpoint(sys.argv[1]).build_model(); "
            "src = np.array([[5, 6, 7, 3, 0], [9, 10, 5, 6, 3]]); tgt = np.array([[2, 4, 6, 8], [2, 7, 5, 0]]); "
            "assert (m.forward(src, tgt) == np.load(sys.argv[2])).all(); print('same')")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "expected.npy")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "same"


def test_average_of_two_checkpoints_is_the_mean(tmp_path):
    a, b = tiny_model(1), tiny_model(2)
    save_checkpoint(tmp_path / "a.npz", a)
    save_checkpoint(tmp_path / "b.npz", b)
    average_checkpoints([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "avg.npz")
    avg = load_checkpoint(tmp_path / "avg.npz")
    for name, p in a.state_dict().items():
        np.testing.assert_allclose(avg.params[name], (p.astype(np.float64) + b.state_dict()[name]) / 2, rtol=1e-6)
    assert avg.optimizer is None


def test_average_holds_one_checkpoint_at_a_time_and_never_reads_adams_moments(tmp_path, monkeypatch):
    """Averaging `big`'s last 20 training checkpoints (2.6 GB each with Adam's state) must not hold them all: one
    checkpoint's weights at a time go into a float64 sum."""
    import weakref
    from minitf import checkpoint as ck
    paths, models = [], [tiny_model(s) for s in range(4)]
    for s, model in enumerate(models):
        opt = minitf.Adam(model, lr=1e-3)
        model.forward_loss(SRC, TGT, TGT)
        model.backward()
        opt.step()
        state = model.state_dict()
        state["embedding.weight"] = state["embedding.weight"].copy()
        state["embedding.weight"][0, :2] = (-0.0, -1.0 if s % 2 else 1.0)   # -0.0 in every input at [0, 0]
        model.load_state_dict(state)
        save_checkpoint(tmp_path / f"{s}.npz", model, opt)
        paths.append(tmp_path / f"{s}.npz")
    alive, held = [], []
    real = ck.load_checkpoint

    def counting(path, optimizer=True):
        held.append(sum(ref() is not None for ref in alive))   # checkpoints still in memory when the next is read
        c = real(path, optimizer)
        assert c.optimizer is None and c.has_optimizer           # the moments were in the file, and not read
        alive.append(weakref.ref(c))
        return c
    monkeypatch.setattr(ck, "load_checkpoint", counting)
    average_checkpoints(paths, tmp_path / "avg.npz")
    assert len(held) == 4 and max(held) <= 1, held
    avg = real(tmp_path / "avg.npz")
    for name in avg.params:
        expected = sum(m.state_dict()[name].astype(np.float64) for m in models) / 4
        np.testing.assert_array_equal(avg.params[name], expected.astype(np.float32))
    assert real(paths[0]).optimizer["step"] == 1 and real(paths[0], optimizer=False).optimizer is None
    assert not np.signbit(avg.params["embedding.weight"][0, 0])   # 0 + (-0.0) + ...: +0.0, as sum() from 0 gives


def test_average_cli(tmp_path):
    for s in (1, 2, 3):
        save_checkpoint(tmp_path / f"{s}.npz", tiny_model(s))
    out = subprocess.run([sys.executable, "-m", "minitf", "average", "--inputs", *(str(tmp_path / f"{s}.npz") for s in (1, 2, 3)),
                          "--output", str(tmp_path / "avg.npz")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    w = [load_checkpoint(tmp_path / f"{s}.npz").params["embedding.weight"] for s in (1, 2, 3)]
    np.testing.assert_allclose(load_checkpoint(tmp_path / "avg.npz").params["embedding.weight"], sum(w) / 3, rtol=1e-5)


def test_average_rejects_different_models_naming_the_field(tmp_path):
    save_checkpoint(tmp_path / "a.npz", tiny_model())
    cfg = minitf.Config(vocab_size=17, d_model=8, n_heads=2, d_ff=24, n_layers=1)
    save_checkpoint(tmp_path / "b.npz", minitf.Transformer(cfg))
    with pytest.raises(minitf.CheckpointError) as e:
        average_checkpoints([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "avg.npz")
    assert "different model" in str(e.value) and "d_model 8 vs 16" in str(e.value) and "vocab_size" not in str(e.value)


def test_average_refuses_checkpoints_of_two_tokenizers(tmp_path):
    # the same architecture trained on two corpora: row i of the embedding is another piece in each
    save_checkpoint(tmp_path / "a.npz", tiny_model(1), tokenizer=b"pieces of corpus A")
    save_checkpoint(tmp_path / "b.npz", tiny_model(2), tokenizer=b"pieces of corpus B")
    save_checkpoint(tmp_path / "c.npz", tiny_model(3), tokenizer=b"pieces of corpus A")
    with pytest.raises(minitf.CheckpointError, match=r"b.npz has another tokenizer than .*a.npz: the same row"):
        average_checkpoints([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "avg.npz")
    assert not (tmp_path / "avg.npz").exists()
    average_checkpoints([tmp_path / "a.npz", tmp_path / "c.npz"], tmp_path / "avg.npz")   # one tokenizer: taken
    assert load_checkpoint(tmp_path / "avg.npz").tokenizer == b"pieces of corpus A"


def test_average_takes_checkpoints_that_differ_only_in_the_recipe(tmp_path):
    import dataclasses
    model = tiny_model(1)
    save_checkpoint(tmp_path / "a.npz", model)
    model.cfg = dataclasses.replace(model.cfg, max_steps=50, warmup=7, dropout=0.3, decode_alpha=2.0,   # a resumed run
                                    update_tokens=2 * model.cfg.update_tokens)
    save_checkpoint(tmp_path / "b.npz", model)
    average_checkpoints([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "avg.npz")
    assert load_checkpoint(tmp_path / "avg.npz").config.max_steps == 50   # the last input's


def test_average_refuses_an_output_that_is_an_input_or_a_folder(tmp_path):
    model = tiny_model()
    opt = minitf.Adam(model, lr=1e-3)
    save_checkpoint(tmp_path / "c.npz", model, opt)
    save_checkpoint(tmp_path / "d.npz", model, opt)
    before = (tmp_path / "c.npz").read_bytes()
    with pytest.raises(minitf.CheckpointError, match="is one of the inputs"):
        average_checkpoints([tmp_path / "c.npz", tmp_path / "d.npz"], tmp_path / "." / "c.npz")
    assert (tmp_path / "c.npz").read_bytes() == before and load_checkpoint(tmp_path / "c.npz").optimizer
    with pytest.raises(minitf.CheckpointError, match="is a folder"):
        average_checkpoints([tmp_path / "c.npz"], tmp_path)
    for output, what in ((tmp_path / "c.npz", "is one of the inputs"), (tmp_path, "is a folder"),
                         (tmp_path / "no" / "avg.npz", "does not exist")):
        r = subprocess.run([sys.executable, "-m", "minitf", "average", "--inputs", str(tmp_path / "c.npz"),
                            str(tmp_path / "d.npz"), "--output", str(output)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and what in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_average_refuses_a_checkpoint_given_twice_and_an_output_named_safetensors(tmp_path):
    save_checkpoint(tmp_path / "a.npz", tiny_model(1))
    save_checkpoint(tmp_path / "b.npz", tiny_model(2))
    with pytest.raises(minitf.CheckpointError, match="among the inputs twice") as e:
        average_checkpoints([str(tmp_path / "a.npz"), tmp_path / "b.npz", f"{tmp_path}/./a.npz"], tmp_path / "avg.npz")
    assert f"(as {tmp_path / 'a.npz'})" in str(e.value) and not (tmp_path / "avg.npz").exists()
    with pytest.raises(minitf.CheckpointError, match="among the inputs twice; each") as e:   # the same name twice
        average_checkpoints([tmp_path / "a.npz", str(tmp_path / "a.npz")], tmp_path / "avg.npz")
    r = subprocess.run([sys.executable, "-m", "minitf", "average", "--inputs", str(tmp_path / "a.npz"),
                        str(tmp_path / "b.npz"), "--output", str(tmp_path / "avg.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "name it *.npz" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "avg.safetensors").exists()


def test_saving_onto_a_folder_is_one_line_and_leaves_nothing(tmp_path):
    from minitf.errors import MinitfError
    (tmp_path / "run").mkdir()
    with pytest.raises(MinitfError, match=r"run is a folder: name the file to write inside it$"):
        save_checkpoint(tmp_path / "run", tiny_model())
    assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(tmp_path / "run") == []


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, tiny_model())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(minitf.CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_tampered_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.npz"
    model = tiny_model()
    save_checkpoint(path, model)
    arrays = dict(np.load(path, allow_pickle=False))
    arrays["param/embedding.weight"] = arrays["param/embedding.weight"] + 1e-3
    np.savez(path, **arrays)
    with pytest.raises(minitf.CheckpointError, match="SHA-256"):
        load_checkpoint(path)
    arrays.pop("param/embedding.weight")
    np.savez(path, **arrays)
    with pytest.raises(minitf.CheckpointError, match="manifest"):
        load_checkpoint(path)


def test_not_a_checkpoint_and_missing_file(tmp_path):
    with pytest.raises(minitf.CheckpointError, match="does not exist$"):
        load_checkpoint(tmp_path / "nope.npz")
    (tmp_path / "checkpoint_0000400.npz").write_bytes(b"")   # a step named without its 7 digits: the file suggested
    with pytest.raises(minitf.CheckpointError, match=r"checkpoint_400.npz does not exist; did you mean .*"
                                                     r"checkpoint_0000400.npz\? \(the step is written in 7 digits\)"):
        load_checkpoint(tmp_path / "checkpoint_400.npz")
    with pytest.raises(minitf.CheckpointError, match="checkpoint_401.npz does not exist$"):
        load_checkpoint(tmp_path / "checkpoint_401.npz")
    with pytest.raises(minitf.CheckpointError, match="checkpoint /dev/null is not a file"):   # it had "not existed"
        load_checkpoint(os.devnull)
    (tmp_path / "x.npz").write_text("hello")
    with pytest.raises(minitf.CheckpointError) as e:
        load_checkpoint(tmp_path / "x.npz")
    assert "x.npz is not a minitf checkpoint" in str(e.value) and "pickle" not in str(e.value)   # no 'load it unsafely'
    np.savez(tmp_path / "y.npz", a=np.zeros(3))
    with pytest.raises(minitf.CheckpointError, match="metadata"):
        load_checkpoint(tmp_path / "y.npz")
    np.savez(tmp_path / "o.npz", a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(minitf.CheckpointError, match="o.npz is not a minitf checkpoint: it holds pickled"):
        load_checkpoint(tmp_path / "o.npz")
    with pytest.raises(minitf.CheckpointError, match="is a folder"):
        load_checkpoint(tmp_path)
    run = tmp_path / "run"            # a run's folder: the message names the model it reported
    run.mkdir()
    with pytest.raises(minitf.CheckpointError) as e:
        load_checkpoint(run)
    assert "did you mean" not in str(e.value)
    save_checkpoint(run / "checkpoint_0000002.npz", tiny_model())
    with pytest.raises(minitf.CheckpointError, match=r"did you mean .*checkpoint_0000002\.npz\?"):
        load_checkpoint(run)
    save_checkpoint(run / "model.npz", tiny_model())
    with pytest.raises(minitf.CheckpointError, match=r"is a folder, not a file; did you mean .*model\.npz\?"):
        load_checkpoint(run)


def test_a_corrupt_npy_header_inside_is_one_line(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, tiny_model())
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in entries if n.startswith("param/"))
    entries[name] = entries[name][:10] + b"{'descr': ((((((((" + entries[name][28:]   # the header's dict, broken
    with zipfile.ZipFile(path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
    with pytest.raises(minitf.CheckpointError) as e:
        load_checkpoint(path)
    assert "truncated or corrupt" in str(e.value) and "\n" not in str(e.value)


def test_no_pickle_inside(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, tiny_model(), train_state={"step": 3})
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            assert name.endswith(".npy")
    with np.load(path, allow_pickle=False) as z:
        for k in z.files:
            assert z[k].dtype != object


def test_failed_write_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    save_checkpoint(path, tiny_model(1))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(WriteFailed, match=r"c\.npz: cannot write it \(disk full\)$"):   # the file named, one line
        save_checkpoint(path, tiny_model(2))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.npz"]


def test_checkpoints_get_the_umask_permissions_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "c.npz", tiny_model())
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "c.npz").st_mode & 0o777 == 0o644


def test_a_full_disk_is_one_line_and_the_previous_file_survives(tmp_path):
    import errno
    from minitf.errors import MinitfError
    from minitf.fileio import atomic_write
    path = tmp_path / "c.npz"
    save_checkpoint(path, tiny_model())
    before = path.read_bytes()

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(MinitfError) as e:
        atomic_write(path, full, size_hint=12_500_000)
    msg = str(e.value)
    assert "no space left" in msg and str(tmp_path) in msg and "12.5 MB" in msg and "\n" not in msg
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c.npz"]


def test_read_model_reads_every_kind_of_model_file_alike(tmp_path):
    # a checkpoint, its .safetensors export and its Marian export: one config, the same weights, one tokenizer's
    # pieces; the model each builds translates alike; a checkpoint without a tokenizer reads, and cannot translate
    from conftest import make_tiny_checkpoint
    from minitf.checkpoint import export_safetensors
    from minitf.errors import CheckpointError
    from minitf.marian import export_marian
    from minitf.modelfile import read_model
    from minitf.translate import load
    path, lines = make_tiny_checkpoint(tmp_path)
    save_checkpoint(tmp_path / "train.npz", minitf.Transformer(load_checkpoint(path).config, seed=0),
                    minitf.Adam(minitf.Transformer(load_checkpoint(path).config, seed=0)),
                    tokenizer=load_checkpoint(path).tokenizer, train_state={"languages": ["en", "de"]})
    export_safetensors(path, tmp_path / "m.safetensors")
    export_marian(path, tmp_path / "marian")
    npz, st, marian, train = (read_model(str(p)) for p in (path, tmp_path / "m.safetensors", tmp_path / "marian",
                                                           tmp_path / "train.npz"))
    assert (npz.marian, st.marian, marian.marian) == (False, False, True)
    assert (npz.has_optimizer, train.has_optimizer, marian.has_optimizer) == (False, True, False)
    assert train.train_state["languages"] == ["en", "de"] and marian.train_state == {}
    for other in (st, marian, train):
        assert other.config.model_fields() == npz.config.model_fields()
        assert other.params.keys() == npz.params.keys()
        for k, a in npz.params.items():
            np.testing.assert_array_equal(other.params[k], a, err_msg=k)
        assert other.tokenizer.encode(lines[:5]) == npz.tokenizer.encode(lines[:5])
    want = load(str(path)).translate(lines[:3], beam=2, max_len_b=3)
    assert load(str(tmp_path / "marian")).translate(lines[:3], beam=2, max_len_b=3) == want
    from minitf.checkpoint import read_train_state, role   # an export keeps what the file is (it had lost "best")
    c = load_checkpoint(path)
    save_checkpoint(tmp_path / "checkpoint_best.npz", params=c.params, config=c.config, tokenizer=c.tokenizer,
                    train_state={"step": 4, "best": True})
    export_safetensors(tmp_path / "checkpoint_best.npz", tmp_path / "best.safetensors")
    assert role(read_train_state(tmp_path / "best.safetensors")) == "best"
    from minitf.cli import main   # a Marian model given to average is named as such (it had "no metadata")
    for marian in (tmp_path / "marian", tmp_path / "marian" / "model.npz"):
        assert main(["average", "--inputs", str(path), str(marian), "--output", str(tmp_path / "avg.npz")]) == 2
    assert npz.build_model().training is False
    save_checkpoint(tmp_path / "bare.npz", npz.build_model())
    assert read_model(str(tmp_path / "bare.npz")).tokenizer is None
    with pytest.raises(CheckpointError, match="has no tokenizer inside: it cannot translate text"):
        load(str(tmp_path / "bare.npz"))


def test_average_refuses_two_precisions_and_the_command_says_what_it_found(tmp_path, capsys):
    from minitf.cli import main
    cfg = minitf.Config(vocab_size=17, d_model=16, n_heads=2, d_ff=24, n_layers=1)
    save_checkpoint(tmp_path / "a.npz", minitf.Transformer(cfg, seed=1), tokenizer=b"t")
    save_checkpoint(tmp_path / "b.npz", minitf.Transformer(cfg, dtype="float64", seed=2), tokenizer=b"t")
    with pytest.raises(minitf.CheckpointError, match=r"b.npz holds float64 weights, .*a.npz float32 \(as .*\): "
                                                     r"average checkpoints of one precision"):
        average_checkpoints([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "avg.npz")
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 4):
        m = minitf.Transformer(cfg, seed=step)
        save_checkpoint(run / f"checkpoint_{step:07d}.npz", m, minitf.Adam(m), tokenizer=b"t", train_state={"step": step})
    capsys.readouterr()
    assert main(["average", "--folder", str(run), "--last", "5", "--output", str(tmp_path / "avg.npz")]) == 0
    err = capsys.readouterr().err
    assert f"note: --last 5, but {run} holds 2 training checkpoints: averaging those" in err
    for step in (6, 8, 10):   # the run's own rule: its first half (the warmup of a short run) is left out, and said
        m = minitf.Transformer(cfg, seed=step)
        save_checkpoint(run / f"checkpoint_{step:07d}.npz", m, minitf.Adam(m), tokenizer=b"t", train_state={"step": step})
    assert main(["average", "--folder", str(run), "--last", "5", "--output", str(tmp_path / "avg.npz")]) == 0
    err = capsys.readouterr().err
    assert "note: left out checkpoint_0000002.npz, checkpoint_0000004.npz: from the run's first half" in err
    assert "averaged 3 checkpoints (checkpoint_0000006.npz, checkpoint_0000008.npz, checkpoint_0000010.npz)" in err
    assert main(["average", "--folder", str(tmp_path / "nope"), "--output", str(tmp_path / "avg.npz")]) == 2
    assert "does not exist: name a run's --out folder" in capsys.readouterr().err
    assert main(["average", "--folder", str(tmp_path / "a.npz"), "--output", str(tmp_path / "avg.npz")]) == 2
    assert "is a file: name the run's folder" in capsys.readouterr().err
