#!/usr/bin/env python
"""Validation during training on CPU ranks: what one validation costs the run, shared between the
ranks (w ranks, each its every w-th batch and sentence, minitf.validation) or on rank 0 alone while the
others wait (as the training loop once did).

Run it under the launcher that trains: `mpiexec -n 2 python bench/validation.py ...`. Every rank
loads the checkpoint; each round times the ranks from a barrier to the end of the validation on
every rank (the time the training loop loses), median over --rounds after one warm-up. Rank 0
prints one JSON line per mode, with the record, which is the same in both.

usage: mpiexec -n 2 python bench/validation.py --checkpoint runs/m30k/model.npz \\
           --src $MULTI30K/val.en.gz --ref $MULTI30K/val.de.gz --rounds 5
"""
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.flags import count, parser, run  # noqa: E402


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True, help="a trained model")
    p.add_argument("--src", required=True, help="validation source text (.gz or plain)")
    p.add_argument("--ref", required=True, help="its references")
    p.add_argument("--max-tokens", type=count(), default=1536,
                   help="tokens per loss batch (the small preset's batch on each of two ranks: 3072 / 2)")
    p.add_argument("--bleu-sentences", type=count(0), default=500,
                   help="greedy BLEU sample (train_wmt.py's default; 0: no BLEU)")
    p.add_argument("--decode-batch", type=count(), default=64)
    p.add_argument("--rounds", type=count(), default=5)
    args = p.parse_args()

    from minitf import distributed
    from minitf.data.readers import read_lines
    from minitf.translate import load_for_inference
    from minitf.validation import Validation
    world = distributed.init()
    world.share_cores()
    model, tok = load_for_inference(args.checkpoint)
    valid = (read_lines(args.src), read_lines(args.ref))
    modes = {"shared": Validation(valid, tok, args.max_tokens, args.bleu_sentences, args.decode_batch, world)}
    if world.size > 1:
        modes["rank 0 alone"] = Validation(valid, tok, args.max_tokens, args.bleu_sentences, args.decode_batch)
    for name, validation in modes.items():
        times, rec = [], None
        for _ in range(args.rounds + 1):
            world.barrier()
            t0 = time.perf_counter()
            if name == "shared" or world.rank == 0:
                rec = validation.run(model)
            world.barrier()   # the others wait for rank 0, as at the training loop's next all-reduce
            times.append(time.perf_counter() - t0)
        if world.rank == 0:
            print(json.dumps({"mode": name, "ranks": world.size, "median_s": round(statistics.median(times[1:]), 3),
                              "rounds_s": [round(t, 3) for t in times[1:]],
                              **{k: rec[k] for k in ("valid_loss", "valid_ppl", "valid_bleu", "valid_bleu_sentences")}}),
                  flush=True)


if __name__ == "__main__":
    run(main)
