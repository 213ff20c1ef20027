"""The safetensors format, written and read without the safetensors package.

A file is: an 8-byte little-endian unsigned header length n, n bytes of UTF-8 JSON (padded with
spaces to a multiple of 8), then the tensors' raw little-endian bytes, one after the other. The
header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets
into the data after the header) and "__metadata__" to a {string: string} dict. minitf's metadata:
"format" ("minitf"), "format_version" ("1"), "config" (the Config as JSON), "tokenizer" (the
tokenizer's bytes, base64: a SentencePiece model, or an imported Marian model's vocabulary and two
protos) and "train_state" (JSON: the step, the languages, ...).
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
    body = memoryview(data)[8 + n:]
    entries = _checked_entries(path, header, metadata, len(body))
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    return tensors, metadata


def written_by_minitf(path):
    """Whether the file `path` is a .safetensors file minitf wrote (its header's metadata says format "minitf"),
    read from its header alone; False for any other file, or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(min(n, 1 << 26)).decode()) if n <= 1 << 26 else None
        return isinstance(header, dict) and (header.get("__metadata__") or {}).get("format") == "minitf"
    except (OSError, struct.error, ValueError, AttributeError):
        return False


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _checked_entries(path, header, metadata, body_len):
    """[(name, dtype, shape, begin, end)] of a safetensors header, every field checked BEFORE any
    tensor is read: metadata a {str: str} dict; each entry exactly dtype / shape / data_offsets;
    a known dtype; the shape non-negative ints whose product (in Python's exact integers, so no
    wrap-around) times the item size is the span of the offsets; offsets inside the data; no two
    tensors overlapping. A defect is a CheckpointError naming the file and the tensor."""
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must be a JSON object of strings to strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: tensor {name}: a header entry needs exactly dtype, shape and "
                                  f"data_offsets, got {str(info)[:200]}")
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name}: unknown dtype {str(info['dtype'])[:40]!r} "
                                  f"(known: {', '.join(DTYPES)})")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) or len(shape) > 32:
            raise CheckpointError(f"{path}: tensor {name}: the shape must be a list of non-negative integers, "
                                  f"got {str(shape)[:200]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name}: data_offsets must be two integers, got {str(offsets)[:200]}")
        dtype = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")
        begin, end = offsets
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= body_len or end - begin != count * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name}: offsets {begin}..{end} do not fit its shape {shape} "
                                  f"or the file ({body_len:,} bytes of data)")
        entries.append((name, dtype, tuple(shape), begin, end))
    spans = sorted((begin, end, name) for name, _, _, begin, end in entries if end > begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0} and {n1} overlap (bytes {b1}..{min(e0, e1)})")
    return entries
