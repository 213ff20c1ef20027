"""The beam search of minitf.decode written plainly: one sentence and one candidate at a
time, log-probabilities from the full log-softmax, every candidate ranked by a full sort.
Slow and obvious; tests/test_decode.py checks that the vectorized search returns the same
hypotheses. The rules (fairseq's, paper 6.1 beam 4 / alpha 0.6 / max length input + 50):

  - pad and BOS are never emitted, EOS not as the first token;
  - each step ranks a sentence's continuations (a live beam plus one token, scored by the
    beam's log-probability + log p(token)) and takes the 2k best; an EOS among the k best
    finishes its hypothesis, scored score / ((5 + |Y|) / 6)^alpha (|Y| counts the EOS),
    while fewer than k have finished; the first k other finite continuations are the next
    beams (dead -inf beams fill a short beam);
  - a sentence stops when k have finished, when no live beam is left, or at its maximum
    length a * source length + b, where every live beam ends with EOS (in beam order);
  - the answer is the first finished hypothesis with the best normalized score.

stop="bound": every EOS among the 2k best finishes, and a sentence stops only when its best
live beam's score / lp(max length + 1) cannot beat the best finished hypothesis.
"""
import numpy as np

from minitf.decode import length_penalty


def plain_beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50, stop="fairseq"):
    cfg, k = model.cfg, beam_size
    model.eval()
    out = []
    for row in src:
        row = row[None]
        max_len = int(max_len_a * (row != cfg.pad_id).sum() + max_len_b)
        dec = model.incremental_decoder(row, max_len + 1, beam=k)
        beams = [([], 0.0)] + [([], -np.inf)] * (k - 1)           # (tokens, log-probability)
        finished = []                                             # (normalized score, tokens)
        tokens = np.full(k, cfg.bos_id)
        for t in range(max_len + 1):
            logp = dec.step(tokens[:1] if t == 0 else tokens)     # [k, V] full log-softmax
            if t == 0:                                            # a new sentence has one row: its
                logp = np.repeat(logp, k, axis=0)                 # k beams would all be BOS
            logp[:, [cfg.pad_id, cfg.bos_id]] = -np.inf
            if t == 0:
                logp[:, cfg.eos_id] = -np.inf
            if t == max_len:                                      # the limit: every beam ends
                ranked = [(s + logp[b, cfg.eos_id], b, cfg.eos_id) for b, (_, s) in enumerate(beams)]
            else:
                cands = [(s + logp[b, tok], b, tok) for b, (_, s) in enumerate(beams) for tok in range(logp.shape[1])]
                ranked = sorted(cands, key=lambda c: -c[0])[: 2 * k]
            new = []
            for rank, (s, b, tok) in enumerate(ranked):
                if not np.isfinite(s):
                    continue
                if tok == cfg.eos_id:
                    if stop == "bound" or (rank < k and len(finished) < k):
                        finished.append((s / length_penalty(t + 1, alpha), beams[b][0]))
                elif len(new) < k:
                    new.append((b, beams[b][0] + [tok], s))
            if stop == "bound":   # stop once no live beam can beat the best finished one
                best = max((f[0] for f in finished), default=-np.inf)
                done = bool(new) and new[0][2] / length_penalty(max_len + 1, alpha) <= best
            else:
                done = len(finished) >= k
            if done or t == max_len or not new:
                break
            new += [(new[0][0], new[0][1], -np.inf)] * (k - len(new))
            dec.reorder(np.array([b for b, _, _ in new]))
            beams = [(toks, s) for _, toks, s in new]
            tokens = np.array([toks[-1] for toks, _ in beams])
        out.append(max(finished, key=lambda f: f[0])[1] if finished else [])
    return out


def mixed_length_sources(vocab=13, lens=(3, 6, 2, 8, 5, 4, 7), seed=3):
    """[len(lens), max(lens)] right-padded sentences of the given lengths (EOS 3 last, pad 0)."""
    rng = np.random.default_rng(seed)
    src = np.zeros((len(lens), max(lens)), dtype=np.int64)
    for i, n in enumerate(lens):
        src[i, : n - 1], src[i, n - 1] = rng.integers(4, vocab, n - 1), 3
    return src
