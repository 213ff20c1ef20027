"""Validation during training: the loss and perplexity on the validation set (teacher-forced),
and the BLEU of greedy translations of a fixed sample of it, with the seconds it took.

Under MPI each of the w ranks (the world size) validates its share (every w-th batch of the loss, every w-th sentence
of the BLEU sample) and the ranks combine the results, so that validation takes 1/w of the time
instead of leaving w - 1 ranks waiting for rank 0.
"""
import time

import numpy as np

from .backend import is_gpu, usable_cores
from .distributed import World
from .layers.attention import maps_off


NLL_CAP = 50   # perplexity's cap: exp(50)


def perplexity(nll):
    """exp of a per-token NLL, capped at exp(NLL_CAP) (a diverged model's loss must not overflow the log)."""
    return round(float(np.exp(min(nll, NLL_CAP))), 2)


def shown_ppl(ppl):
    """A perplexity as the console prints it: a capped one as what it is, not as a value (a diverged run's 5.2e21 had
    read as a number that was there)."""
    return f">= exp({NLL_CAP}) (capped: the run diverged?)" if ppl >= perplexity(NLL_CAP) else f"{ppl:.2f}"


def evaluate_loss(model, batches, world=None):
    """Teacher-forced loss and per-token NLL over (src, tgt_in, tgt_out, n_target_tokens) batches, in eval mode
    (the model's train/eval mode is restored afterwards). With a `world`, `batches` are this
    rank's share: the sums are added over the ranks, and every rank returns the whole set's."""
    was_training = model.training
    model.eval()
    tot_loss = tot_nll = tot_n = 0.0
    with maps_off():   # no backward: no attention weights kept
        for src, tgt_in, tgt_out, n in batches:
            loss = model.forward_loss(src, tgt_in, tgt_out)
            tot_loss += float(loss) * n
            tot_nll += float(model.last_stats["nll_sum"])
            tot_n += n
    model.train(was_training)
    if world is not None:
        tot_loss, tot_nll, tot_n = world.allreduce_numbers([tot_loss, tot_nll, tot_n])
    return tot_loss / max(tot_n, 1), tot_nll / max(tot_n, 1)


def valid_batches(valid, tok, max_tokens):
    """The (src, tgt) lines of the validation set as batches of at most max_tokens per side; a sentence longer than
    that (validation sets are not cleaned) is a batch of its own."""
    from .data import TokenPairs, token_batches
    from .data.batching import training_batch
    pairs = TokenPairs.from_lists(tok.encode(valid[0]), tok.encode_target(valid[1]))
    longest = np.maximum(pairs.src_lens, pairs.tgt_lens)
    fits, alone = np.flatnonzero(longest < max_tokens), np.flatnonzero(longest >= max_tokens)
    idxs = [fits[b] for b in token_batches(pairs.src_lens[fits], pairs.tgt_lens[fits], max_tokens, seed=0, epoch=0,
                                           shuffle=False)] if fits.size else []
    return [training_batch(pairs, idx, tok) for idx in idxs + [alone[i:i + 1] for i in range(alone.size)]]


def even_sample(n, k):
    """k indices spread evenly over range(n) (all of them when k >= n), always the same ones."""
    if k >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


class Validation:
    """The validation set of a run: `run(model)` -> a record with valid_loss, valid_nll and
    valid_ppl over the whole set, valid_bleu (sacreBLEU) of greedy translations of
    `bleu_sentences` of its sentences spread evenly over it (None with 0), valid_bleu_sentences and valid_s.
    `world`: the ranks that share the work (every rank calls `run` at the same step and gets
    the same record); one process by default."""

    def __init__(self, valid, tok, max_tokens, bleu_sentences, decode_batch, world=None, lang=None):
        self.tok, self.decode_batch, self.world, self.lang = tok, decode_batch, world or World(), lang
        self.batches = valid_batches(valid, tok, max_tokens)
        self.size = len(valid[0])
        pick = even_sample(self.size, bleu_sentences)
        self.src_ids = [ids + [tok.eos_id] for ids in tok.encode([valid[0][i] for i in pick])]
        self.refs = [valid[1][i] for i in pick]

    def run(self, model):
        from .translate import metrics, translate_ids
        t0 = time.time()
        rank, n = self.world.rank, self.world.size
        loss, nll = evaluate_loss(model, self.batches[rank::n], self.world)
        rec = {"valid_loss": round(loss, 4), "valid_nll": round(nll, 4),
               "valid_ppl": perplexity(nll), "valid_bleu": None}
        if self.src_ids:
            ids = [None] * len(self.src_ids)
            shares = self.world.allgather(translate_ids(model, self.src_ids[rank::n], beam_size=1,
                                                        batch_size=self.decode_batch, threads=self._threads(model)))
            for r, share in enumerate(shares):   # rank r translated sentences r, r + n, r + 2n, ...
                ids[r::n] = share
            rec["valid_bleu"] = metrics(self.tok.decode(ids), self.refs, self.lang, paper=False)["bleu"]
        rec.update(valid_bleu_sentences=len(self.src_ids), valid_s=round(time.time() - t0, 2))
        return rec

    def _threads(self, model):
        """CPU ranks on one machine share its cores: each decodes its share on its part of them
        (None: translate_ids' default, one search per core, or one on a GPU)."""
        if self.world.local_size == 1 or is_gpu(model.xp):
            return None
        return max(1, usable_cores() // self.world.local_size)

    def describe(self, rec):
        """One console line of a record of `run` with its 'step' added (train.validate adds it)."""
        bleu = (f" | BLEU {rec['valid_bleu']:.2f} (greedy, {rec['valid_bleu_sentences']:,} of {self.size:,} "
                f"sentences)" if rec["valid_bleu"] is not None else "")
        return (f"valid: step {rec['step']} | loss {rec['valid_loss']:.3f} | nll {rec['valid_nll']:.3f} | ppl "
                f"{shown_ppl(rec['valid_ppl'])}{bleu} | "
                f"{rec['valid_s']:.1f}s")
