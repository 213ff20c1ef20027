"""Validation shared between ranks (minitf/validation.py): each rank takes every N-th batch of the
loss and every N-th sentence of the BLEU sample, and every rank gets the record that one process
computes over the whole set. Two ranks are two threads here, exchanging through a barrier
(tests/test_distributed.py runs the real mpiexec)."""
import threading

import numpy as np
import pytest

import minitf
from minitf.checkpoint import load_checkpoint
from minitf.data.tokenizer import Tokenizer
from minitf.distributed import World
from minitf.validation import Validation

from conftest import make_tiny_checkpoint


class ThreadWorld(World):
    """Rank `rank` of `size` threads: the collectives meet at a barrier."""

    def __init__(self, rank, size, shared, local_size=1):
        self.rank, self.size, self.local_size, self.shared = rank, size, local_size, shared

    def _exchange(self, value):
        slots, barrier = self.shared
        slots[self.rank] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()   # nobody writes the next exchange before everyone has read this one
        return out

    def allreduce_numbers(self, values):
        return np.sum([np.asarray(v, dtype=np.float64) for v in self._exchange(list(values))], axis=0).tolist()

    def allgather(self, obj):
        return self._exchange(obj)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("val")
    path, lines = make_tiny_checkpoint(folder, n_lines=200)
    tok = Tokenizer.from_bytes(load_checkpoint(path).tokenizer)
    rng = np.random.default_rng(1)
    valid = (lines[:37], [" ".join(rng.permutation(line.split())) for line in lines[:37]])   # 37: uneven shares
    return path, tok, valid


def _model(path):
    return load_checkpoint(path).build_model(dtype="float64")


class Counting:
    """A model whose forward_loss calls are counted (which batches this rank evaluated)."""

    def __init__(self, model):
        self.model, self.src_rows = model, []
        forward_loss = model.forward_loss

        def counted(src, tgt_in, tgt_out):
            self.src_rows.append(len(src))
            return forward_loss(src, tgt_in, tgt_out)
        model.forward_loss = counted


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_share_validation_and_each_gets_the_one_process_record(setup, ranks):
    path, tok, valid = setup
    alone = Validation(valid, tok, 40, 25, 8)
    assert len(alone.batches) >= ranks and len(alone.src_ids) == 25
    expected = alone.run(_model(path))
    assert expected["valid_bleu"] is not None

    shared = ([None] * ranks, threading.Barrier(ranks))
    records, counts, errors = [None] * ranks, [None] * ranks, []

    def rank_main(r):
        try:
            model = _model(path)
            counting = Counting(model)
            records[r] = Validation(valid, tok, 40, 25, 8, ThreadWorld(r, ranks, shared)).run(model)
            counts[r] = counting.src_rows
        except BaseException as e:   # noqa: BLE001 (reported below; a dead thread would hang the barrier)
            errors.append(e)
            shared[1].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for rec in records:
        for key in ("valid_loss", "valid_nll", "valid_ppl", "valid_bleu", "valid_bleu_sentences"):
            assert rec[key] == pytest.approx(expected[key], abs=1e-4), key
    # each rank evaluated its every-N-th batch of the loss, and only those
    batch_rows = [len(b[0]) for b in alone.batches]
    for r in range(ranks):
        assert counts[r] == batch_rows[r::ranks]


def test_one_process_translates_and_evaluates_everything(setup):
    path, tok, valid = setup
    model = _model(path)
    counting = Counting(model)
    v = Validation(valid, tok, 40, 0, 8)
    rec = v.run(model)
    assert counting.src_rows == [len(b[0]) for b in v.batches] and sum(counting.src_rows) == len(valid[0])
    assert rec["valid_bleu"] is None and rec["valid_bleu_sentences"] == 0
