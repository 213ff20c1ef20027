"""Text in, text out: translate raw sentences with a checkpoint and score them with sacreBLEU."""
import re
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


def score(hyps, refs, lang=None):
    """sacreBLEU BLEU and chrF of detokenized hypotheses against one reference each, and with
    the target language `lang`, the paper's tokenized BLEU beside them (`paper_bleu`)."""
    from sacrebleu.metrics import BLEU, CHRF
    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    out = {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
           "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b), "n": len(hyps)}
    if lang is not None:
        out["bleu_paper"], out["bleu_paper_method"] = paper_bleu(hyps, refs, lang)
    return out


def paper_bleu(hyps, refs, lang):
    """The paper's score (Table 2), as tensor2tensor's get_ende_bleu.sh and fairseq's
    compound_split_bleu.sh compute it: hypotheses and references Moses-tokenized (sacremoses,
    escaping like tokenizer.perl -l LANG), German compounds split (`a-b` -> `a ##AT##-##AT## b`),
    then multi-bleu.perl's BLEU of the tokens (case-sensitive, no smoothing).

    Returns (BLEU rounded to 2 places, a description); (None, why) without sacremoses.
    """
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        return None, "not computed: needs sacremoses (pip install 'minitf[paper]')"
    from sacrebleu.metrics import BLEU
    mt = MosesTokenizer(lang=lang)

    def tokenize(line):
        tokens = mt.tokenize(line, escape=True, return_str=True)
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokens) if lang == "de" else tokens

    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score([tokenize(h) for h in hyps], [[tokenize(r) for r in refs]]).score
    how = f"tokenized BLEU: Moses tokenizer ({lang}){', compound splitting' if lang == 'de' else ''}, multi-bleu"
    return round(score, 2), how


def load_for_inference(path, device="cpu"):
    """(model, tokenizer) from a checkpoint that carries its tokenizer."""
    from .checkpoint import load_checkpoint
    from .data.tokenizer import Tokenizer
    ckpt = load_checkpoint(path)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"checkpoint {path} has no tokenizer inside: it cannot translate text")
    return ckpt.build_model(device=device), Tokenizer.from_bytes(ckpt.tokenizer)
