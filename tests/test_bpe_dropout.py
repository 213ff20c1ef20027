"""BPE-dropout (--bpe-dropout-source / --bpe-dropout-target): each epoch segments the training
sentences anew, reproducibly from (seed, epoch), so a resumed run is exact."""
import json
import random

import numpy as np
import pytest

from minitf.checkpoint import load_checkpoint
from minitf.data import TokenPairs, Tokenizer
from minitf.data.resegment import POOL, BPEDropout, segment
from conftest import write_multi30k
from test_train import losses, run_train

WORDS = ("translation segmentation regularisation transformer attention multilingual "
         "understanding preprocessing tokenization generalisation").split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=6)) for _ in range(300)]
    return Tokenizer.train(lines, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=80)


def _lines(n=40, seed=1):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=5)) for _ in range(n)]


def _words(tok, line):
    """The plain-BPE pieces of a line, grouped into words."""
    words = []
    for piece in tok.encode([line])[0]:
        text = tok.id_to_piece(piece)
        if text.startswith("\u2581") or not words:
            words.append([])
        words[-1].append(text)
    return words


def test_plain_bpe_is_sentencepieces_segmentation_and_dropout_only_splits_further(tok):
    merges, ids = tok.merges()
    assert merges and all(len(piece) > 1 for piece in merges) and "\u2581" in ids
    rnd = random.Random(0)
    for line in _lines(60):
        for pieces in _words(tok, line):
            word = "".join(pieces)
            assert segment(word, merges, 0.0, None) == pieces           # p 0: SentencePiece's own pieces
            dropped = segment(word, merges, 0.3, rnd.random)
            assert "".join(dropped) == word and all(piece in ids for piece in dropped)
            assert len(dropped) >= len(pieces)
    long = max(merges, key=len)
    counts = {p: np.mean([len(segment(long, merges, p, rnd.random)) for _ in range(300)]) for p in (0.0, 0.1, 0.5)}
    assert counts[0.0] == 1 < counts[0.1] < counts[0.5] <= len(long)   # the more dropout, the smaller the pieces
    assert segment(long, merges, 0.5, lambda: 0.0) == list(long)   # every merge dropped: the characters


def _pairs(tok, n=40):
    return TokenPairs.from_lists(tok.encode(_lines(n, 1)), tok.encode(_lines(n, 2)))


def test_each_epoch_resegments_the_sampled_side_reproducibly(tok):
    pairs = _pairs(tok)
    one, other = BPEDropout(pairs, tok, (0.2, 0.0), seed=3), BPEDropout(pairs, tok, (0.2, 0.0), seed=3)
    e0, e1 = one.epoch(0), one.epoch(1)
    assert one.epoch(1) is e1                                         # the epoch's pairs are kept
    for e, got in ((0, e0), (1, e1)):
        again = other.epoch(e)                                        # another instance (a resumed run)
        np.testing.assert_array_equal(again.src_tokens, got.src_tokens)
        np.testing.assert_array_equal(again.src_lens, got.src_lens)
    assert not np.array_equal(e0.src_lens, e1.src_lens) or not np.array_equal(e0.src_tokens, e1.src_tokens)
    assert e0.tgt_tokens is pairs.tgt_tokens and e0.tgt_lens is pairs.tgt_lens   # p 0: the cache's ids as they are
    words = one.words[0]                                              # POOL segmentations per distinct word
    assert words.pool_len.size == POOL * len(set(words.word_type.tolist())) and one.words[1] is None
    assert one.growth(0)["source"] == e0.src_lens.sum() / pairs.src_lens.sum() > 1.0 and "target" not in one.growth(0)
    for i in range(len(pairs)):                                       # the same sentences, other pieces
        src, tgt = e1.ids(i)
        src0, tgt0 = pairs.ids(i)
        assert tok.decode([src.tolist()]) == tok.decode([src0.tolist()])
        np.testing.assert_array_equal(tgt, tgt0)
    # the collated batch holds the epoch's pieces
    src, tgt_in, tgt_out = e1.collate(np.array([0, 1]))
    assert src[0, :e1.src_lens[0]].tolist() == e1.ids(0)[0].tolist() and src[0, e1.src_lens[0]] == tok.eos_id
    both = BPEDropout(pairs, tok, (0.2, 0.2), seed=3).epoch(0)
    np.testing.assert_array_equal(both.src_tokens, e0.src_tokens)    # a side's stream does not depend on the other's
    assert both.tgt_lens.sum() > pairs.tgt_lens.sum()
    with pytest.raises(ValueError, match="one of them > 0"):
        BPEDropout(pairs, tok, (0.0, 0.0), seed=3)


def _mapped(pairs, folder):
    """`pairs` with its arrays memory-mapped from .npy files, as a cache's are (rows are then read with pread)."""
    sides = []
    for k, side in enumerate(pairs.sides()):
        arrays = []
        for name, a in zip(("tokens", "offsets", "lens"), side):
            np.save(folder / f"{k}_{name}.npy", np.asarray(a))
            arrays.append(np.load(folder / f"{k}_{name}.npy", mmap_mode="r"))
        sides.append(tuple(arrays))
    return TokenPairs(*sides)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_sentence_drawn_longer_than_a_batch_keeps_its_plain_bpe(tok, mapped, tmp_path):
    # a later epoch's draw longer than a batch had stopped the run (and every resume, the draws being the same)
    pairs = _mapped(_pairs(tok), tmp_path) if mapped else _pairs(tok)
    longest = int(max(pairs.src_lens.max(), pairs.tgt_lens.max()))   # the plain segmentation fits
    free = BPEDropout(pairs, tok, (0.5, 0.5), seed=3)
    fit = BPEDropout(pairs, tok, (0.5, 0.5), seed=3, longest=longest)
    assert isinstance(pairs.src_tokens, np.memmap) == mapped
    kept = 0
    for e in range(4):
        drawn, made = free.epoch(e), fit.epoch(e)
        over = [drawn.src_lens > longest, drawn.tgt_lens > longest]
        assert fit.kept_plain[e] == sum(int(o.sum()) for o in over)
        kept += fit.kept_plain[e]
        assert made.src_lens.max() <= longest and made.tgt_lens.max() <= longest
        for i in range(len(pairs)):
            want = [(plain if o[i] else other) for plain, other, o in zip(pairs.ids(i), drawn.ids(i), over)]
            for got, w in zip(made.ids(i), want):
                np.testing.assert_array_equal(got, w)
    assert kept > 0   # (the case happened)


def test_the_training_feed_plans_every_epoch_within_its_batches(tok):
    # the feed's resegmenter is given the batch's tokens less EOS/BOS: a sentence drawn exactly a batch long is a
    # sentence too long (token_batches refuses a length >= max_tokens)
    import types
    from minitf.data.batching import token_batches
    from minitf.feed import bpe_dropout
    pairs = _pairs(tok)
    max_tokens = int(max(pairs.src_lens.max(), pairs.tgt_lens.max())) + 1       # plain BPE fits, just
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(bpe_dropout_source=0.5, bpe_dropout_target=0.5), lead=False,
                                data=types.SimpleNamespace(train=pairs, tokenizer=tok),
                                args=types.SimpleNamespace(seed=3, init_from=None, tokenizer=None), state={"epoch": 0})
    resegment, free = bpe_dropout(run, max_tokens), BPEDropout(pairs, tok, (0.5, 0.5), seed=3)
    exactly = 0
    for e in range(6):
        exactly += int((free.epoch(e).src_lens == max_tokens).sum() + (free.epoch(e).tgt_lens == max_tokens).sum())
        assert token_batches(*resegment.lengths(e), max_tokens, 3, e)
    assert exactly > 0   # (the case happened)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_multi30k(tmp_path_factory.mktemp("m30k"))


def test_training_with_bpe_dropout_resumes_exactly_across_epochs(corpus, tmp_path):
    straight, split, cache = tmp_path / "straight", tmp_path / "split", tmp_path / "cache"
    args = ("--bpe-dropout-source", 0.1, "--bpe-dropout-target", 0.05, "--vocab-size", 120, "--subword", "bpe",
            "--max-tokens", 1024, "--save-every", 5, "--valid-every", 0, "--keep-last", 5, "--average-last", 1)
    r = run_train(corpus, straight, "--max-steps", 15, *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BPE-dropout: source p 0.1, target p 0.05; each epoch segments the training sentences anew" in r.stderr
    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    assert max(rec.get("epoch", 0) for rec in log) > 2                # the resume below crosses epochs
    assert run_train(corpus, split, "--max-steps", 7, *args, cache=cache).returncode == 0
    r = run_train(corpus, split, "--max-steps", 15, "--resume", *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(straight), losses(split)
    assert [a[s] for s in range(8, 16)] == [b[s] for s in range(8, 16)]
    cfg = load_checkpoint(straight / "model.npz").config
    assert (cfg.bpe_dropout_source, cfg.bpe_dropout_target) == (0.1, 0.05)
    plain = tmp_path / "plain"                                         # the same run without it learns from other pieces
    assert run_train(corpus, plain, "--max-steps", 15, *args[4:], cache=cache).returncode == 0
    assert losses(plain)[1] != a[1]
    r = run_train(corpus, split, "--max-steps", 16, "--resume", "--bpe-dropout-source", 0.2, *args[2:], cache=cache)
    assert r.returncode == 2 and "--bpe-dropout-source 0.2: the checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_a_models_user_defined_symbols_stay_whole(tmp_path):
    """A BPE model trained with user_defined_symbols (a <2xx> language tag): SentencePiece matches the symbol whole
    before BPE; no merge builds it, so segmenting its characters anew had split it into <, 2, d, e, > in every epoch
    (the tag was never seen whole in training, and always at translation). It stays whole; the rest of the word
    around it is resegmented as before."""
    import sentencepiece as spm
    rng = np.random.default_rng(0)
    lines = ["<2de> " + " ".join(rng.choice(WORDS, size=5)) for _ in range(200)] + ["a <b> c > d < e 2"] * 20
    (tmp_path / "text").write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text"), model_prefix=str(tmp_path / "m"), vocab_size=90,
                                   model_type="bpe", user_defined_symbols=["<2de>", "ing", "ion"], pad_id=0,
                                   unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, minloglevel=100)
    tok = Tokenizer(str(tmp_path / "m.model"))
    tag = tok.encode(["<2de>"])[0]
    tag = [i for i in tag if tok.id_to_piece(i) == "<2de>"]
    assert tag
    enc = tok.encode(lines[:40])
    pairs = TokenPairs.from_lists(enc, enc)
    drawn = BPEDropout(pairs, tok, (0.3, 0.0), seed=1).epoch(0)
    assert (drawn.src_tokens == tag[0]).sum() == (pairs.src_tokens == tag[0]).sum() == 40
    assert drawn.src_lens.sum() > pairs.src_lens.sum()                # the other words still resegmented
    for i in range(len(pairs)):
        assert tok.decode([drawn.ids(i)[0].tolist()]) == tok.decode([pairs.ids(i)[0].tolist()])
    # symbols merges could also build ("ing" in "understanding", "ion" in "attention"): not merges (their score 0 had ranked them
    # first), so p 0 is SentencePiece's own segmentation, and p > 0 keeps them
    user = {tok.encode([w])[0][-1] for w in ("ing", "ion")}
    assert {tok.id_to_piece(i) for i in user} == {"ing", "ion"}
    merges, ids = tok.merges()
    assert {"<2de>", "ing", "ion"} <= set(ids) and not {"<2de>", "ing", "ion"} & set(merges)
    enc = tok.encode(lines[:200])
    pairs = TokenPairs.from_lists(enc, enc)
    plain = BPEDropout(pairs, tok, (1e-9, 0.0), seed=1).epoch(0)
    np.testing.assert_array_equal(plain.src_tokens, pairs.src_tokens)
    drawn = BPEDropout(pairs, tok, (0.5, 0.0), seed=1).epoch(0)
    for i in user:
        assert (drawn.src_tokens == i).sum() == (pairs.src_tokens == i).sum() > 0
