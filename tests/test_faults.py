"""Hostile and broken inputs refused in one line, before any work they would cost.

Each test builds its own tiny fault; together they run in seconds.
"""
import json
import os
import platform
import struct
import subprocess
import sys

import numpy as np
import pytest

from minitf.errors import CheckpointError, DataError
from minitf.safetensors import load_safetensors, save_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_raw(path, header, body=b""):
    """A safetensors file with exactly this header (a dict, JSON-encoded as given) and body."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return path


def good_header(**changes):
    entry = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    entry.update(changes)
    return {"w": entry, "__metadata__": {"format": "minitf"}}


@pytest.mark.parametrize("header,says", [
    ({**good_header(), "__metadata__": ["not", "a", "dict"]}, "__metadata__ must be a JSON object"),
    ({**good_header(), "__metadata__": {"format": 3}}, "__metadata__ must be a JSON object"),
    (good_header(shape=[2, "3"]), "non-negative integers"),
    (good_header(shape=[2, 3.0]), "non-negative integers"),
    (good_header(shape=[2, True]), "non-negative integers"),
    (good_header(shape=[-2, -3]), "non-negative integers"),
    (good_header(shape=[2 ** 32, 2 ** 32, 2 ** 2]), "do not fit its shape"),   # int64 product wraps to 0
    (good_header(shape=[2 ** 62, 4], data_offsets=[0, 0]), "do not fit its shape"),
    (good_header(dtype="F128"), "unknown dtype"),
    (good_header(data_offsets=[0, 48]), "do not fit"),                        # past the end of the data
    (good_header(data_offsets=["0", 24]), "data_offsets must be two integers"),
    (good_header(extra=1), "exactly dtype, shape and data_offsets"),
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, "overlap"),
])
def test_a_hostile_safetensors_header_is_refused_in_one_error(tmp_path, header, says):
    """Every field is checked before a tensor is read: the three headers that once ended in a
    traceback (metadata not a dict, a shape entry not an integer, a shape whose int64 product
    wraps to 0) and their neighbours are one CheckpointError naming the file."""
    path = write_raw(tmp_path / "bad.safetensors", header, np.zeros(6, np.float32).tobytes())
    with pytest.raises(CheckpointError) as e:
        load_safetensors(str(path))
    assert says in str(e.value) and "bad.safetensors" in str(e.value)


def test_a_written_safetensors_file_still_loads(tmp_path):
    """The checks accept what minitf writes (several tensors, empty ones, metadata)."""
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4)), "c": np.ones(3, np.int64)}
    save_safetensors(str(tmp_path / "ok.safetensors"), tensors, {"format": "minitf"})
    got, meta = load_safetensors(str(tmp_path / "ok.safetensors"))
    assert meta == {"format": "minitf"} and sorted(got) == ["a", "b", "c"]
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)


def test_translate_from_a_hostile_safetensors_file_is_one_line_and_exit_2(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", good_header(shape=[2 ** 32, 2 ** 32, 4]),
                     np.zeros(6, np.float32).tobytes())
    r = subprocess.run([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(path)], input="a b\n",
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "bad.safetensors" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    d = tmp_path_factory.mktemp("faults")
    path, lines = make_tiny_checkpoint(d)
    return path, lines


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to stand for a full disk")
def test_translate_to_a_full_disk_through_stdout_is_one_line_and_exit_2(tiny_checkpoint):
    """stdout on a full disk: the error is reported (exit 2, one line), not dropped at exit
    with status 0 and part of the output written."""
    path, lines = tiny_checkpoint
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(path), "--max-len-b", "3",
                            "--quiet"], input="".join(line + "\n" for line in lines[:200]), stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "stdout failed" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


def test_translate_into_a_closed_pipe_stops_quietly(tiny_checkpoint):
    """A reader that stops early (`| head -1`): no traceback, the status of a broken pipe."""
    path, lines = tiny_checkpoint
    p = subprocess.Popen([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(path), "--max-len-b", "3",
                          "--quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()                     # the reader is gone before the first line
    _, err = p.communicate("".join(line + "\n" for line in lines[:200]).encode(), timeout=300)
    assert p.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()


# ----------------------------------------------------------------------------- one run per output folder
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import write_multi30k
    return write_multi30k(tmp_path_factory.mktemp("m30k"))


def train(corpus, out, *extra, cache=None):
    from test_train import run_train
    return run_train(corpus, out, *extra, cache=cache)


def test_a_foreign_checkpoint_in_out_is_refused_and_nothing_is_overwritten(corpus, tmp_path):
    """A checkpoint of another run (another width) copied in as the newest, and one whose name's step
    is not the step it records: --resume refuses each in one line naming the file and the
    difference, and the folder's own checkpoints stay as they were."""
    cache = tmp_path / "cache"
    out, other = tmp_path / "run", tmp_path / "other"
    args = ("--save-every", 2, "--valid-every", 0, "--average-last", 1, "--keep-last", 5)
    assert train(corpus, out, "--max-steps", 4, *args, cache=cache).returncode == 0
    assert train(corpus, other, "--max-steps", 6, "--d-model", 16, *args, cache=cache).returncode == 0
    before = {p.name: p.read_bytes() for p in out.glob("checkpoint_*.npz")}
    foreign = out / "checkpoint_0000009.npz"
    foreign.write_bytes((other / "checkpoint_0000002.npz").read_bytes())
    r = train(corpus, out, "--max-steps", 12, "--resume", *args, cache=cache)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checkpoint_0000009.npz" in r.stderr and "named step 9 but records step 2" in r.stderr
    foreign.unlink()
    renamed = out / "checkpoint_0000006.npz"      # the right step in the name, another model inside
    renamed.write_bytes((other / "checkpoint_0000006.npz").read_bytes())
    r = train(corpus, out, "--max-steps", 12, "--resume", *args, cache=cache)
    assert r.returncode == 2 and "not this run's model" in r.stderr and "d_model" in r.stderr, r.stderr[-2000:]
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1
    renamed.unlink()
    assert {p.name: p.read_bytes() for p in out.glob("checkpoint_*.npz")} == before
    r = train(corpus, out, "--max-steps", 6, "--resume", *args, cache=cache)      # its own still resumes, twice
    assert r.returncode == 0, r.stderr[-2000:]
    assert train(corpus, out, "--max-steps", 8, "--resume", *args, cache=cache).returncode == 0


def test_a_second_run_into_a_busy_out_is_refused_naming_the_holder(corpus, tmp_path):
    """While a process holds --out (as a running training does), a start or a --resume into it is
    one line naming the holder's pid; a lock left by a process that died is taken over."""
    from minitf.fileio import folder_lock, refuse_if_busy
    out = tmp_path / "run"
    args = ("--max-steps", 2, "--save-every", 1, "--average-last", 1, "--valid-every", 0)
    with folder_lock(str(out), refuse_if_busy("--out", str(out))):
        r = train(corpus, out, *args)
        assert r.returncode == 2 and f"process {os.getpid()}" in r.stderr and "--out" in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    lock = tmp_path / ".run.lock"
    assert lock.exists()
    lock.write_text("process 999999999 on a machine long gone")   # its holder is dead: flock holds nothing
    r = train(corpus, out, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    with folder_lock(str(out), refuse_if_busy("--out", str(out))):   # released at the run's end
        pass


def test_a_training_file_with_a_huge_line_is_refused_after_a_megabyte(corpus, tmp_path):
    """A small train.en.gz that inflates to one 256 MB line: refused in one line naming the file and
    line, having read about 1 MB of it (the run's peak memory stays far under the line's size)."""
    import gzip
    bomb = tmp_path / "bomb"
    bomb.mkdir()
    for p in corpus.iterdir():
        (bomb / p.name).write_bytes(p.read_bytes())
    with gzip.open(bomb / "train.en.gz", "wb", compresslevel=1) as f:
        chunk = b"a " * (1 << 20)
        for _ in range(128):
            f.write(chunk)
        f.write(b"\n")
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"))
    # a fresh process runs the training and reports its child's peak memory (RUSAGE_CHILDREN)
    meter = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(r.stderr); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", meter, sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset",
                        "multi30k", "--data-dir", str(bomb), "--preset", "tiny", "--vocab-size", "60", "--device",
                        "cpu", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    code, peak_kb = map(int, r.stdout.split())
    assert code == 2, r.stderr[-2000:]
    assert "train.en.gz:1: a line of over 1,048,576 bytes" in r.stderr and "Traceback" not in r.stderr
    assert peak_kb / 1024 < 256, peak_kb      # the 256 MB line was never held whole


# ----------------------------------------------------------------------------- checkpoint bombs
def _with_entry(src, dst, name, nbytes, in_manifest):
    """A copy of checkpoint `src` with an entry `name` of nbytes zeros (deflated: a few hundred KB
    on disk), listed in the manifest or not."""
    import io
    import zipfile
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(np.load(io.BytesIO(members["__meta__.npy"])).tobytes().decode())
    if in_manifest:
        meta["sha256"][name] = "0" * 64
        buf = io.BytesIO()
        np.save(buf, np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        members["__meta__.npy"] = buf.getvalue()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (nbytes // 8,)})
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for n, data in members.items():
            if n != name + ".npy":     # an entry of that name is replaced
                z.writestr(n, data)
        with z.open(name + ".npy", "w", force_zip64=True) as f:   # streamed: never held whole here
            f.write(header.getvalue())
            zeros = bytes(1 << 20)
            for _ in range(nbytes >> 20):
                f.write(zeros)
    return dst


@pytest.mark.parametrize("name,in_manifest,says", [
    ("param/extra", False, "do not match its manifest"),
    ("param/extra", True, "entry param/extra is no parameter of its model"),
    ("param/embedding.weight", True, "entry param/embedding.weight declares 1,073,741,"),
])
def test_a_checkpoint_with_an_inflating_entry_is_refused_before_reading_it(tiny_checkpoint, tmp_path, name,
                                                                           in_manifest, says):
    """A 1 GiB entry (deflated to about a MB) in a checkpoint: an extra one outside the manifest,
    one listed in it that is no parameter of the model, or a real parameter's entry declaring more
    than that parameter holds: refused from the zip directory, in well under a second, without
    inflating it (reading it all took seconds and a GiB)."""
    import time
    from minitf.checkpoint import load_checkpoint
    path, _ = tiny_checkpoint
    bad = _with_entry(path, tmp_path / "bomb.npz", name, 1 << 30, in_manifest)
    assert os.path.getsize(bad) < 8 << 20
    t = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert time.perf_counter() - t < 0.5
    assert "bomb.npz" in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("gz", [True, False])
def test_a_huge_line_in_a_file_read_whole_is_refused_after_a_megabyte(tmp_path, gz):
    """The validation and test sets, `evaluate --src/--ref` and `translate --input` read their file
    whole: a 64 MB line (a plain file, or a .gz a fraction of a MB) is refused naming the file and
    the line, the lines before it read as usual."""
    import gzip
    from minitf.data.readers import MAX_LINE_BYTES, read_lines
    from minitf.errors import DataError
    body = b"a short line\nanother\n" + b"x" * (64 << 20) + b"\n"
    path = tmp_path / ("val.en.gz" if gz else "val.en")
    if gz:
        with gzip.open(path, "wb", compresslevel=1) as f:
            f.write(body)
    else:
        path.write_bytes(body)
    with pytest.raises(DataError) as e:
        read_lines(path)
    assert f"{path.name}:3: a line of over {MAX_LINE_BYTES:,} bytes" in str(e.value)
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"a\n" + b"y" * MAX_LINE_BYTES + b"\nb")        # exactly the limit: still read
    assert [len(x) for x in read_lines(ok)] == [1, MAX_LINE_BYTES, 1]
    from minitf.data.readers import LineStream                        # and streamed (the training corpus) alike
    assert [len(x) for x in LineStream(ok)] == [1, MAX_LINE_BYTES, 1]
    over = tmp_path / "over.txt"
    over.write_bytes(b"a\n" + b"y" * (MAX_LINE_BYTES + 1) + b"\nb")
    with pytest.raises(DataError, match=f"{over.name}:2: a line of over {MAX_LINE_BYTES:,} bytes"):
        list(LineStream(over))


@pytest.mark.parametrize("arch,extra", [("transformer", {}), ("transformer", {"positional": "learned"}),
                                        ("transformer", {"norm_position": "pre"}), ("rnn", {}),
                                        ("rnn", {"attention": "additive"})])
def test_parameter_shapes_are_the_built_models(arch, extra):
    """architectures.parameter_shapes (what a checkpoint's entries are held to before they are read)
    names exactly the parameters and shapes a built model has, without allocating them."""
    import minitf
    from minitf.architectures import build_model, parameter_shapes
    try:
        cfg = minitf.Config.preset("tiny", arch=arch, vocab_size=50, **extra)
    except minitf.errors.MinitfError as e:
        pytest.skip(f"not a configuration minitf builds: {e}")
    model = build_model(cfg)
    assert parameter_shapes(cfg) == {n: model.view(model.flat_params, n).shape for n in model.names}


def test_out_of_memory_while_decoding_names_the_length_cap_and_long_inputs(monkeypatch, capsys):
    """A MemoryError in translate/evaluate: one line whose advice also names --max-len-b and a
    very long input sentence (lowering the batch or the beam does not help those)."""
    from minitf import cli
    monkeypatch.setattr(cli, "cmd_translate", lambda args: (_ for _ in ()).throw(MemoryError("10 GiB")))
    # the parser binds the command when it is built: rebind translate's to the one that runs out of memory
    monkeypatch.setattr(cli, "build_parser", lambda prog, _p=cli.build_parser: _patched(_p(prog)))
    assert cli.main(["translate", "--checkpoint", "x.npz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0] and "--max-len-b" in err[0] and "long input" in err[0]


def _patched(parser):
    from minitf import cli
    parser._subparsers._group_actions[0].choices["translate"].set_defaults(func=cli.cmd_translate)
    return parser


def test_a_read_error_under_the_cache_bar_starts_a_line_of_its_own(corpus, tmp_path):
    """A training file that breaks while the cache's progress bar runs (stderr in a file or a pipe):
    the error is a line of its own, not glued to the bar's last fragment."""
    import gzip
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in corpus.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    good = gzip.decompress((corpus / "train.en.gz").read_bytes())
    (bad / "train.en.gz").write_bytes(gzip.compress(good)[:-40] + b"\x00" * 40)   # a corrupt end
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir",
                        str(bad), "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out",
                        str(tmp_path / "run"), "--max-steps", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.split("\n") if "error:" in line]
    assert errors and all(line.startswith("error:") for line in errors), repr(r.stderr[-600:])


def test_a_run_that_cannot_compute_the_papers_bleu_says_so_at_its_start(corpus, tmp_path, monkeypatch, capsys):
    """Without sacremoses the paper's tokenized BLEU cannot be reported: the run says so among
    its first lines, before training, not only at the end."""
    import importlib.util
    import minitf.train
    monkeypatch.setattr(minitf.train, "paper_bleu_available", lambda: False)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("train_wmt", os.path.join(ROOT, "train_wmt.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    code = cli.main(["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size", "60",
                     "--device", "cpu", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "1",
                     "--save-every", "1", "--average-last", "1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    note = [i for i, line in enumerate(err) if "sacremoses is not installed" in line]
    started = [i for i, line in enumerate(err) if line.startswith("train:")]
    assert note and started and note[0] < started[0], err[:12]


def test_files_on_real_machines_links_long_names_read_only_folders_and_sigterm(tiny_checkpoint, tmp_path, monkeypatch,
                                                                              capsys):
    """A file written through a link keeps the link (average and export had replaced it with a file, the target left
    as it was); a name near 255 bytes is written (the temporary name had been too long); a link to the run's folder
    takes the folder's lock (two trainings had written one folder); a write refused by the file system is one line
    naming the file (a read-only folder had been a traceback); SIGTERM stops a command as Ctrl-C does, exit 143."""
    import signal
    from minitf import cli, fileio, modelinfo
    ckpt, _ = tiny_checkpoint
    target = tmp_path / "target.npz"
    target.write_bytes(b"")
    os.symlink(target, tmp_path / "link.npz")
    fileio.atomic_write(tmp_path / "link.npz", lambda f: f.write(b"new"))
    assert os.path.islink(tmp_path / "link.npz") and target.read_bytes() == b"new"
    long = tmp_path / ("a" * 246 + ".npz")
    fileio.atomic_write(long, lambda f: f.write(b"x"))
    assert long.read_bytes() == b"x" and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "run", tmp_path / "run_link")
    assert fileio.lock_path(tmp_path / "run_link") == fileio.lock_path(tmp_path / "run")
    assert len(os.path.basename(fileio.lock_path(tmp_path / ("r" * 252)))) < 255

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro"))
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(fileio.tempfile, "mkstemp", refused)
    assert cli.main(["average", "--inputs", str(ckpt), "--output", str(tmp_path / "ro" / "a.npz")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'ro' / 'a.npz'}: cannot write it (Permission denied)\n"
    monkeypatch.undo()

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(modelinfo, "info_lines", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["info", str(ckpt)]) == 143
    assert "interrupted" in capsys.readouterr().err and signal.getsignal(signal.SIGTERM) == before


def test_average_does_not_replace_a_runs_own_model_and_tilde_is_home(tiny_checkpoint, tmp_path, capsys):
    # average --output RUN/model.npz had replaced the model the run's results.json scores; `--out=~/x` had made a
    # folder named `~` (the shell leaves a `~` after `=` as it is)
    from minitf import cli
    from minitf.train_cli import build_parser
    ckpt, _ = tiny_checkpoint
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.npz", "checkpoint_best.npz", "checkpoint_0000004.npz"):
        (run / name).write_bytes(ckpt.read_bytes())
    (run / "config.json").write_text("{}")
    for name in ("model.npz", "checkpoint_best.npz", "checkpoint_0000004.npz"):
        assert cli.main(["average", "--inputs", str(ckpt), "--output", str(run / name)]) == 2
        assert f"is the {name} of the training run in {run}" in capsys.readouterr().err
        assert (run / name).read_bytes() == ckpt.read_bytes()
    # its averaged.npz (results.json names its checkpoints), a new checkpoint_<step>.npz (--resume and info had taken
    # it for the run's, then refused it), a link into the run, a name not *.npz: refused too; another name is taken
    (tmp_path / "link.npz").symlink_to(run / "checkpoint_0000004.npz")
    for out, says in ((run / "averaged.npz", "is a name of the averaged.npz of the training run"),
                      (run / "checkpoint_0000099.npz", "is a name of the checkpoint_0000099.npz of the training run"),
                      (tmp_path / "link.npz", "is the checkpoint_0000004.npz of the training run"),
                      (tmp_path / "avg.pt", "an average is a checkpoint, an .npz file: name it *.npz"),
                      (tmp_path / "new" / "", "is a folder; name the file to write")):
        assert cli.main(["average", "--inputs", str(ckpt), "--output", str(out) + ("/" if out.name == "new" else "")]) == 2
        assert says in capsys.readouterr().err, out
    assert (run / "checkpoint_0000004.npz").read_bytes() == ckpt.read_bytes() and not (run / "averaged.npz").exists()
    assert cli.main(["average", "--inputs", str(ckpt), "--output", str(run / "average_mine.npz")]) == 0
    other = tmp_path / "hf"                  # a folder with a config.json of something else is no run: its names free
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["MarianMTModel"]}')
    assert cli.main(["average", "--inputs", str(ckpt), "--output", str(other / "averaged.npz")]) == 0
    assert build_parser().parse_args(["--out=~/r", "--test", "n=~/t"]).out == os.path.expanduser("~/r")
    assert build_parser().parse_args(["--out", "x", "--test", "n=~/t"]).test == [("n", os.path.expanduser("~/t"))]
    plot = cli.build_parser("minitf").parse_args(["plot", "attention", "--checkpoint", "~/m.npz", "--src", "~/a b",
                                                  "--out", "a.png"])
    assert plot.checkpoint == os.path.expanduser("~/m.npz") and plot.src == "~/a b"   # a sentence stays as written


def test_a_damaged_safetensors_export_is_refused_by_its_digests(tiny_checkpoint, tmp_path):
    # a .safetensors export whose tensor bytes were damaged had loaded, and translated every line as empty
    import minitf
    from minitf.checkpoint import export_safetensors
    ckpt, _ = tiny_checkpoint
    path = tmp_path / "m.safetensors"
    export_safetensors(ckpt, path)
    assert minitf.load(str(path)).translate(["a"]) is not None   # whole: loads
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8                                       # the last tensor's last bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.safetensors: tensor .* does not match the SHA-256 recorded when it "
                                              r"was exported: the file is damaged"):
        minitf.load(str(path))
    # a byte of the tokenizer (base64 in the header) changed: it had translated with other pieces, silently
    export_safetensors(ckpt, path)
    data = bytearray(path.read_bytes())
    at = data.index(b'"tokenizer":"') + len(b'"tokenizer":"') + 200
    data[at] = ord("A") if data[at] != ord("A") else ord("B")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.safetensors: its metadata \(the config, the tokenizer, \.\.\.\) does not "
                                              r"match the SHA-256 recorded when it was exported: the file is damaged"):
        minitf.load(str(path))


def test_an_export_moved_into_its_folder_is_not_cut_by_a_signal(tmp_path, monkeypatch):
    # Ctrl-C between two of an export's renames had left one model's weights beside another's vocabulary (a thread's
    # signal mask did not hold it back: BLAS's thread took the signal); it is now handled once all are in
    import signal
    from minitf import fileio
    made, out = tmp_path / "made", tmp_path / "out"
    made.mkdir()
    for name in "abc":
        (made / name).write_text(name)
    real = os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(fileio.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with fileio.staging_folder(str(out), "staged") as staged:   # a new folder: kept once the files are in
            for name in "abc":
                (made / name).rename(os.path.join(staged, name))
            fileio.move_in(staged, str(out), ["a", "b", "c"])
    assert sorted(os.listdir(out)) == ["a", "b", "c"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_export_refuses_a_link_to_nowhere_and_a_busy_folder_and_clears_a_killed_exports_leftovers(tiny_checkpoint,
                                                                                                       tmp_path):
    # a link to nowhere as --out had been "File exists"; an export killed with SIGKILL had left its staging folders
    # (a hidden one in the folder, and the CTranslate2 export's Marian files in /tmp) for good
    from minitf import fileio
    from minitf.errors import ConfigError, MinitfError
    from minitf.marian import export_marian
    ckpt, _ = tiny_checkpoint
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ConfigError, match=r"--out .*dangling is a link to nowhere \(to .*gone\)"):
        export_marian(str(ckpt), str(tmp_path / "dangling"))
    assert not (tmp_path / "gone").exists()
    out = tmp_path / "out"
    leftover = out / (fileio.STAGING + "ct2-x1y2")
    (leftover / "inner").mkdir(parents=True)
    (leftover / "inner" / "model.npz").write_bytes(b"half")
    (out / "notes.txt").write_text("mine")
    export_marian(str(ckpt), str(out))
    assert sorted(os.listdir(out)) == ["decoder.yml", "model.npz", "notes.txt", "source.spm", "target.spm", "vocab.yml"]
    with fileio.folder_lock(str(out), fileio.refuse_if_busy("--out", str(out))):   # another export writing it
        with pytest.raises(MinitfError, match=r"--out .*out is in use by process \d+"):
            export_marian(str(ckpt), str(out))


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/tmp").st_dev,
                    reason="needs /dev/shm on another file system than /tmp")
def test_an_export_into_a_folder_on_another_file_system(tiny_checkpoint, tmp_path):
    # the export's files are written inside the folder before they are moved in: a link (or a mount) to another
    # file system had failed with "Invalid cross-device link"
    import tempfile
    from minitf.marian import export_marian
    ckpt, _ = tiny_checkpoint
    with tempfile.TemporaryDirectory(dir="/dev/shm") as far:
        os.symlink(far, tmp_path / "link")
        export_marian(str(ckpt), str(tmp_path / "link"))
        assert sorted(os.listdir(far)) == ["decoder.yml", "model.npz", "source.spm", "target.spm", "vocab.yml"]


def test_a_write_the_file_system_refuses_names_the_file_not_stdout(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    # the file-size limit (EFBIG, `ulimit -f`) while average, export or prepare wrote their file had been reported as
    # "writing the output to stdout failed", and while training saved a checkpoint as a traceback
    import errno
    from minitf import cli, fileio
    ckpt, _ = tiny_checkpoint
    real_fsync = os.fsync

    def too_large(fd):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(fileio.os, "fsync", too_large)
    out = tmp_path / "a.npz"
    assert cli.main(["average", "--inputs", str(ckpt), "--output", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {out}: cannot write it (File too large)\n"
    assert cli.main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "m.safetensors")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'm.safetensors'}: cannot write it (File too large)\n"
    monkeypatch.setattr(fileio.os, "fsync", real_fsync)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in [ckpt] if p.parent == tmp_path)   # nothing left


def test_no_space_to_make_the_temporary_file_is_a_full_disk_and_names_stay_utf8(tmp_path, monkeypatch, capsys):
    # a quota or the inodes spent when the temporary file is made had lost the full disk's message; --output's
    # refusal keeps its flag; a long name's temporary name is cut at a character, not inside one
    import errno
    from minitf import cli, fileio

    def quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(fileio.tempfile, "mkstemp", quota)
    with pytest.raises(fileio.DiskFull, match=r"a\.npz: no space left on the device of "):
        fileio.atomic_write(tmp_path / "a.npz", lambda f: f.write(b"x"))
    monkeypatch.undo()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(fileio.tempfile, "mkstemp", refused)
    with pytest.raises(DataError, match=r"^--output \S*out\.txt: cannot write it \(Permission denied\)$"):
        cli._write_text(str(tmp_path / "out.txt"), "text\n")
    monkeypatch.undo()
    seen = []
    real = fileio.tempfile.mkstemp

    def kept(*args, **kwargs):
        seen.append(kwargs["suffix"])
        return real(*args, **kwargs)
    monkeypatch.setattr(fileio.tempfile, "mkstemp", kept)
    fileio.atomic_write(tmp_path / ("\u00e9" * 100 + "x.npz"), lambda f: f.write(b"x"))
    assert seen[0].endswith("x.npz") and len(os.fsencode(seen[0])) <= 40 and seen[0].encode("utf-8")


def test_a_folder_export_under_a_file_says_so(tiny_checkpoint, tmp_path, capsys):
    from minitf import cli
    ckpt, _ = tiny_checkpoint
    (tmp_path / "afile").write_text("")
    for fmt in ("marian", "ctranslate2"):
        assert cli.main(["export", "--checkpoint", str(ckpt), "--format", fmt, "--output", str(tmp_path / "afile" / "m")]) == 2
        assert capsys.readouterr().err == (f"error: --out {tmp_path / 'afile' / 'm'}: {tmp_path / 'afile'} is a file, not "
                                           f"a folder; fix the path\n")


def test_a_folder_whose_parent_cannot_be_written_is_locked_inside(tmp_path, monkeypatch):
    # a run's lock file is beside its --out; where the parent refused it (a mounted volume, a folder an admin made),
    # the run had gone on unlocked, and two trainings in one --out deleted each other's checkpoints
    from minitf import fileio
    from minitf.errors import MinitfError
    out = tmp_path / "run"
    out.mkdir()
    real_open = os.open

    def parent_refuses(path, *args, **kwargs):
        if os.fspath(path) == fileio.lock_path(out):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(fileio.os, "open", parent_refuses)
    with fileio.folder_lock(out, fileio.refuse_if_busy("--out", out)):
        inside = os.path.join(os.path.realpath(out), fileio.INNER_LOCK)
        assert os.path.isfile(inside) and fileio.lock_holder(out) == f"process {os.getpid()} on {platform.node()}"
        with pytest.raises(MinitfError, match=f"--out {out} is in use by process {os.getpid()} .*\\(lock {inside}\\)"):
            with fileio.folder_lock(out, fileio.refuse_if_busy("--out", out)):
                pass
    assert fileio.lock_holder(out) is None


def test_paths_of_bytes_that_are_not_utf8_are_written_and_locked(tmp_path):
    # a folder name of Latin-1 bytes (as a shell's $'\\xe9' makes) had been a UnicodeEncodeError traceback in the
    # lock's name and the temporary file's
    from minitf import fileio
    folder = os.path.join(os.fsdecode(os.fsencode(str(tmp_path))), os.fsdecode(b"lat\xe9n"))
    with fileio.folder_lock(folder, fileio.refuse_if_busy("--out", folder)):
        fileio.atomic_write(os.path.join(folder, os.fsdecode(b"x\xe9" * 120) + ".npz"), lambda f: f.write(b"x"))
    assert os.listdir(os.fsencode(folder)) == [b"x\xe9" * 120 + b".npz"]


def test_a_look_at_a_runs_lock_does_not_refuse_a_start_and_a_pipe_is_no_model(tmp_path):
    # info of a run folder looks at its lock for an instant (fileio.lock_holder): a training start at that instant had
    # been refused as if a run held the folder; a pipe named as a model had blocked the zip reader for good
    import fcntl
    import threading
    import time
    from minitf import fileio
    run = tmp_path / "run"
    run.mkdir()
    with fileio.folder_lock(str(run), fileio.refuse_if_busy("--out", str(run))):
        pass                                                  # the lock file is there, held by nobody
    fd = os.open(fileio.lock_path(str(run)), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)                            # a look in progress
    threading.Thread(target=lambda: (time.sleep(0.08), os.close(fd))).start()
    with fileio.folder_lock(str(run), fileio.refuse_if_busy("--out", str(run))):   # waits out the look
        assert fileio.lock_holder(str(run)) is not None      # and is seen holding it
    fifo = tmp_path / "model.npz"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "minitf", "info", str(fifo)], capture_output=True, text=True, timeout=60,
                       cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2 and "is not a file (a device or a pipe)" in r.stderr, r.stderr
