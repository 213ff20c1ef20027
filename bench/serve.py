"""A minitf model served by CTranslate2 against minitf's own decoder: speed and BLEU on one test set.

    python bench/serve.py --checkpoint runs/m30k/model.npz \\
        --src $MULTI30K/test_2016_flickr.en.gz --ref $MULTI30K/test_2016_flickr.de.gz

The checkpoint is exported (`python -m minitf export --format ctranslate2`) in float32 and int8
into a temporary folder; then, alternating in rounds in one process, each translates the whole
set with beam 4 (the paper's):

  minitf            translate_ids as `python -m minitf translate` runs it (its threads, batches of 64)
  ct2 float32       ctranslate2.Translator with inter_threads = the cores and intra_threads 1 (one batch of
                    64 sentences per core: the split minitf's searches make), max_batch_size 64; measured
                    fastest of the (inter, intra) = (cores, 1) and (1, cores) splits on the 2-core CPU
  ct2 int8          the same model quantized to int8 weights

with one search rule for all three: CTranslate2's (length penalty 0; minitf's --stop ctranslate2
--alpha 0), under which minitf and the float32 export give the same translations (counted here).
Also minitf with the checkpoint's own settings (beam 4, its preset's alpha, fairseq's stop), for
its BLEU. Prints and writes (--out) medians over --rounds of the wall time, sentences/s, and
sacreBLEU. Needs `pip install 'minitf[serve]'`.
"""
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf.backend import usable_cores  # noqa: E402
from minitf.ctranslate2_export import export_ctranslate2  # noqa: E402
from minitf.data.readers import read_text  # noqa: E402
from minitf.translate import metrics, translate_ids  # noqa: E402
from bench.flags import count, output_path, parser, run  # noqa: E402
from bench.train_step import cpu_model  # noqa: E402


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True, help="a minitf Transformer checkpoint")
    p.add_argument("--src", required=True, help="source sentences, one a line (plain or .gz)")
    p.add_argument("--ref", required=True, help="their references, line for line")
    p.add_argument("--beam", type=count(), default=4)
    p.add_argument("--rounds", type=count(), default=3)
    p.add_argument("--out", help="also write the results here (JSON)")
    args = p.parse_args()
    output_path(p, args.out, "--out")
    try:
        import ctranslate2
    except ImportError:
        p.error("this compares with CTranslate2, which is not installed here: pip install 'minitf[serve]'")
    t = minitf.load(args.checkpoint)
    tok = t.tokenizer
    src_lines, refs = read_text(args.src), read_text(args.ref)
    if len(src_lines) != len(refs):
        p.error(f"--src {args.src} has {len(src_lines):,} lines, --ref {args.ref} {len(refs):,}: BLEU needs one "
                f"reference a sentence")
    src = tok.encode(src_lines)
    with_eos = [s + [tok.eos_id] for s in src]
    pieces = [[tok.id_to_piece(i) for i in s] for s in src]
    cores = usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        translators = {}
        for q in ("float32", "int8"):
            export_ctranslate2(args.checkpoint, os.path.join(tmp, q), quantization=q)
            translators[f"ct2 {q}"] = ctranslate2.Translator(os.path.join(tmp, q), device="cpu", inter_threads=cores,
                                                             intra_threads=1)

        id_of = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}

        def ct2_run(tr):
            res = tr.translate_batch(pieces, beam_size=args.beam, length_penalty=0.0, min_decoding_length=1,
                                     max_decoding_length=max(map(len, src)) + 51, max_batch_size=64)
            return [[id_of[x] for x in r.hypotheses[0]] for r in res]

        def minitf_run(alpha, stop):
            return [list(ids) for ids in translate_ids(t.model, with_eos, args.beam, alpha, stop=stop)]

        runners = {"minitf": lambda: minitf_run(0.0, "ctranslate2"),
                   **{name: (lambda tr=tr: ct2_run(tr)) for name, tr in translators.items()},
                   "minitf, its own settings": lambda: minitf_run(t.model.cfg.decode_alpha, "fairseq")}
        times = {name: [] for name in runners}
        outputs = {}
        for r in range(args.rounds):
            for name, runner in runners.items():
                t0 = time.perf_counter()
                outputs[name] = runner()
                times[name].append(time.perf_counter() - t0)
                print(f"round {r + 1} {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    result = {"checkpoint": args.checkpoint, "src": args.src, "sentences": len(src), "beam": args.beam,
              "machine": f"{platform.node()} {cpu_model()}, {cores} cores",
              "date": time.strftime("%Y-%m-%d %H:%M"), "ctranslate2": ctranslate2.__version__, "runs": {}}
    base = statistics.median(times["minitf"])
    print(f"{result['date']}, {result['machine']}, ctranslate2 {ctranslate2.__version__}: {len(src)} sentences, beam "
          f"{args.beam}, {args.rounds} rounds; medians (x: speed against minitf's)")
    for name in runners:
        score = metrics(tok.decode(outputs[name]), refs)
        med = statistics.median(times[name])
        same = sum(a == b for a, b in zip(outputs[name], outputs["minitf"]))
        result["runs"][name] = {"median_s": round(med, 3), "times_s": [round(x, 3) for x in times[name]],
                                "sentences_per_s": round(len(src) / med, 1), "speed_vs_minitf": round(base / med, 3),
                                "bleu": score["bleu"], "chrf": score["chrf"], "same_as_minitf": same}
        print(f"  {name:26s} {med:7.2f} s  {len(src) / med:7.1f} sent/s  x{base / med:5.2f}  BLEU {score['bleu']:5.2f}  "
              f"chrF {score['chrf']:5.2f}  same translations as minitf: {same}/{len(src)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run(main)
