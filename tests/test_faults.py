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
