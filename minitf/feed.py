"""The updates' batches: planned from the run's saved position on (`token_batches`, epoch after
epoch; the pairs of each epoch from BPE-dropout or bidirectional training where they change) and
collated on a background thread while the update before them computes (UpdateFeed)."""
from concurrent.futures import ThreadPoolExecutor
import time

import numpy as np

from .backend import release_freed_memory
from .data.batching import training_batch
from .errors import ConfigError, DataError
from .trainlog import log, plural


class UpdateFeed:
    """The updates' batches in the global order, each collated on a background thread while the
    update before it computes. An update is (epoch, index, total, micro): rank r takes the r-th
    run of update_freq of the update's world size x update_freq batches, as micro [(j, batch)];
    `total` is the update's GLOBAL number of non-pad target tokens (the loss is normalised by it);
    (epoch, index) is the position of its last batch."""

    def __init__(self, batches, pairs_of, tok, per_update, update_freq, rank):
        self.batches, self.pairs_of, self.tok = batches, pairs_of, tok   # pairs_of(epoch): the epoch's TokenPairs
        self.per_update, self.update_freq, self.rank = per_update, update_freq, rank
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="minitf-batches")
        self.pending = self.pool.submit(self._collate)

    def _collate(self):
        micro, total = [], 0
        for j in range(self.per_update):
            epoch, index, idx = next(self.batches)
            pairs = self.pairs_of(epoch)
            total += int(pairs.tgt_lens[idx].sum(dtype=np.int64)) + len(idx)   # target + EOS
            if j // self.update_freq == self.rank:
                micro.append((j, training_batch(pairs, idx, self.tok)))
        return epoch, index, total, micro

    def next(self):
        update = self.pending.result()
        self.pending = self.pool.submit(self._collate)
        return update

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def open_feed(run):
    """(the UpdateFeed of the run's updates from its saved position on, the tokens per batch); sets
    run.epoch_len and the state's batch_tokens (a resumed run must make the same batches)."""
    from .data import iterate_batches, token_batches
    args, world, pairs = run.args, run.world, run.data.train
    per_update = world.size * args.update_freq   # batches of one update, over all ranks
    # --max-tokens, or the config's (the preset's update split over the ranks): on a resume the flag
    # applies too, the checkpoint's config unchanged, as long as the batches keep their size (below)
    max_tokens = args.max_tokens or run.cfg.batch_tokens(world.size, args.update_freq)
    before = run.state.get("update_batches")   # batches an update of the run so far (none before its first start)
    if run.resume_path is not None and run.state.get("batch_tokens", max_tokens) != max_tokens:
        made = (f"--max-tokens {args.max_tokens} makes batches of {max_tokens}" if args.max_tokens else
                f"{world.size} rank(s) x --update-freq {args.update_freq} make batches of {max_tokens} (the preset's "
                f"{run.cfg.update_tokens} tokens per update split over them)")
        fits = ""
        if isinstance(before, int) and before % world.size == 0 and before // world.size != args.update_freq:
            fits = f"; the run's updates were {before} batches: with {world.size} rank(s), --update-freq " \
                   f"{before // world.size} makes them"
        elif isinstance(before, int):   # (it had said 'the run's ranks' without their number)
            fits = f"; the run's updates were {before} batch{'es' if before > 1 else ''} (ranks x --update-freq)"
        raise ConfigError(f"--resume: {run.resume_path} was trained with batches of {run.state['batch_tokens']} "
                          f"tokens, but {made}: resume with the run's ranks, --update-freq and --max-tokens (or "
                          f"a --max-tokens of {run.state['batch_tokens']}), or start a new --out{fits}")
    if run.resume_path is not None and before and before != per_update and run.lead:
        log(f"note: an update is now {per_update} batches of {max_tokens} tokens ({world.size} rank(s) x --update-freq "
            f"{args.update_freq}), {per_update * max_tokens:,} tokens where the run made {before * max_tokens:,}: the "
            f"same batches, in updates of another size")
    run.state["batch_tokens"], run.state["update_batches"] = max_tokens, per_update
    corpus = bpe_dropout(run, max_tokens) or both_directions(run)   # the pairs of each epoch, when they change
    lengths = corpus.lengths if corpus else (lambda epoch: (pairs.src_lens, pairs.tgt_lens))
    try:
        first = token_batches(*lengths(run.state["epoch"]), max_tokens, args.seed, run.state["epoch"])
    except DataError as e:
        if args.max_tokens:
            raise
        raise ConfigError(f"{e}; without --max-tokens a batch is the preset's {run.cfg.update_tokens:,} tokens per "
                          f"update split over {world.size} rank(s) x --update-freq {args.update_freq} = "
                          f"{max_tokens:,} tokens: a smaller --update-freq or fewer ranks make larger batches "
                          f"too") from None
    release_freed_memory()   # the sort's temporaries: hundreds of MB for a 36M-pair corpus
    run.epoch_len = len(first)   # for the log's fractional epoch (other epochs differ by a few batches: below)
    if run.state["epoch"] < run.cfg.bidirectional_epochs:
        run.epoch_len = (len(first) + 1) // 2   # of an epoch of one direction (an epoch of both has twice the batches)
        run.both_len = len(first)               # said in the run's first line
    if per_update > run.epoch_len:
        raise ConfigError(f"{world.size} ranks x --update-freq {args.update_freq} = {per_update} batches per "
                          f"update, but an epoch has only {run.epoch_len}: use fewer ranks, a smaller --update-freq "
                          f"or --max-tokens")
    # the log's fractional epochs count in the first start's epoch length, so that a resumed run logs what an
    # uninterrupted one does (a run resumed after bidirectional epochs had counted in another)
    run.epoch_len = run.state.setdefault("epoch_len", run.epoch_len)
    batches = iterate_batches(pairs.src_lens, pairs.tgt_lens, max_tokens, args.seed, run.state["epoch"],
                              run.state["batch"], first=first, after_plan=release_freed_memory, lengths=lengths)
    return UpdateFeed(batches, corpus.epoch if corpus else (lambda epoch: pairs), run.data.tokenizer, per_update,
                      args.update_freq, world.rank), max_tokens


def both_directions(run):
    """Bidirectional training's pairs of each epoch (None when the config's bidirectional_epochs is 0)."""
    epochs = run.cfg.bidirectional_epochs
    if not epochs:
        return None
    from .data.bidirectional import Bidirectional
    if run.lead:
        src, tgt, n = run.args.src, run.args.tgt, len(run.data.train)
        log(f"bidirectional training: {'epoch 1' if epochs == 1 else f'epochs 1-{epochs}'} on the {n:,} pairs in both "
            f"directions ({src} -> {tgt} and {tgt} -> {src}, {2 * n:,} pairs an epoch), then {src} -> {tgt} alone")
    return Bidirectional(run.data.train, epochs)


def bpe_dropout(run, max_tokens):
    """The BPE-dropout resegmenter of the training pairs (None when the config's p are 0); a sentence drawn longer
    than a batch of `max_tokens` holds keeps its plain segmentation in that epoch."""
    p = (run.cfg.bpe_dropout_source, run.cfg.bpe_dropout_target)
    if not any(p):
        return None
    from .data.resegment import BPEDropout
    t0 = time.time()
    args, kind = run.args, getattr(run.data.tokenizer, "model_type", "marian")
    given = (f"--init-from {args.init_from} brings" if args.init_from else
             f"--tokenizer {args.tokenizer} is" if args.tokenizer else None)
    if kind != "bpe" and given:   # no merges to leave out, named by where the tokenizer came from (--subword, which
        # Tokenizer.merges' own error advises, cannot change a given one)
        flags = [f for f, q in (("--bpe-dropout-source", p[0]), ("--bpe-dropout-target", p[1])) if q]
        raise ConfigError(f"{given} a {'Marian' if kind == 'marian' else 'SentencePiece ' + kind} tokenizer, which "
                          f"has no BPE merges for BPE-dropout to leave out: drop {' and '.join(flags)}, or "
                          + ("start from a model whose tokenizer is BPE" if args.init_from else "give a BPE tokenizer")
                          + " (one trained with --subword bpe)")
    resegment = BPEDropout(run.data.train, run.data.tokenizer, p, run.args.seed, longest=max_tokens - 1)
    epoch = run.state["epoch"]
    growth = resegment.growth(epoch)
    if run.lead:
        plain = resegment.kept_plain[epoch]
        log(f"BPE-dropout: {', '.join(f'{side} p {q}' for side, q in zip(('source', 'target'), p) if q)}; each epoch "
            f"segments the training sentences anew ({', '.join(f'{side} {g:.2f}x' for side, g in growth.items())} the "
            f"pieces of plain BPE in epoch {epoch}"
            + (f"; {plural(plain, 'sentence')} drawn longer than a batch of {max_tokens} tokens kept plain BPE "
               f"there" if plain else "") + f"; {time.time() - t0:.1f} s)")
    return resegment
