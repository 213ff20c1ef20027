"""Hostile and broken inputs refused in one line, before any work they would cost.

Each test builds its own tiny fault; together they run in seconds.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from minitf.errors import CheckpointError
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
    from minitf.fileio import folder_lock
    out = tmp_path / "run"
    args = ("--max-steps", 2, "--save-every", 1, "--average-last", 1, "--valid-every", 0)
    with folder_lock(str(out)):
        r = train(corpus, out, *args)
        assert r.returncode == 2 and f"process {os.getpid()}" in r.stderr and "--out" in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    lock = tmp_path / ".run.lock"
    assert lock.exists()
    lock.write_text("process 999999999 on a machine long gone")   # its holder is dead: flock holds nothing
    r = train(corpus, out, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    with folder_lock(str(out)):   # released at the run's end
        pass
