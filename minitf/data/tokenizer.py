"""A joint source+target subword tokenizer: a thin wrapper around SentencePiece.

Ids are fixed: pad=0, unk=1, bos=2, eos=3 (minitf's tokenizers, `collate` and the configs' defaults use
these; the model reads its own `pad_id`).
The model is a serialized protobuf (`to_bytes`), so a checkpoint can embed it and
decode without the original file.
"""

import hashlib
import io
import json
import os
import re
import unicodedata
import warnings

import numpy as np
import sentencepiece as spm

from minitf.errors import DataError
from minitf.fileio import atomic_write_bytes
from minitf.data.readers import MAX_LINE_BYTES, read_text

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("bpe", "unigram")   # the subword models Tokenizer.train makes
_PROTO_MODEL_TYPE = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}   # sentencepiece_model.proto TrainerSpec.ModelType
# SentencePiece's trainer splits its work by thread, and what it trains depends on how many (the
# pieces' order and scores, and the TrainerSpec it records): a fixed count makes training repeatable on one
# machine; another machine or SentencePiece build can still train another model (docs/data.md: pass --tokenizer
# to share one). 2: the models behind docs/benchmarks.md's figures.
TRAIN_THREADS = 2


def _varint(buf, i):
    """The protobuf varint at buf[i:], and the index after it."""
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _proto_fields(buf):
    """(field number, value) of a protobuf message's top-level fields: an int for a varint, bytes
    for a length-delimited field (fixed-width fields are skipped over as bytes)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield number, value


def _iter_lines(inputs):
    """Lines from a path, a list of `os.PathLike` paths, or an iterable of strings.

    A plain `str` is a file path; a list/tuple whose items are all `pathlib.Path`
    (or other PathLike) objects is a list of files (plain, .gz or .sgm); a list/tuple
    of at most 64 str that all name existing files is a DataError (they would be read
    as lines); anything else is taken as an iterable of text lines.
    """
    if isinstance(inputs, (str, os.PathLike)):
        files = [inputs]
    elif (isinstance(inputs, (list, tuple)) and inputs
          and all(isinstance(x, os.PathLike) for x in inputs)):
        files = inputs
    else:
        if (isinstance(inputs, (list, tuple)) and 0 < len(inputs) <= 64
                and all(isinstance(x, str) and os.path.isfile(x) for x in inputs)):
            # ['train.en.gz', 'train.de.gz'] would train on those names as text: a tokenizer of a few dozen pieces
            raise DataError(f"{', '.join(inputs)}: these are files, given as str, which is read as lines of text; "
                            f"pass them as pathlib.Path objects to read the files")
        yield from inputs
        return
    for path in files:
        yield from read_text(path)


class Tokenizer:
    """SentencePiece model with pad=0, unk=1, bos=2, eos=3.

    Build one with `Tokenizer(model_path)`, `Tokenizer.from_bytes(b)` or
    `Tokenizer.train(...)`.
    """

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_path=None, *, _proto=None):
        if _proto is None:
            if model_path is None:
                raise TypeError("Tokenizer needs a model path (or use from_bytes)")
            model_path = os.fspath(model_path)
            if not os.path.isfile(model_path):
                raise DataError(f"{model_path}: tokenizer model not found; train one "
                                f"first or check the path")
            with open(model_path, "rb") as f:
                _proto = f.read()
        where = model_path or "tokenizer bytes"
        try:
            self._sp = _processor(_proto)
        except Exception:  # sentencepiece raises RuntimeError/OSError variants (its parser's source line)
            raise DataError(f"{where} is not a SentencePiece model (it does not parse as one); "
                            f"name the .model file SentencePiece wrote") from None
        ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(),
               self._sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise DataError(f"{where}: SentencePiece model has special ids "
                            f"pad,unk,bos,eos={ids}, minitf needs (0, 1, 2, 3); "
                            f"train one with those ids (spm_train --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3, or "
                            f"let minitf train it: leave out --tokenizer)")
        self._proto = bytes(_proto)
        self.model_path = model_path

    @classmethod
    def from_bytes(cls, data):
        """A tokenizer from a serialized model (the bytes `to_bytes` returned)."""
        return cls(_proto=bytes(data))

    def to_bytes(self):
        """The serialized SentencePiece model proto (bytes)."""
        return self._proto

    @property
    def sha256(self):
        """SHA-256 of the serialized model: what a cache or checkpoint records of its tokenizer."""
        return hashlib.sha256(self._proto).hexdigest()

    @property
    def model_type(self):
        """The SentencePiece model: "bpe", "unigram" ("word", "char"), read from the model's
        TrainerSpec (ModelProto field 2, its field 3; unigram when unset, as in SentencePiece)."""
        try:
            for number, spec in _proto_fields(self._proto):
                if number == 2:
                    for field, value in _proto_fields(spec):
                        if field == 3:
                            return _PROTO_MODEL_TYPE.get(value, f"type {value}")
        except (ValueError, IndexError):
            pass
        return "unigram"

    @property
    def vocab_size(self):
        """Number of pieces, special ids included."""
        return self._sp.get_piece_size()

    def encode(self, lines, num_threads=1):
        """list[str] -> list[list[int]] of piece ids, without BOS/EOS; SentencePiece encodes
        the list on `num_threads` threads."""
        if isinstance(lines, str):
            raise TypeError("Tokenizer.encode takes a list of strings")
        return self._sp.encode(list(lines), out_type=int, num_threads=int(num_threads))

    def encode_target(self, lines, num_threads=1):
        """The target side's encode: the same joint model (MarianTokenizer has one per side)."""
        return self.encode(lines, num_threads)

    def encoder_for(self, language):
        """The encode of a corpus side in `language`: the one joint model for either."""
        return self.encode

    def merges(self):
        """({piece: rank} of the BPE merges, {piece: id} of every normal piece). A merge is a piece of
        two or more characters; its rank is its score negated, the order the merges were learnt in:
        SentencePiece's BPE applies the applicable merge of lowest rank first. Unknown and control
        ids are left out, and user-defined symbols are no merges. Only a BPE model has merges: any other is a DataError."""
        if self.model_type != "bpe":
            raise DataError(f"{self.model_path or 'this tokenizer'} is a SentencePiece {self.model_type} model: it has no "
                            f"BPE merges to resegment with (BPE-dropout needs a BPE model: --subword bpe)")
        sp, merges, ids = self._sp, {}, {}
        user = self.user_defined_ids()
        for i in range(sp.get_piece_size()):
            if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i):
                continue
            piece = sp.id_to_piece(i)
            ids[piece] = i
            if len(piece) > 1 and i not in user:   # a user-defined symbol is matched whole, merged from nothing
                merges[piece] = -sp.get_score(i)
        return merges, ids

    def user_defined_ids(self):
        """The ids of the model's user-defined symbols (ModelProto field 1, each piece's type, field 3, USER_DEFINED
        = 4): SentencePiece matches them whole before BPE, and their score 0 is no merge's rank."""
        user = set()
        try:
            i = 0
            for number, piece in _proto_fields(self._proto):
                if number == 1:
                    if any(field == 3 and value == 4 for field, value in _proto_fields(piece)):
                        user.add(i)
                    i += 1
        except (ValueError, IndexError):
            pass
        return user

    def decode(self, id_lists):
        """list[list[int]] -> list[str]; stops at the first EOS, drops pad/bos."""
        out = []
        for ids in id_lists:
            ids = np.asarray(ids).astype(np.int64).ravel().tolist()
            if EOS_ID in ids:
                ids = ids[:ids.index(EOS_ID)]
            out.append(self._sp.decode([i for i in ids if i not in (PAD_ID, BOS_ID)]))
        return out

    def id_to_piece(self, i):
        """The piece string of id `i`."""
        return self._sp.id_to_piece(int(i))

    @classmethod
    def train(cls, input_files_or_lines, model_path, vocab_size, model_type="bpe",
              sample_size=2_000_000, seed=0):
        """Train ONE joint model and write it atomically to `model_path`.

        `input_files_or_lines`: a path (str or PathLike), a list of `pathlib.Path`
        files, or an iterable of text lines (pass source and target text together
        for a joint vocabulary; a list of at most 64 str that all name existing files is
        a DataError: taken as lines, it would train on the names). At most `sample_size` sentences, drawn at random
        with `seed`, are used. If the corpus is too small for `vocab_size`, the
        model is retrained with a soft limit (a smaller vocabulary) and a warning
        says so. `model_type`: "bpe" (byte-pair encoding, the paper's for en-de) or "unigram"
        (Kudo 2018's unigram language model). Returns the Tokenizer.
        """
        if model_type not in MODEL_TYPES:
            raise DataError(f"{model_path}: subword model {model_type!r}: choose one of {', '.join(MODEL_TYPES)}")
        lines = [line for line in _iter_lines(input_files_or_lines) if line.strip()]
        if not lines:
            raise DataError(f"{model_path}: no non-empty text to train the tokenizer "
                            f"on; check the training files")
        options = dict(vocab_size=int(vocab_size), model_type=model_type,
                       pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                       character_coverage=1.0, input_sentence_size=int(sample_size),
                       shuffle_input_sentence=True, minloglevel=100,
                       num_threads=TRAIN_THREADS,
                       # SentencePiece's own default (4,192 bytes) left longer lines out of training without a word:
                       # their characters became <unk>, and a corpus of only such lines failed in its trainer
                       max_sentence_length=MAX_LINE_BYTES)

        def run(**extra):
            spm.set_random_generator_seed(int(seed))
            buf = io.BytesIO()
            spm.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                           model_writer=buf, **options, **extra)
            return buf.getvalue()

        try:
            proto = run()
        except RuntimeError as e:
            small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
            if small or "insert_id(trainer_spec_." in str(e):   # no room for a special piece (unk, bos, eos)
                # below the special pieces SentencePiece says no figure: its characters (as its NFKC normalisation
                # leaves them), "▁" and the four specials
                chars = {c for line in lines for c in unicodedata.normalize("NFKC", line) if not c.isspace()}
                need = int(small.group(2)) if small else len(chars) + 1 + 4
                raise DataError(f"--vocab-size {vocab_size} is too small for this corpus: it needs at least {need} pieces (its "
                                f"characters and the special pieces)") from None
            if "Vocabulary size too high" not in str(e):
                raise DataError(f"SentencePiece training failed: {str(e).splitlines()[-1]}") from None
            proto = run(hard_vocab_limit=False)
            got = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
            m = re.search(r"<= (\d+)", str(e))
            warnings.warn(f"tokenizer: vocab_size={vocab_size} is too large for this "
                          f"corpus{' (max ' + m.group(1) + ')' if m else ''}; trained "
                          f"with a soft limit instead: {got} pieces", stacklevel=2)
        tok = cls.from_bytes(proto)
        atomic_write_bytes(os.fspath(model_path), proto)
        tok.model_path = os.fspath(model_path)
        return tok


def _processor(proto):
    """A SentencePieceProcessor of the model bytes `proto`; ValueError for none (an empty file: SentencePiece takes it
    without a word, then fails inside its first encode, a traceback)."""
    if not proto:
        raise ValueError("an empty SentencePiece model")
    return spm.SentencePieceProcessor(model_proto=proto)


SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")   # the pieces of ids 0-3 (MarianTokenizer)


class MarianTokenizer:
    """The tokenizer of a Marian model (an OPUS-MT folder, minitf.marian): SentencePiece models
    for the source and the target (source.spm, target.spm) split text into pieces, and the
    model's vocabulary numbers them, in minitf's order (pad 0, unk 1, bos 2, eos 3; a piece the
    vocabulary lacks is unk). `encode` is the source side's, `encode_target` the target side's,
    `decode` the target side's. `to_bytes` holds all three for a checkpoint."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    MAGIC = b"minitf-marian-tokenizer\n"
    model_type = "marian"
    model_path = None

    def __init__(self, source_proto, target_proto, pieces, source_language=None):
        self.source_language = source_language   # which side of a corpus source.spm encodes (training sets it)
        self.pieces = list(pieces)
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.source_proto, self.target_proto = bytes(source_proto), bytes(target_proto)
        self._src = _processor(self.source_proto)
        self._tgt = self._src if self.target_proto == self.source_proto else _processor(self.target_proto)

    @classmethod
    def from_files(cls, source_spm, target_spm, pieces):
        protos = []
        for path in (source_spm, target_spm):
            with open(path, "rb") as f:
                protos.append(f.read())
        try:
            return cls(protos[0], protos[1], pieces)
        except Exception:   # sentencepiece's parse errors
            raise DataError(f"{source_spm} or {target_spm} is not a SentencePiece model") from None

    def to_bytes(self):
        """MAGIC, a JSON line {pieces, source and target proto lengths, source_language}, the two protos."""
        head = json.dumps({"pieces": self.pieces, "source": len(self.source_proto), "target": len(self.target_proto),
                           "source_language": self.source_language}, ensure_ascii=False).encode("utf-8")
        return self.MAGIC + head + b"\n" + self.source_proto + self.target_proto

    @classmethod
    def from_bytes(cls, data):
        data = bytes(data)
        head, _, rest = data[len(cls.MAGIC):].partition(b"\n")
        meta = json.loads(head.decode("utf-8"))
        n = meta["source"]
        return cls(rest[:n], rest[n:n + meta["target"]], meta["pieces"], meta.get("source_language"))

    @property
    def sha256(self):
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def vocab_size(self):
        return len(self.pieces)

    LANGUAGE_TOKEN = re.compile(r"\s*(>>[^<>\s]+<<)\s*")   # a multilingual model's target language: >>deu<<

    def _ids(self, sp, lines):
        """Each line's ids; a leading target-language token (`>>deu<<`) that is a piece of the vocabulary is that
        piece, as Marian reads it, not text for SentencePiece to cut up."""
        if isinstance(lines, str):
            raise TypeError("encode takes a list of strings")
        unk, lines = self.unk_id, list(lines)
        heads = []
        for i, line in enumerate(lines):
            m = self.LANGUAGE_TOKEN.match(line)
            heads.append([self.ids[m.group(1)]] if m and m.group(1) in self.ids else [])
            if heads[-1]:
                lines[i] = line[m.end():]
        return [head + [self.ids.get(p, unk) for p in pieces]
                for head, pieces in zip(heads, sp.encode(lines, out_type=str))]

    def encode(self, lines, num_threads=1):
        """Source sentences -> id lists (no EOS)."""
        return self._ids(self._src, lines)

    def encode_target(self, lines, num_threads=1):
        """Target sentences -> id lists (no BOS or EOS)."""
        return self._ids(self._tgt, lines)

    def encoder_for(self, language):
        """The encode of a corpus side in `language`: source.spm's for the source language, target.spm's
        for the other."""
        if self.source_language is None:
            raise DataError("this Marian tokenizer does not know its source language (set source_language)")
        return self.encode if language == self.source_language else self.encode_target

    def decode(self, id_lists):
        """Target id lists -> text; stops at the first EOS, drops pad and <s>."""
        out = []
        for ids in id_lists:
            ids = np.asarray(ids).astype(np.int64).ravel().tolist()
            if self.eos_id in ids:
                ids = ids[:ids.index(self.eos_id)]
            out.append(self._tgt.decode_pieces([self.pieces[i] for i in ids if i not in (self.pad_id, self.bos_id)]))
        return out

    def id_to_piece(self, i):
        return self.pieces[int(i)]

    def merges(self):
        raise DataError("a Marian model's tokenizer has no BPE merges to resegment with: BPE-dropout needs "
                        "minitf's own BPE tokenizer")


def tokenizer_from_bytes(data):
    """The tokenizer a checkpoint or cache holds: minitf's SentencePiece model (Tokenizer), or an
    imported Marian model's (MarianTokenizer)."""
    data = bytes(data)
    if data.startswith(MarianTokenizer.MAGIC):
        return MarianTokenizer.from_bytes(data)
    return Tokenizer.from_bytes(data)
