"""Bidirectional training (--bidirectional-epochs): the first epochs train on the pairs in both
directions, then on source -> target alone; a resumed run sees the pairs an uninterrupted one does."""
import json
import re

import numpy as np
import pytest

from minitf.checkpoint import load_checkpoint
from minitf.config import ConfigError, Config
from minitf.data import TokenPairs, open_cache
from minitf.data.bidirectional import Bidirectional, BothWays
from conftest import write_multi30k
from test_train import losses, run_train


def _lists(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 50, size=rng.integers(1, 9)).tolist() for _ in range(n)]


def _check_both_ways(pairs, idx):
    """BothWays(pairs).collate(idx) is TokenPairs.collate of the pairs written out in both directions."""
    n = len(pairs)
    src = [pairs.ids(i)[0].tolist() for i in range(n)]
    tgt = [pairs.ids(i)[1].tolist() for i in range(n)]
    written = TokenPairs.from_lists(src + tgt, tgt + src)
    both = BothWays(pairs)
    assert len(both) == 2 * n
    np.testing.assert_array_equal(both.src_lens, written.src_lens)
    np.testing.assert_array_equal(both.tgt_lens, written.tgt_lens)
    for got, want in zip(both.collate(idx, 0, 2, 3), written.collate(idx, 0, 2, 3)):
        np.testing.assert_array_equal(got, want)


def test_both_ways_are_the_pairs_then_the_pairs_reversed_in_any_order():
    pairs = TokenPairs.from_lists(_lists(30, 1), _lists(30, 2))
    rng = np.random.default_rng(0)
    for idx in (np.arange(60), rng.permutation(60)[:17], np.array([45, 3, 30, 29, 59, 0]), np.array([31, 40]),
                np.array([7])):
        _check_both_ways(pairs, idx)
    src, tgt_in, tgt_out = BothWays(pairs).collate(np.array([30 + 4]))   # pair 4 reversed: its target reads
    assert src[0, :-1].tolist() == pairs.ids(4)[1].tolist() and src[0, -1] == 3
    assert tgt_in[0].tolist() == [2] + pairs.ids(4)[0].tolist() and tgt_out[0].tolist() == pairs.ids(4)[0].tolist() + [3]


def test_the_first_epochs_are_both_ways_then_one():
    pairs = TokenPairs.from_lists(_lists(10, 1), _lists(10, 2))
    corpus = Bidirectional(pairs, 2)
    assert isinstance(corpus.epoch(0), BothWays) and corpus.epoch(1) is corpus.epoch(0)
    assert corpus.epoch(2) is pairs and corpus.epoch(7) is pairs
    assert [len(corpus.lengths(e)[0]) for e in range(4)] == [20, 20, 10, 10]
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        Bidirectional(pairs, 0)


@pytest.mark.parametrize("bad, why", [(-1, "whole number"), (1.5, "whole number"), (True, "whole number")])
def test_the_config_takes_whole_epochs(bad, why):
    with pytest.raises(ConfigError, match=why):
        Config(bidirectional_epochs=bad)
    with pytest.raises(ConfigError, match="one or the other"):
        Config(bidirectional_epochs=2, bpe_dropout_source=0.1)
    assert Config(bidirectional_epochs=3).bidirectional_epochs == 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_multi30k(tmp_path_factory.mktemp("m30k"))


def test_bidirectional_training_resumes_exactly_across_the_switch(corpus, tmp_path):
    """An epoch both ways, then one way: the log names it, the output layer scores both sides' pieces,
    the fractional epochs count one direction's batches, a run stopped and resumed across the switch
    makes the uninterrupted run's losses, and the same run one way learns from other batches."""
    straight, split, cache = tmp_path / "straight", tmp_path / "split", tmp_path / "cache"
    # --max-tokens 300: an epoch both ways then has other than twice the batches of one way (checked below)
    args = ("--bidirectional-epochs", 1, "--output-vocab", "target", "--max-tokens", 300, "--save-every", 10,
            "--valid-every", 0, "--keep-last", 5, "--average-last", 1)
    r = run_train(corpus, straight, "--max-steps", 40, *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bidirectional training: epoch 1 on the 400 pairs in both directions (en -> de and de -> en, 800 " \
           "pairs an epoch), then en -> de alone" in r.stderr
    # the first line counts the batches of both epochs (it had said only one direction's after "800 pairs an epoch")
    m = re.search(r"train: 400 pairs in (\d+) batches per epoch \(800 pairs in (\d+) batches while "
                  r"--bidirectional-epochs reads both directions\)", r.stderr)
    assert m and int(m.group(1)) == (int(m.group(2)) + 1) // 2, r.stderr[-3000:]
    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    epochs = [rec["epoch"] for rec in log if "epoch" in rec]
    assert epochs == sorted(epochs) and max(epochs) > 1.3   # the runs below cross the switch at epoch 1
    ck = load_checkpoint(straight / "model.npz")
    assert ck.config.bidirectional_epochs == 1
    data = open_cache(next(cache.rglob("manifest.json")).parent).pairs("en", "de")
    scored = set(ck.config.output_ids().tolist())
    sides = [set(data.pieces(ck.config.vocab_size, side=s).tolist()) for s in ("source", "target")]
    assert sides[0] - sides[1] and sides[0] | sides[1] <= scored   # source-only pieces are scored too
    _check_both_ways(data, np.random.default_rng(1).permutation(2 * len(data))[:50])   # memory-mapped rows
    assert run_train(corpus, split, "--max-steps", 20, *args, cache=cache).returncode == 0
    r = run_train(corpus, split, "--max-steps", 40, "--resume", *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(straight), losses(split)
    assert [a[s] for s in range(21, 41)] == [b[s] for s in range(21, 41)]
    # resumed after the switch, the log counts epochs as the uninterrupted run (it had counted in the length of an
    # epoch of one direction, not of the first start's: 1.637 against 1.663)
    after = tmp_path / "after"
    switch = next(rec["step"] for rec in log if rec.get("epoch", 0) > 1)
    assert run_train(corpus, after, "--max-steps", switch + 1, *args, cache=cache).returncode == 0
    assert run_train(corpus, after, "--max-steps", 40, "--resume", *args, cache=cache).returncode == 0
    epochs_of = lambda out: {rec["step"]: rec["epoch"] for rec in map(json.loads, (out / "train_log.jsonl").open())
                             if "loss" in rec and "epoch" in rec}
    assert {s: e for s, e in epochs_of(after).items() if s > switch + 1} == {
        s: e for s, e in epochs_of(straight).items() if s > switch + 1}
    one_way = tmp_path / "one_way"
    assert run_train(corpus, one_way, "--max-steps", 5, *args[2:], cache=cache).returncode == 0
    assert losses(one_way)[1] != a[1]
    r = run_train(corpus, split, "--max-steps", 41, "--resume", "--bidirectional-epochs", 2, *args[2:], cache=cache)
    assert r.returncode == 2 and "--bidirectional-epochs 2: the checkpoint" in r.stderr and "Traceback" not in r.stderr
    r = run_train(corpus, tmp_path / "x", "--bidirectional-epochs", 1, "--bpe-dropout-source", 0.1, cache=cache)
    assert r.returncode == 2 and "use one or the other" in r.stderr and "Traceback" not in r.stderr
