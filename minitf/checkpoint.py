"""Checkpoints: one `.npz` file (a zip of `.npy` arrays), never pickled, written atomically.

Layout (format version 1), every entry an array loaded with `allow_pickle=False`:
  `__meta__`            uint8, UTF-8 JSON: {"format", "version", "config", "train_state",
                        "has_optimizer", "optimizer_step", "sha256": {entry: hex digest}}
  `param/<name>`        the model parameters under their dotted names (`encoder.layers.0.self_attn.q.weight`, ...; float32 or float64)
  `optim/m/<name>`, `optim/v/<name>`   Adam moments (training checkpoints only)
  `tokenizer`           uint8, the tokenizer's bytes (optional; `to_bytes`: a SentencePiece proto, or an
                        imported Marian model's vocabulary and two protos)
The SHA-256 of every entry is stored in the meta, so a tampered or partly written file is
rejected with a CheckpointError (`load_checkpoint(path, optimizer=False)`, for everything but --resume, neither reads
nor checks Adam's moments). Before any array is read, the zip directory's entries must be
the manifest's and each entry's declared size that of the parameter it holds
(`minitf.architectures.parameter_shapes` of its config): an extra or inflated entry (a zip bomb) is
refused unread. `export_safetensors` writes a checkpoint's parameters (not
Adam's state) as a `.safetensors` file with the config and tokenizer in its metadata
(safetensors.py); `load_checkpoint` reads that back too. Arrays are saved from the host, so a checkpoint written on
a GPU loads on a machine without CuPy and the other way round. Paper 6.1's checkpoint
averaging is `average_checkpoints`.
"""
import base64
import hashlib
import json
import os
import re
import zipfile

import numpy as np

from .backend import to_numpy
from .config import Config, shown
from .errors import CheckpointError, MinitfError, one_line
from .fileio import atomic_write
from .architectures import parameter_shapes

FORMAT, VERSION = "minitf-checkpoint", 1
ZIP_MAGIC = b"PK\x03\x04"   # what every .npz starts with


def _digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save_checkpoint(path, model=None, optimizer=None, tokenizer=None, train_state=None, params=None, config=None):
    """Write a checkpoint atomically. `tokenizer` is the tokenizer's bytes (its `to_bytes`; or None);
    `train_state` is a JSON-serializable dict (step, data position, the dropout masks' position
    `forward_count`, ...: no generator state, the masks are keyed by it).
    Pass `params` + `config` instead of a model to save plain arrays (checkpoint averaging). The file is an .npz:
    `python -m minitf export` writes .safetensors."""
    if os.fspath(path).endswith(".safetensors"):   # (an .npz had been written under that name, then read as damaged)
        raise CheckpointError(f"{path}: save_checkpoint writes an .npz checkpoint; name it *.npz (`python -m minitf "
                              f"export --checkpoint FILE.npz --output {os.fspath(path)}` makes the .safetensors file)")
    if model is not None:
        params, config = model.state_dict(), model.cfg
    elif params is None or config is None:
        raise TypeError("save_checkpoint: give a model, or params and config")
    if tokenizer is not None and hasattr(tokenizer, "to_bytes"):   # a Tokenizer, or its bytes
        tokenizer = tokenizer.to_bytes()
    arrays = {f"param/{n}": to_numpy(a) for n, a in params.items()}
    if optimizer is not None:
        for key in ("m", "v"):
            for n, a in optimizer.state[key].items():
                arrays[f"optim/{key}/{n}"] = to_numpy(a)
    if tokenizer is not None:
        arrays["tokenizer"] = np.frombuffer(bytes(tokenizer), dtype=np.uint8)
    meta = {"format": FORMAT, "version": VERSION, "config": config.to_dict(),
            "train_state": train_state or {}, "has_optimizer": optimizer is not None,
            "optimizer_step": optimizer.step_count if optimizer is not None else None,
            "sha256": {k: _digest(a) for k, a in arrays.items()}}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    atomic_write(path, lambda f: np.savez(f, **arrays), size_hint=sum(a.nbytes for a in arrays.values()),
                 advice="free some space (or keep fewer checkpoints, --keep-last) and run again" if optimizer else None)


class Checkpoint:
    """What load_checkpoint returns: config, params {name: np.ndarray}, optimizer state or
    None, tokenizer bytes or None, train_state dict; has_optimizer: whether the file holds Adam's
    state (read or not)."""

    def __init__(self, path, config, params, optimizer, tokenizer, train_state, has_optimizer=None):
        self.path, self.config, self.params = path, config, params
        self.optimizer, self.tokenizer, self.train_state = optimizer, tokenizer, train_state
        self.has_optimizer = optimizer is not None if has_optimizer is None else has_optimizer

    def build_model(self, device="cpu", dtype="float32"):
        """The model of the checkpoint's config (a Transformer, or the `arch` it names), in eval mode."""
        return built_model(self.config, self.params, device, dtype)


def built_model(config, params, device="cpu", dtype="float32"):
    """The model of `config` with the weights `params`, in eval mode."""
    from .architectures import build_model
    model = build_model(config, device=device, dtype=dtype)
    model.load_state_dict(params)
    return model.eval()


META_LIMIT = 64 << 20   # bytes: the metadata (a JSON manifest) and the tokenizer are far smaller
NPY_HEADER_LIMIT = 4096  # bytes an .npy header may take before an entry's data


def _checked_manifest(path, z):
    """The metadata of an open .npz (NpzFile z), read before any other entry: the entries must be
    the manifest's, and each entry's declared (uncompressed) size that of the parameter it holds
    (architectures.parameter_shapes of the config, in float32 or float64, plus an .npy header), so an
    extra or inflated entry (a zip bomb) is refused at the cost of its directory entry, not of
    inflating it."""
    infos = {name[:-4]: info for name, info in ((i.filename, i) for i in z.zip.infolist()) if name.endswith(".npy")}
    if "__meta__" not in infos:
        if any(_holds_objects(z, info) for info in infos.values()):
            raise CheckpointError(f"{path} is not a minitf checkpoint: it holds pickled (object) arrays, "
                                  f"which minitf never loads")
        raise CheckpointError(f"checkpoint {path} has no metadata: not a minitf checkpoint")
    if infos["__meta__"].file_size > META_LIMIT:
        raise CheckpointError(f"checkpoint {path}: its metadata declares {infos['__meta__'].file_size:,} bytes: "
                              f"not a minitf checkpoint")
    try:
        meta = json.loads(z["__meta__"].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = meta if not isinstance(meta, dict) else f"{meta.get('format')} v{meta.get('version')}"
        raise CheckpointError(f"checkpoint {path}: format {str(got)[:80]}, expected {FORMAT} v{VERSION}")
    sums = meta.get("sha256")
    names = set(z.files) - {"__meta__"}
    if not isinstance(sums, dict) or set(sums) != names or len(infos) != len(z.files):
        raise CheckpointError(f"checkpoint {path}: entries do not match its manifest (tampered or incomplete)")
    try:
        shapes = parameter_shapes(Config.from_dict(meta["config"]))
    except (MinitfError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: bad config ({one_line(e, 200)})") from None
    for name in names:
        size = infos[name].file_size
        if name == "tokenizer":
            fits = size <= META_LIMIT
        else:   # param/<name>, optim/m/<name>, optim/v/<name>: that parameter's elements, float32 or float64
            param = name.split("/", 2)[-1] if name.startswith(("optim/m/", "optim/v/")) else name[len("param/"):]
            if not name.startswith(("param/", "optim/m/", "optim/v/")) or param not in shapes:
                raise CheckpointError(f"checkpoint {path}: entry {name} is no parameter of its model: tampered or "
                                      f"not a minitf checkpoint")
            n = int(np.prod(shapes[param], dtype=np.int64))
            fits = any(0 < size - n * itemsize <= NPY_HEADER_LIMIT for itemsize in (4, 8))
        if not fits:
            raise CheckpointError(f"checkpoint {path}: entry {name} declares {size:,} bytes, not the size of "
                                  f"{'a tokenizer' if name == 'tokenizer' else f'its parameter {shapes[param]}'}: "
                                  f"tampered or not a minitf checkpoint")
    return meta


def _holds_objects(z, info):
    """Whether an .npz entry's .npy header declares an object (pickled) array: its header alone is read."""
    try:
        with z.zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return read(f)[2].hasobject
    except Exception:   # an unreadable header: the full read reports it
        return False


def checkpoint_in(folder):
    """The checkpoint a user most likely meant inside a run's folder: the model the run reported
    (model.npz), else its average, best or newest checkpoint; None if it holds none."""
    for name in ("model.npz", "averaged.npz", "checkpoint_best.npz"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    steps = sorted(n for n in os.listdir(folder) if n.startswith("checkpoint_") and n.endswith(".npz"))
    return os.path.join(folder, steps[-1]) if steps else None


def _same_step(path):
    """"; did you mean FOLDER/checkpoint_0000400.npz?" for a step checkpoint named without its 7 digits
    (checkpoint_400.npz), where that file is there; else ""."""
    m = re.fullmatch(r"checkpoint_0*(\d+)\.npz", os.path.basename(path))
    if m is None:
        return ""
    padded = os.path.join(os.path.dirname(path), f"checkpoint_{int(m.group(1)):07d}.npz")
    return f"; did you mean {padded}? (the step is written in 7 digits)" if os.path.isfile(padded) else ""


def load_checkpoint(path, optimizer=True):
    """Read and verify a checkpoint (.npz, or a .safetensors export); any defect is a
    CheckpointError naming the file. optimizer=False: Adam's moments (two thirds of a training
    checkpoint) are neither read nor checked, and `optimizer` is None (`has_optimizer` still says
    whether the file holds them): for everything but --resume."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inside = checkpoint_in(path)
        raise CheckpointError(f"checkpoint {path} is a folder, not a file"
                              + (f"; did you mean {inside}?" if inside else ""))
    if not os.path.isfile(path):
        if os.path.exists(path):   # a device, a pipe: no file to read a model from
            raise CheckpointError(f"checkpoint {path} is not a file (a device or a pipe): name a model file")
        raise CheckpointError(f"checkpoint {path} does not exist{_same_step(path)}")
    if path.endswith(".safetensors"):
        return _load_safetensors(path)
    meta, arrays = _read_npz(path, lambda k: optimizer or not k.startswith("optim/"))
    sums = meta["sha256"]
    for k, a in arrays.items():
        if _digest(a) != sums[k]:
            raise CheckpointError(f"checkpoint {path}: entry {k} fails its SHA-256 check (tampered or corrupt)")
    try:
        config = Config.from_dict(meta["config"])
    except MinitfError as e:
        raise CheckpointError(f"checkpoint {path}: bad config ({e})") from None
    params = {k[len("param/"):]: a for k, a in arrays.items() if k.startswith("param/")}
    moments = optimizer
    optimizer = None
    if meta.get("has_optimizer") and moments:
        optimizer = {"step": meta["optimizer_step"]}
        for k, a in arrays.items():
            if k.startswith("optim/"):
                _, key, name = k.split("/", 2)
                optimizer[f"{key}.{name}"] = a
    tok = arrays.get("tokenizer")
    return Checkpoint(path, config, params, optimizer, tok.tobytes() if tok is not None else None,
                      meta.get("train_state", {}), bool(meta.get("has_optimizer")))


def role(train_state):
    """What a checkpoint is, from the train_state minitf wrote into it: "average" (average_checkpoints), "reported"
    (a run's model.npz: runfolder.choose_model), "best" (checkpoint_best.npz), or None: a training checkpoint, or
    weights of no run."""
    if "averaged_from" in train_state:
        return "average"
    if "model" in train_state:
        return "reported"
    return "best" if train_state.get("best") else None


def _read_npz(path, wanted):
    """(manifest, {entry: array} of the entries `wanted(name)` takes) of the .npz checkpoint `path`, the manifest read
    and checked first (_checked_manifest); any defect is a CheckpointError naming the file."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            raise CheckpointError(f"{path} is not a minitf checkpoint (those are .npz archives that "
                                  f"train_wmt.py or `python -m minitf average` wrote, or .safetensors exports)")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = _checked_manifest(path, z)   # reads __meta__ alone; every other entry's size is checked first
            return meta, {k: z[k] for k in z.files if k != "__meta__" and wanted(k)}
    except CheckpointError:
        raise
    except ValueError as e:
        if "allow_pickle" in str(e):   # NumPy's advice to load it unsafely: never here
            raise CheckpointError(f"{path} is not a minitf checkpoint: it holds pickled (object) arrays, "
                                  f"which minitf never loads") from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({one_line(e, 200)})") from None
    except Exception as e:   # zip and .npy header errors (BadZipFile, EOFError, OSError, tokenize errors, ...)
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({one_line(e, 200)})") from None


def check_opens(path):
    """CheckpointError (load_checkpoint's) where the .npz checkpoint `path` cannot be opened: a cut file, a damaged
    zip directory or manifest; no array is read or checked (a look at a run's last checkpoint, which --resume takes,
    at the cost of its directory)."""
    _read_npz(os.fspath(path), lambda k: False)


def read_train_state(path):
    """The train_state of a checkpoint from its metadata entry alone (no arrays read, no digests
    checked: for choosing which checkpoints to load); {} if unreadable."""
    if os.fspath(path).endswith(".safetensors"):
        try:
            return _load_safetensors(os.fspath(path)).train_state
        except (OSError, MinitfError):
            return {}
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            return json.loads(z["__meta__"].tobytes().decode()).get("train_state", {})
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
        return {}


def average_checkpoints(paths, output):
    """Parameter-wise mean of several checkpoints (paper 6.1: the last 5), written to `output`
    with the last input's config and tokenizer and no optimizer state. The checkpoints must hold
    the same model (`Config.model_fields`; the training recipe may differ, e.g. a
    resumed run's --max-steps) and tokenizer, each once; `output` must not be one of them, nor named .safetensors."""
    if not paths:
        raise CheckpointError("average: give at least one --inputs checkpoint")
    if os.path.isdir(output):
        raise CheckpointError(f"average: the output {output} is a folder; name the .npz file to write")
    if os.fspath(output).endswith(".safetensors"):
        raise CheckpointError(f"average: the output {output} is named .safetensors, but an average is a .npz "
                              f"checkpoint: name it *.npz (`python -m minitf export` then writes a .safetensors of it)")
    for i, p in enumerate(paths):
        twin = next((q for q in paths[:i] if os.path.exists(p) and os.path.exists(q) and os.path.samefile(p, q)), None)
        if twin is not None:
            raise CheckpointError(f"average: {p} is among the inputs twice{'' if os.fspath(p) == os.fspath(twin) else f' (as {twin})'}; "
                                  f"each checkpoint counts once in the mean")
    for p in paths:
        if os.path.exists(output) and os.path.samefile(p, output):
            raise CheckpointError(f"average: the output {output} is one of the inputs; writing it would replace "
                                  f"that checkpoint (and its optimizer state) by the average: name another output")
    # one checkpoint in memory at a time, its weights alone, into a float64 sum: for `big`'s 20 (213M parameters
    # each, 2.6 GB with Adam's moments) that is the sum and one model, not all 20 checkpoints
    total = first = c = None
    updates = set()   # each input's update size (modelinfo reads it): kept where every input says the same
    for p in paths:
        c = load_checkpoint(p, optimizer=False)
        updates.add(tuple(c.train_state.get(k) for k in UPDATE_STATE))
        if first is None:
            first = (c.path, c.config.model_fields(), {n: a.dtype for n, a in c.params.items()}, c.tokenizer)
            total = {n: a.astype(np.float64) + 0.0 for n, a in c.params.items()}   # 0 + a as sum() began: -0.0 too
            continue
        ours, theirs = first[1], c.config.model_fields()
        diff = [f"{k} {shown(k, theirs[k])} vs {shown(k, ours[k])}" for k in ours if theirs[k] != ours[k]]
        if not diff and set(c.params) != set(total):
            diff = [f"parameters {', '.join(sorted(set(c.params) ^ set(total))[:3])} in one only"]
        if diff:
            raise CheckpointError(f"average: {c.path} has a different model than {first[0]}: {'; '.join(diff)}")
        theirs = {n: a.dtype for n, a in c.params.items()}
        if theirs != first[2]:
            odd = next(n for n in first[2] if theirs[n] != first[2][n])
            raise CheckpointError(f"average: {c.path} holds {theirs[odd]} weights, {first[0]} {first[2][odd]} (as "
                                  f"{odd}): average checkpoints of one precision (the mean would be written in the "
                                  f"first's)")
        if c.tokenizer is not None and first[3] is not None and c.tokenizer != first[3]:
            raise CheckpointError(f"average: {c.path} has another tokenizer than {first[0]}: the same row of the "
                                  f"embedding is another piece in each, so their mean would mix pieces; average "
                                  f"checkpoints of one run (or of runs that share a tokenizer, as --init-from does)")
        for n, a in c.params.items():
            total[n] += a
    recipe = dict(zip(UPDATE_STATE, *updates)) if len(updates) == 1 and None not in next(iter(updates)) else {}
    mean = {n: (s / len(paths)).astype(first[2][n]) for n, s in total.items()}
    save_checkpoint(output, params=mean, config=c.config, tokenizer=c.tokenizer,
                    train_state={"averaged_from": [os.path.abspath(p) for p in paths], **recipe,
                                 **{k: c.train_state[k] for k in ("languages",) if k in c.train_state}})
    return output


UPDATE_STATE = ("batch_tokens", "update_batches")   # a run's update: batches of batch_tokens, update_batches of them
SAFETENSORS_STATE = ("step", "languages", "model", "from", "averaged_from", "best") + UPDATE_STATE   # what an export keeps
# (what `role` reads among them: an exported checkpoint_best.npz is still the best validation's)


def export_safetensors(checkpoint, output):
    """The parameters of a checkpoint (no optimizer state) as a .safetensors file, with its config,
    tokenizer and a few facts of its train_state in the metadata; returns the output's size."""
    from .safetensors import save_safetensors
    ckpt = load_checkpoint(checkpoint, optimizer=False)
    state = {k: ckpt.train_state[k] for k in SAFETENSORS_STATE if k in ckpt.train_state}
    meta = {"format": "minitf", "format_version": str(VERSION), "config": json.dumps(ckpt.config.to_dict()),
            "train_state": json.dumps(state)}
    if ckpt.tokenizer is not None:
        meta["tokenizer"] = base64.b64encode(ckpt.tokenizer).decode()
    meta["sha256"] = json.dumps({name: _digest(a) for name, a in ckpt.params.items()})   # checked on load
    meta["metadata_sha256"] = _metadata_digest(meta)
    save_safetensors(output, ckpt.params, meta)
    return os.path.getsize(output)


def _metadata_digest(meta):
    """The SHA-256 of a .safetensors export's metadata (config, tokenizer, train_state, the tensors' digests, ...),
    every entry but itself: a byte changed in the tokenizer had translated with other pieces, silently."""
    return hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "metadata_sha256"},
                                     sort_keys=True).encode()).hexdigest()


def _load_safetensors(path):
    from .safetensors import load_safetensors
    params, meta = load_safetensors(path)
    if meta.get("format") != "minitf" or "config" not in meta:
        raise CheckpointError(f"{path}: a safetensors file without minitf's metadata (its config and tokenizer); "
                              f"export minitf checkpoints with `python -m minitf export`")
    if "metadata_sha256" in meta and meta["metadata_sha256"] != _metadata_digest(meta):   # (an earlier export has none)
        raise CheckpointError(f"{path}: its metadata (the config, the tokenizer, ...) does not match the SHA-256 "
                              f"recorded when it was exported: the file is damaged; export it again from its checkpoint")
    try:
        config = Config.from_dict(json.loads(meta["config"]))
        state = json.loads(meta.get("train_state", "{}"))
        tok = base64.b64decode(meta["tokenizer"], validate=True) if "tokenizer" in meta else None
    except (ValueError, MinitfError) as e:
        raise CheckpointError(f"{path}: bad minitf metadata ({e})") from None
    if "sha256" in meta:   # an export that recorded its tensors' digests (a damaged file had translated silently)
        try:
            digests = json.loads(meta["sha256"])
            wrong = [name for name, a in params.items() if digests.get(name) != _digest(a)]
        except (ValueError, AttributeError):
            raise CheckpointError(f"{path}: bad minitf metadata (sha256)") from None
        if wrong:
            raise CheckpointError(f"{path}: tensor {wrong[0]}{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''} "
                                  f"does not match the SHA-256 recorded when it was exported: the file is damaged; "
                                  f"export it again from its checkpoint")
    return Checkpoint(path, config, params, None, tok, state)
