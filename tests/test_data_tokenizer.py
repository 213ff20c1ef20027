"""SentencePiece tokenizer wrapper: training, ids, round trips, caching."""

import os
import random

import pytest

from minitf.data import Tokenizer
from minitf.data.tokenizer import UNK_ID
from minitf.errors import DataError

_EN = "the a cat dog sees runs on under big small red house tree".split()
_DE = "der die das katze hund sieht läuft auf unter groß klein rot haus baum".split()


def _corpus(words, n=300, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
            for _ in range(n)]


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "joint.model"
    tok = Tokenizer.train(_corpus(_EN) + _corpus(_DE, seed=1), path, vocab_size=120)
    return tok, path


def test_special_ids_and_vocab(trained):
    tok, path = trained
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 120
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert os.path.isfile(path)


def test_round_trip(trained):
    tok, _ = trained
    lines = _corpus(_EN, 20, seed=5) + _corpus(_DE, 20, seed=6)
    ids = tok.encode(lines)
    assert all(isinstance(i, int) and 4 <= i < tok.vocab_size for r in ids for i in r)
    assert tok.decode(ids) == lines
    # pad/bos dropped, stops at the first eos
    row = [tok.bos_id] + ids[0] + [tok.eos_id] + ids[1] + [tok.pad_id] * 3
    assert tok.decode([row]) == [lines[0]]


def test_bytes_round_trip(trained, tmp_path):
    tok, path = trained
    data = tok.to_bytes()
    assert isinstance(data, bytes) and data == _read(path)
    again = Tokenizer.from_bytes(data)
    lines = ["der hund sieht die katze", "the red house"]
    assert again.encode(lines) == tok.encode(lines)
    assert Tokenizer(path).encode(lines) == tok.encode(lines)
    with pytest.raises(DataError):
        Tokenizer.from_bytes(b"not a model")
    with pytest.raises(DataError, match="not found"):
        Tokenizer(tmp_path / "missing.model")


def test_too_large_vocab_falls_back_with_warning(tmp_path):
    with pytest.warns(UserWarning, match="too large"):
        tok = Tokenizer.train(_corpus(_EN, 50), tmp_path / "small.model", 5000)
    assert 4 < tok.vocab_size < 5000
    assert tok.decode(tok.encode(["the big dog"])) == ["the big dog"]


def test_lines_longer_than_sentencepieces_default_are_trained_on(tmp_path):
    # SentencePiece leaves out lines over 4,192 bytes by default: their characters had become <unk> (a 5,000-byte
    # line of "x" encoded as 2 pieces), and a corpus of only such lines failed inside SentencePiece's trainer
    lines = _corpus(_EN, 50) + ["q " + "x" * 5000]
    tok = Tokenizer.train(lines, tmp_path / "long.model", 40)
    assert UNK_ID not in tok.encode(["x" * 300])[0]
    with pytest.warns(UserWarning, match="too large"):
        tok = Tokenizer.train(["ab " * 2000] * 20, tmp_path / "only_long.model", 40)
    assert tok.decode(tok.encode(["ab ab"])) == ["ab ab"]


def test_files_named_as_str_in_a_list_are_refused_not_trained_on_as_text(tmp_path):
    import gzip
    from pathlib import Path
    names = []
    for lang, words in (("en", _EN), ("de", _DE)):
        name = str(tmp_path / f"train.{lang}.gz")
        with gzip.open(name, "wt") as f:
            f.write("\n".join(_corpus(words)) + "\n")
        names.append(name)
    with pytest.raises(DataError, match="given as str, which is read as lines of text; pass them as pathlib.Path"):
        Tokenizer.train(names, tmp_path / "t.model", vocab_size=60)
    assert not (tmp_path / "t.model").exists()
    tok = Tokenizer.train([Path(n) for n in names], tmp_path / "t.model", vocab_size=60)   # as Path: the files' text
    assert tok.vocab_size == 60


def test_a_unigram_model_is_trained_when_asked_and_says_so(trained, tmp_path):
    bpe, _ = trained
    uni = Tokenizer.train(_corpus(_EN) + _corpus(_DE, seed=1), tmp_path / "uni.model", vocab_size=50, model_type="unigram")
    assert (bpe.model_type, uni.model_type) == ("bpe", "unigram")   # read from the model's own TrainerSpec
    assert Tokenizer.from_bytes(uni.to_bytes()).model_type == "unigram"
    assert uni.sha256 != bpe.sha256 and (uni.pad_id, uni.unk_id, uni.bos_id, uni.eos_id) == (0, 1, 2, 3)
    lines = _corpus(_EN, 20, seed=5) + _corpus(_DE, 20, seed=6)
    assert uni.decode(uni.encode(lines)) == lines
    merges, _ = bpe.merges()
    assert merges
    with pytest.raises(DataError, match="unigram model: it has no BPE merges.*--subword bpe"):
        uni.merges()
    with pytest.raises(DataError, match="subword model 'word': choose one of bpe, unigram"):
        Tokenizer.train(_corpus(_EN), tmp_path / "word.model", vocab_size=40, model_type="word")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_the_same_text_trains_the_same_model_whatever_the_core_count(model_type, tmp_path, monkeypatch):
    # SentencePiece's result depends on its thread count; the model must not depend on the machine
    lines = _corpus(_EN, 400) + _corpus(_DE, 400, seed=1)
    models = []
    for cores in (1, 2, 16):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        models.append(Tokenizer.train(lines, tmp_path / f"{cores}.model", vocab_size=50, model_type=model_type).to_bytes())
    assert models[0] == models[1] == models[2]
