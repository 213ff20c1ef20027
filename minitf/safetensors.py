"""The safetensors format, written and read without the safetensors package.

A file is: an 8-byte little-endian unsigned header length N, N bytes of UTF-8 JSON (padded with
spaces to a multiple of 8), then the tensors' raw little-endian bytes, one after the other. The
header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets
into the data after the header) and "__metadata__" to a {string: string} dict. minitf's metadata:
"format" ("minitf"), "config" (the TransformerConfig as JSON), "tokenizer" (the SentencePiece
model, base64) and "train_state" (JSON: the step, the languages, ...).
"""
import json
import struct

import numpy as np

from .errors import CheckpointError
from .fileio import atomic_write

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(t): name for name, t in DTYPES.items()}


def save_safetensors(path, tensors, metadata):
    """Write {name: array} and {str: str} metadata to `path` atomically."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        if a.dtype.newbyteorder("=") not in NAMES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {a.dtype}, which safetensors cannot hold")
        header[name] = {"dtype": NAMES[a.dtype.newbyteorder("=")], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())
    atomic_write(path, write, size_hint=8 + len(text) + offset)


def load_safetensors(path):
    """({name: np.ndarray}, metadata) of a safetensors file; a defect is a CheckpointError."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise CheckpointError(f"{path}: too short for a safetensors file ({len(data)} bytes)")
    n = struct.unpack("<Q", data[:8])[0]
    if n > len(data) - 8:
        raise CheckpointError(f"{path}: its header says {n:,} bytes, but the file has {len(data) - 8:,} after the "
                              f"length: truncated or not a safetensors file")
    try:
        header = json.loads(data[8:8 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    body, tensors = memoryview(data)[8 + n:], {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<"), info["shape"], \
                info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: bad header entry {info}") from None
        if not 0 <= begin <= end <= len(body) or end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name}: offsets {begin}..{end} do not fit its shape {shape} "
                                  f"or the file ({len(body):,} bytes of data)")
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    return tensors, metadata
