"""Marian's model format, both ways: a minitf Transformer written as a Marian model, and a Marian
model (an OPUS-MT folder) read into minitf (docs/interop.md).

Marian's `.npz` holds plain arrays named by layer (`Wemb`, `encoder_l1_self_Wq`, ...,
`decoder_l6_ffn_b2`, `decoder_ff_logit_out_b`) and the settings as YAML text in the entry
`special:model.yml`; the vocabulary is a YAML file {piece: id}. CTranslate2 reads that format
(tested: tests/test_interop.py). The paper's Transformer is Marian's post-norm one; the differences
this module handles:

  positions   Marian lays the sinusoids out as [sin | cos] halves, the paper (and minitf)
              interleaved (sin, cos, sin, ...). A permutation of the model's D coordinates is
              exact for a Transformer (every layer either acts per coordinate, as the
              LayerNorms and the residual sums do, or mixes all of them through a matrix), so
              the arrays are written with their D axis permuted and CTranslate2's table for
              Marian models (the paper's frequencies, in halves) applies exactly; Marian's own
              C++ uses tensor2tensor's frequencies, slightly different (docs/interop.md).
  the start   Marian starts the decoder from a zero vector, minitf from <s>'s embedding. An
              imported model gets a <s> row of zeros (the same start); an exported model's
              <s> row is whatever training made it: CTranslate2 (`ctranslate2_export.py`) is told
              to start from <s>, exactly; Marian itself starts from zeros.
  ids         minitf needs pad 0, unk 1, bos 2, eos 3; Marian's vocabularies put </s> at 0 and
              <unk> at 1 and have no pad or <s>. An import reorders the rows (and adds the
              missing ones as zero rows outside the output vocabulary); an export keeps minitf's
              order (Marian finds </s> and <unk> by name).
  the output  Marian's logits have a bias (`output_bias`); minitf's output vocabulary becomes a
              bias of OUTSIDE (-1e9) on the pieces outside it (their probability is exactly 0).

Every array is read with allow_pickle=False.
"""
import json
import os
import re
import zipfile

import numpy as np

from .data.tokenizer import SPECIALS, MarianTokenizer
from .errors import CheckpointError, ConfigError, one_line
from .fileio import atomic_write, check_export_folder, export_into, move_in, staging_folder

OUTSIDE = -1.0e9        # the logit bias of a piece outside the output vocabulary: exp underflows to 0


# ------------------------------------------------------------------------------ the D permutation
def halves_order(d):
    """[D] Marian's coordinate of each minitf coordinate: the paper's 2k (sin) is Marian's k,
    2k + 1 (cos) is D/2 + k. minitf_array = marian_array[..., halves_order(d)]."""
    order = np.empty(d, dtype=np.int64)
    order[0::2] = np.arange(d // 2)
    order[1::2] = d // 2 + np.arange(d // 2)
    return order


def _names(cfg):
    """[(marian name, minitf name, kind)], kind: 'in' (rows are D), 'out' (columns are D), 'vec'
    (a [D] vector), 'free' (no D axis). Linear weights are [in, out] in both."""
    out = [("Wemb", "embedding.weight", "out")]
    if cfg.positional == "learned":
        out.append(("Wpos", "positional.weight", "out"))

    def attention(mscope, prefix):
        rows = []
        for m, n in (("q", "q"), ("k", "k"), ("v", "v")):
            rows += [(f"{mscope}_W{m}", f"{prefix}.{n}.weight", "in"), (f"{mscope}_b{m}", f"{prefix}.{n}.bias", "free")]
        return rows + [(f"{mscope}_Wo", f"{prefix}.out.weight", "out"), (f"{mscope}_bo", f"{prefix}.out.bias", "vec")]

    def ffn(mscope, prefix):
        return [(f"{mscope}_W1", f"{prefix}.fc1.weight", "in"), (f"{mscope}_b1", f"{prefix}.fc1.bias", "free"),
                (f"{mscope}_W2", f"{prefix}.fc2.weight", "out"), (f"{mscope}_b2", f"{prefix}.fc2.bias", "vec")]

    pre = "_pre" if cfg.norm_position == "pre" else ""

    def norm(mscope, prefix):
        return [(f"{mscope}_ln_scale{pre}", f"{prefix}.weight", "vec"),
                (f"{mscope}_ln_bias{pre}", f"{prefix}.bias", "vec")]

    for i in range(cfg.n_layers):
        m, p = f"encoder_l{i + 1}", f"encoder.layers.{i}"
        out += attention(f"{m}_self", f"{p}.self_attn") + norm(f"{m}_self_Wo", f"{p}.norm1")
        out += ffn(f"{m}_ffn", f"{p}.ffn") + norm(f"{m}_ffn_ffn", f"{p}.norm2")
    for i in range(cfg.n_decoder_layers):
        m, p = f"decoder_l{i + 1}", f"decoder.layers.{i}"
        out += attention(f"{m}_self", f"{p}.self_attn") + norm(f"{m}_self_Wo", f"{p}.norm1")
        out += attention(f"{m}_context", f"{p}.cross_attn") + norm(f"{m}_context_Wo", f"{p}.norm2")
        out += ffn(f"{m}_ffn", f"{p}.ffn") + norm(f"{m}_ffn_ffn", f"{p}.norm3")
    if cfg.norm_position == "pre":
        for stack in ("encoder", "decoder"):
            out += [(f"{stack}_top_ln_scale", f"{stack}.norm.weight", "vec"),
                    (f"{stack}_top_ln_bias", f"{stack}.norm.bias", "vec")]
    return out


def _to_marian(a, kind, inv):
    if kind == "in":
        return a[inv]
    if kind == "out":
        return a[:, inv]
    if kind == "vec":
        return a[inv][None]
    return a[None]


def _from_marian(a, kind, order):
    a = np.asarray(a)
    if kind == "in":
        return a[order]
    if kind == "out":
        return a[:, order]
    a = a.reshape(-1)
    return a[order] if kind == "vec" else a


# ------------------------------------------------------------------------------ export
def marian_config(cfg):
    """{option: value} of Marian's model.yml for a minitf config (the options CTranslate2 and
    Marian read to build the model)."""
    pre = cfg.norm_position == "pre"
    return {
        "type": "transformer", "dim-emb": cfg.d_model, "dim-vocabs": [cfg.vocab_size, cfg.vocab_size],
        "enc-depth": cfg.n_layers, "dec-depth": cfg.n_decoder_layers, "transformer-heads": cfg.n_heads,
        "transformer-dim-ffn": cfg.d_ff, "transformer-ffn-depth": 2, "transformer-ffn-activation": cfg.activation,
        "transformer-decoder-autoreg": "self-attention", "transformer-no-projection": False,
        "transformer-preprocess": "n" if pre else "", "transformer-postprocess": "da" if pre else "dan",
        "transformer-postprocess-top": "n" if pre else "", "transformer-postprocess-emb": "d",
        "transformer-tied-layers": [], "transformer-guided-alignment-layer": "last",
        "transformer-train-position-embeddings": cfg.positional == "learned",
        "tied-embeddings-all": True, "tied-embeddings-src": False, "tied-embeddings": False,
        "max-length": cfg.max_len, "layer-normalization": False, "right-left": False,
        "minitf-decoder-start": "<s>", "minitf-layer-norm-eps": cfg.layer_norm_eps,
    }


def _yaml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):   # 1e-05 -> 1.0e-05: YAML 1.1 readers (PyYAML) need the dot to see a float
        text = repr(v)
        return text.replace("e", ".0e") if "e" in text and "." not in text else text
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def dump_yaml(options):
    """Flat YAML (`key: value`, flow lists), as Marian writes model.yml."""
    return "".join(f"{k}: {_yaml_value(v)}\n" for k, v in options.items())


def dump_vocab(pieces):
    """Marian's vocabulary YAML: one `"piece": id` a line, in id order (double-quoted, backslash
    escapes: what yaml-cpp and CTranslate2's reader both take)."""
    return "".join(f"{json.dumps(p, ensure_ascii=False)}: {i}\n" for i, p in enumerate(pieces))


def marian_arrays(cfg, params, languages=None):
    """{marian name: array} of a minitf Transformer's parameters (float32), the config (and the languages, where
    known) in `special:model.yml`."""
    if cfg.arch != "transformer":
        raise CheckpointError(f"the {cfg.arch!r} model has no Marian or CTranslate2 counterpart here: only the "
                              f"Transformer exports to them (.safetensors takes any minitf model)")
    if cfg.d_k * cfg.n_heads != cfg.d_model:
        raise CheckpointError(f"d_k {cfg.d_k} x {cfg.n_heads} heads is not d_model {cfg.d_model}: Marian's "
                              f"attention needs H * K = D")
    if cfg.d_model % 2:
        raise CheckpointError(f"d_model {cfg.d_model} is odd: the sinusoids need an even width")
    inv = np.argsort(halves_order(cfg.d_model))
    out = {m: _to_marian(np.asarray(params[n], dtype=np.float32), kind, inv) for m, n, kind in _names(cfg)}
    bias = np.asarray(params["embedding.bias"], dtype=np.float32) if cfg.output_bias else \
        np.zeros(cfg.vocab_size, dtype=np.float32)
    ids = cfg.output_ids()
    if ids is not None:
        outside = np.ones(cfg.vocab_size, dtype=bool)
        outside[ids] = False
        bias = np.where(outside, np.float32(OUTSIDE), bias)
    out["decoder_ff_logit_out_b"] = bias[None]
    options = dict(marian_config(cfg), **({"minitf-languages": list(languages)} if languages else {}))
    out["special:model.yml"] = np.frombuffer(dump_yaml(options).encode() + b"\0", dtype=np.int8)
    return out


def checkpoint_model(checkpoint):
    """(config, params, tokenizer, languages) of a model to export: a minitf checkpoint, or a Marian model (an OPUS-MT
    folder, or minitf's own Marian export: import_marian); languages [src, tgt] where the file records them, else
    None. CheckpointError without a tokenizer."""
    refuse_unreadable(checkpoint)
    if is_marian(checkpoint):
        return import_marian(checkpoint)
    from .checkpoint import load_checkpoint
    from .data.tokenizer import tokenizer_from_bytes
    ckpt = load_checkpoint(checkpoint, optimizer=False)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"{checkpoint} has no tokenizer inside: a Marian model needs its vocabulary")
    return ckpt.config, ckpt.params, tokenizer_from_bytes(ckpt.tokenizer), ckpt.train_state.get("languages")


def export_marian(checkpoint, out_dir):
    """Write the checkpoint as a Marian model folder in OPUS-MT's layout: model.npz, vocab.yml,
    source.spm and target.spm (the checkpoint's SentencePiece model) and decoder.yml. Returns
    the files written."""
    with export_into(out_dir):
        return write_marian(*checkpoint_model(checkpoint), out_dir)


def write_marian(cfg, params, tokenizer, languages, out_dir):
    """Write a model's config, parameters {name: array}, tokenizer (minitf's Tokenizer, or the MarianTokenizer of an
    imported model) and languages ([src, tgt], or None: recorded in model.yml as minitf-languages) as a Marian model
    folder (export_marian; an export holds the folder with fileio.export_into)."""
    arrays = marian_arrays(cfg, params, languages)
    pieces = [tokenizer.id_to_piece(i) for i in range(cfg.vocab_size)]
    if tuple(pieces[:4]) != SPECIALS:   # a tokenizer of the user's, its ids right but its names other
        named = ", ".join(f"{p} ({i})" for i, p in enumerate(pieces[:4]))
        raise ConfigError(f"the model's tokenizer names its special pieces {named}: Marian, and CTranslate2 through "
                          f"its Marian converter, find the end of a sentence and the unknown piece by the names "
                          f"{', '.join(SPECIALS)} (an export would not be read back); export as .safetensors, or "
                          f"train the tokenizer with SentencePiece's default piece names")
    if isinstance(tokenizer, MarianTokenizer):
        src_spm, tgt_spm = tokenizer.source_proto, tokenizer.target_proto
    else:
        src_spm = tgt_spm = tokenizer.to_bytes()
    files = {"model.npz": lambda f: np.savez(f, **arrays),
             "vocab.yml": lambda f: f.write(dump_vocab(pieces).encode("utf-8")),
             "source.spm": lambda f: f.write(src_spm),
             "target.spm": lambda f: f.write(tgt_spm),
             "decoder.yml": lambda f: f.write(dump_yaml({"models": ["model.npz"], "vocabs": ["vocab.yml", "vocab.yml"],
                                                         "beam-size": 4, "normalize": cfg.decode_alpha,
                                                         "relative-paths": True}).encode())}   # as OPUS-MT's
    check_export_folder(out_dir, files, is_minitf_export, "Marian model")
    with staging_folder(out_dir, "marian") as made:   # written whole, then moved in
        for name, write in files.items():
            atomic_write(os.path.join(made, name), write)
        move_in(made, out_dir, files)
    return [os.path.join(out_dir, n) for n in files]


def starts_from_zeros(params):
    """Whether the decoder's first input, <s>'s embedding, is a zero vector as Marian's start is (a model imported from
    Marian and not fine-tuned): then Marian's own readers translate the export exactly."""
    return not np.any(np.asarray(params["embedding.weight"])[SPECIALS.index("<s>")])


def recorded_languages(options):
    """[src, tgt] of model.yml's minitf-languages (a minitf export records its model's), else None."""
    pair = options.get("minitf-languages")
    ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) and x for x in pair)
    return list(pair) if ok else None


# ------------------------------------------------------------------------------ reading YAML
def _scalar(text):
    t = text.strip()
    if not t:
        return ""
    if t[0] in "\"'":
        if t[0] == "'":
            return t[1:-1].replace("''", "'")
        try:
            return _double_quoted(t)
        except ValueError:   # not YAML's double quoting after all: the text between the quotes
            return t[1:-1]
    if t[0] == "[":
        inner = t[1:-1].strip()
        return [_scalar(x) for x in inner.split(",")] if inner else []
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def load_yaml(text):
    """The flat YAML Marian writes (model.yml, decoder.yml): `key: value`, flow lists `[a, b]`
    and block lists (`key:` then `  - item` lines). Enough for these files without PyYAML."""
    out, key = {}, None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.lstrip().startswith("- ") and key is not None:
            out.setdefault(key, [])
            if not isinstance(out[key], list):
                out[key] = []
            out[key].append(_scalar(line.lstrip()[2:]))
            continue
        k, sep, v = line.partition(":")
        if not sep:
            continue
        key = k.strip()
        out[key] = _scalar(v) if v.strip() else []
    return out


# YAML's escapes in a double-quoted scalar (YAML 1.2, 5.7) beside JSON's: yaml-cpp, which writes Marian's vocabularies,
# writes U+0080..U+00A0 and control characters as \xNN
_YAML_ESCAPES = {"0": "\0", "a": "\a", "b": "\b", "t": "\t", "\t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r",
                 "e": "\x1b", " ": " ", '"': '"', "/": "/", "\\": "\\", "N": "\x85", "_": "\xa0", "L": "\u2028",
                 "P": "\u2029"}
_YAML_ESCAPE = re.compile(r'\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)')


def _double_quoted(text):
    """The string a YAML double-quoted scalar ("...", quotes included) stands for; ValueError if it is not one."""
    if len(text) < 2 or text[-1] != '"':
        raise ValueError("no closing quote")

    def one(m):
        e = m.group(1)
        if e[0] in "xuU" and len(e) > 1:
            return chr(int(e[1:], 16))
        if e not in _YAML_ESCAPES:
            raise ValueError(f"unknown escape \\{e}")
        return _YAML_ESCAPES[e]
    out = _YAML_ESCAPE.sub(one, text[1:-1])
    return out.encode("utf-16", "surrogatepass").decode("utf-16")   # a pair of \u escapes: one character


def load_vocab(path):
    """A Marian vocabulary (YAML {piece: id} a line, or JSON, which Marian reads as YAML too) -> [piece] in id order."""
    pieces = {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            size = len(f.read())
        if e.start >= size - 3 and e.reason == "unexpected end of data":   # text whose last character was cut
            raise CheckpointError(f"{path}: cut short inside a character at byte {e.start:,} of {size:,} (a copy or "
                                  f"download that stopped part-way?); get the vocabulary again") from None
        raise CheckpointError(f"{path}: not a YAML vocabulary (binary: a SentencePiece model?); minitf reads Marian's "
                              f"vocabulary as .yml, 'piece: id' a line, or .json") from None
    if text.lstrip().startswith("{"):   # a .json vocabulary: one object
        try:
            mapping = json.loads(text)
            pieces = {int(i): str(p) for p, i in mapping.items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a JSON vocabulary {{piece: id}} ({one_line(e)})") from None
        text = ""
    for n, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        piece, sep, idx = line.rpartition(":")
        try:
            i = int(idx)
            piece = piece.strip()
            if piece[:1] == '"':
                piece = _double_quoted(piece)
            elif piece[:1] == "'":
                piece = piece[1:-1].replace("''", "'")
        except ValueError:
            raise CheckpointError(f"{path}:{n}: not a vocabulary line ('piece: id'): {line[:60]!r}") from None
        pieces[i] = piece
    if sorted(pieces) != list(range(len(pieces))):
        raise CheckpointError(f"{path}: the ids are not 0..{len(pieces) - 1}")
    return [pieces[i] for i in range(len(pieces))]


# ------------------------------------------------------------------------------ import
# options minitf reads, and the values it can build; anything else set differently is refused
REQUIRED = {"type": ("transformer",), "transformer-decoder-autoreg": ("self-attention",),
            "transformer-ffn-activation": ("relu", "swish"), "transformer-ffn-depth": (2,),
            "transformer-no-projection": (False,), "transformer-tied-layers": ([],),
            "transformer-postprocess-emb": ("d", ""), "right-left": (False,), "lemma-dim-emb": (0,),
            "transformer-aan-depth": (2,), "factors-combine": ("sum",),
            "transformer-decoder-ffn-depth": (0, 2)}   # 0: the encoder's depth (it had loaded a depth 3 as garbage)


def marian_files(path):
    """(model .npz, [vocabulary .yml], source .spm, target .spm) of a Marian model folder (OPUS-MT's
    layout: decoder.yml names the model and vocabularies) or of its .npz."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if os.path.isdir(path):
        decoder = os.path.join(path, "decoder.yml")
        if os.path.isfile(decoder):
            with open(decoder, encoding="utf-8") as f:
                conf = load_yaml(f.read())
            try:
                model = os.path.join(folder, conf["models"][0])
                vocabs = [os.path.join(folder, v) for v in conf["vocabs"]]
            except (KeyError, IndexError, TypeError):
                raise CheckpointError(f"{decoder}: expected the lists 'models' (the .npz) and 'vocabs' (the vocabulary "
                                      f".yml), as OPUS-MT's decoder.yml gives them") from None
        else:
            npz = sorted(n for n in os.listdir(path) if n.endswith(".npz"))
            if len(npz) != 1:
                raise CheckpointError(f"{path}: a Marian model folder holds decoder.yml or one .npz file, found "
                                      f"{len(npz)} .npz files and no decoder.yml")
            model = os.path.join(path, npz[0])
            vocabs = None
    else:
        model, vocabs = path, None
    if vocabs is None:
        ymls = sorted(n for n in os.listdir(folder) if n.endswith((".yml", ".json")) and "vocab" in n)
        if not ymls:
            raise CheckpointError(f"{folder}: no vocabulary (*vocab*.yml or *vocab*.json) beside "
                                  f"{os.path.basename(model)}")
        vocabs = [os.path.join(folder, ymls[0])]
    spms = [os.path.join(folder, n) for n in ("source.spm", "target.spm")]
    for f in [model] + vocabs + spms:
        if not os.path.isfile(f):
            raise CheckpointError(f"{folder}: {os.path.basename(f)} is missing (a Marian model folder as OPUS-MT "
                                  f"distributes it: the .npz, the vocabulary .yml, source.spm and target.spm)")
    return model, vocabs, spms[0], spms[1]


def is_ctranslate2(folder):
    """Whether `folder` holds a CTranslate2 model (its model.bin: minitf writes no file of that name)."""
    return os.path.isfile(os.path.join(folder, "model.bin"))


def refuse_unreadable(path):
    """A CheckpointError, before a model file is read, for what looks like a model but is none minitf reads: a
    CTranslate2 model (a folder, or its model.bin), which minitf writes but does not read, and a folder of several
    Marian .npz files without a decoder.yml to say which is the model."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) if os.path.basename(path) == "model.bin" else None
    if folder is not None and is_ctranslate2(folder):
        raise CheckpointError(f"{path} is a CTranslate2 model: minitf writes that format (export --format ctranslate2) "
                              f"but reads its own checkpoints and Marian models; translate it with ctranslate2 "
                              f"(docs/interop.md), or name the minitf checkpoint it was exported from")
    if os.path.isdir(path) and not is_marian(path):
        npz = [n for n in os.listdir(path) if n.endswith(".npz")]
        if len(npz) > 1 and any(is_marian(os.path.join(path, n)) for n in npz):
            marian_files(path)   # raises: it names what a Marian folder holds


def is_marian(path):
    """Whether `path` is a Marian model: a folder with decoder.yml or a .npz with special:model.yml."""
    if os.path.isdir(path):
        npz = [n for n in os.listdir(path) if n.endswith(".npz")]
        return os.path.isfile(os.path.join(path, "decoder.yml")) or (
            len(npz) == 1 and is_marian(os.path.join(path, npz[0])))
    if not os.path.isfile(path):   # a pipe would block the zip reader until something wrote to it
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return "special:model.yml.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def is_minitf_export(folder):
    """Whether `folder` holds a Marian model minitf wrote (write_marian): its decoder.yml names a model.npz whose
    model.yml carries minitf's own option (minitf-decoder-start). Another model's files (an OPUS-MT folder) are not."""
    try:
        model, _, _, _ = marian_files(folder)
        with zipfile.ZipFile(model) as z, z.open("special:model.yml.npy") as f:
            return b"minitf-decoder-start" in f.read()
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, CheckpointError):
        return False


def read_marian_npz(path):
    """{name: array} of a Marian .npz and its model.yml options."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:   # EOFError: an empty file
        raise CheckpointError(f"{path}: not a readable .npz file ({one_line(e) or type(e).__name__})") from None
    if "special:model.yml" not in arrays:
        raise CheckpointError(f"{path}: no special:model.yml entry: not a Marian model")
    text = arrays.pop("special:model.yml").tobytes().rstrip(b"\0").decode("utf-8")
    return arrays, load_yaml(text)


def _check_options(options, where):
    for key, allowed in REQUIRED.items():
        if key in options and options[key] not in allowed:
            raise CheckpointError(f"{where}: Marian option --{key} {options[key]!r} is not supported by minitf "
                                  f"(it builds {' or '.join(map(repr, allowed))})")
    ffn, dec_ffn = options.get("transformer-dim-ffn"), options.get("transformer-decoder-dim-ffn", 0)
    if dec_ffn and dec_ffn != ffn:
        raise CheckpointError(f"{where}: Marian option --transformer-decoder-dim-ffn {dec_ffn} (the encoder's "
                              f"--transformer-dim-ffn {ffn}) is not supported by minitf (one feed-forward width)")
    pre, post = options.get("transformer-preprocess", ""), options.get("transformer-postprocess", "dan")
    top = options.get("transformer-postprocess-top", "")
    if (pre, post, top) not in (("", "dan", ""), ("n", "da", "n")):
        raise CheckpointError(f"{where}: Marian options --transformer-preprocess {pre!r} --transformer-postprocess "
                              f"{post!r} --transformer-postprocess-top {top!r} are not supported by minitf (it builds "
                              f"the post-norm '' dan '' and the pre-norm n da n)")
    return "pre" if pre == "n" else "post"


def _length_penalty(path):
    """{"decode_alpha": decoder.yml's normalize} where a Marian folder's decoder.yml gives one in minitf's range, else {}
    (Config's 0.6). Marian divides a score by |Y|^normalize, minitf by GNMT's ((5 + |Y|) / 6)^alpha: one number, two
    rules; export_marian writes the model's alpha there, so a model exported and read back searches as before. The
    folder's .npz named alone takes the decoder.yml beside it that names it (it had searched with 0.6)."""
    from .flags import MAX_ALPHA
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    try:
        with open(os.path.join(folder, "decoder.yml"), encoding="utf-8") as f:
            conf = load_yaml(f.read())
        value = conf.get("normalize")
        if not os.path.isdir(path) and os.path.basename(path) not in [os.path.basename(str(m)) for m in conf["models"]]:
            return {}   # a decoder.yml of another model in the folder
    except (OSError, TypeError, AttributeError, KeyError, CheckpointError):
        return {}
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_ALPHA
    return {"decode_alpha": float(value)} if ok else {}


def import_marian(path):
    """(Config, {minitf name: float32 array}, MarianTokenizer, languages) of a Marian model; languages [src, tgt] where
    its model.yml records them (minitf's exports), else None."""
    from .config import Config, id_ranges
    model_path, vocab_paths, src_spm, tgt_spm = marian_files(path)
    arrays, options = read_marian_npz(model_path)
    norm = _check_options(options, model_path)
    pieces = load_vocab(vocab_paths[0])
    if len(vocab_paths) > 1 and load_vocab(vocab_paths[-1]) != pieces:
        raise CheckpointError(f"{model_path}: separate source and target vocabularies; minitf ties one joint "
                              f"vocabulary (Marian's --tied-embeddings-all)")
    emb = arrays.get("Wemb")
    if emb is None:
        enc, dec = arrays.get("encoder_Wemb"), arrays.get("decoder_Wemb")
        if enc is None or dec is None or not np.array_equal(enc, dec):
            raise CheckpointError(f"{model_path}: separate source and target embeddings; minitf ties them "
                                  f"(Marian's --tied-embeddings-all)")
        emb = enc
    for name in ("decoder_ff_logit_out_W", "decoder_ff_logit_out_Wt"):   # legacy Marian's, and today's transposed one
        if name in arrays:
            raise CheckpointError(f"{model_path}: an output layer of its own ({name}); minitf ties it to the "
                                  f"embedding (Marian's --tied-embeddings-all)")
    if len(pieces) != emb.shape[0]:
        raise CheckpointError(f"{vocab_paths[0]}: {len(pieces):,} pieces, but the embedding of {model_path} has "
                              f"{emb.shape[0]:,} rows: not this model's vocabulary")
    for name in ("</s>", "<unk>"):
        if name not in pieces:
            raise CheckpointError(f"{vocab_paths[0]}: no {name} piece")
    v_marian, d = emb.shape
    start = options.get("minitf-decoder-start") == "<s>" and "<s>" in pieces
    pick = {"<pad>": pieces.index("<pad>") if "<pad>" in pieces else None, "<unk>": pieces.index("<unk>"),
            "<s>": pieces.index("<s>") if start else None, "</s>": pieces.index("</s>")}
    special_rows = {r for r in pick.values() if r is not None}
    rows = [pick[s] for s in SPECIALS] + [i for i in range(v_marian) if i not in special_rows]   # minitf id -> Marian's
    n_layers = int(options.get("enc-depth", 6))
    n_dec = int(options.get("dec-depth", 6))
    heads = int(options.get("transformer-heads", 8))
    d_ff = int(options.get("transformer-dim-ffn", arrays["encoder_l1_ffn_W1"].shape[1]))
    learned = bool(options.get("transformer-train-position-embeddings", False))
    bias = arrays.get("decoder_ff_logit_out_b", np.zeros((1, v_marian), dtype=np.float32)).reshape(-1)
    inside = [i for i, r in enumerate(rows) if r is not None and bias[r] > OUTSIDE / 10]   # the output vocabulary
    logit_bias = np.zeros(len(rows), dtype=np.float32)
    logit_bias[inside] = bias[[rows[i] for i in inside]]
    output_vocab = None if len(inside) == len(rows) else id_ranges(inside)
    max_len = int(options.get("max-length", 1024)) if not learned else arrays["Wpos"].shape[0]
    cfg = Config(vocab_size=len(rows), d_model=d, n_heads=heads, d_ff=d_ff, n_layers=n_layers, n_decoder_layers=n_dec,
                 norm_position=norm, positional="learned" if learned else "sinusoidal", max_len=max(max_len, 16),
                 activation=options.get("transformer-ffn-activation", "relu"), output_bias=bool(np.any(logit_bias)),
                 output_vocab=output_vocab, layer_norm_eps=float(options.get("minitf-layer-norm-eps", 1e-6)),
                 **_length_penalty(path))
    order = halves_order(d)
    table = np.zeros((len(rows), d), dtype=np.float32)
    for i, r in enumerate(rows):
        if r is not None:
            table[i] = emb[r]
    params = {"embedding.weight": table[:, order]}
    if cfg.output_bias:
        params["embedding.bias"] = logit_bias
    used = set()
    for mname, name, kind in _names(cfg):
        if name in params:
            continue
        if mname not in arrays:
            raise CheckpointError(f"{model_path}: no {mname} array (the model.yml describes a {n_layers}+{n_dec}-layer "
                                  f"{norm}-norm Transformer)")
        used.add(mname)
        params[name] = _from_marian(arrays[mname], kind, order).astype(np.float32)
    unbuilt = sorted(n for n in arrays if n.startswith(("encoder_l", "decoder_l")) and n not in used)
    if unbuilt:   # a layer's weight minitf has no place for: the model would load as another one, translating garbage
        raise CheckpointError(f"{model_path}: {', '.join(unbuilt[:3])}{' ...' if len(unbuilt) > 3 else ''}: weights "
                              f"of a layer minitf does not build (the model.yml describes a {n_layers}+{n_dec}-layer "
                              f"{norm}-norm Transformer with two-layer feed-forwards)")
    tokenizer = MarianTokenizer.from_files(src_spm, tgt_spm, [pieces[r] if r is not None else s for r, s in
                                                             zip(rows, list(SPECIALS) + [None] * (len(rows) - 4))])
    return cfg, params, tokenizer, recorded_languages(options)
