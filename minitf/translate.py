"""Text in, text out: translate raw sentences with a checkpoint and score them with sacreBLEU."""
import sys

from .decode import translate_ids
from .errors import CheckpointError


def progress_bar(total, desc, enabled=True):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="sent", file=sys.stderr, disable=not enabled, leave=False)


def translate_lines(model, tokenizer, lines, beam_size=4, alpha=0.6, batch_size=64, max_len_b=50, progress=True):
    """Raw sentences -> detokenized translations (paper 6.1 defaults: beam 4, alpha 0.6, +50)."""
    src_ids = [ids + [tokenizer.eos_id] for ids in tokenizer.encode(lines)]   # never cut: see _check_ids
    with progress_bar(len(src_ids), "translate", progress) as bar:
        out = translate_ids(model, src_ids, beam_size, alpha, batch_size, max_len_b, progress=bar)
    return tokenizer.decode(out)


def score(hyps, refs):
    """sacreBLEU BLEU and chrF of detokenized hypotheses against one reference each."""
    from sacrebleu.metrics import BLEU, CHRF
    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b), "n": len(hyps)}


def load_for_inference(path, device="cpu"):
    """(model, tokenizer) from a checkpoint that carries its tokenizer."""
    from .checkpoint import load_checkpoint
    from .data.tokenizer import Tokenizer
    ckpt = load_checkpoint(path)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"checkpoint {path} has no tokenizer inside: it cannot translate text")
    return ckpt.build_model(device=device), Tokenizer.from_bytes(ckpt.tokenizer)
