"""Shared fixtures: a tiny tokenizer + model checkpoint made on the spot (no shared data)."""
import numpy as np

import minitf
from minitf.checkpoint import save_checkpoint
from minitf.data.tokenizer import Tokenizer

WORDS = "the a cat dog sees runs small big red house tree man woman eats".split()


def make_tiny_checkpoint(folder, n_layers=1, n_lines=300, seed=0):
    """Train a 60-piece SentencePiece model on random sentences and save an untrained tiny
    Transformer with it. Returns (checkpoint path, the sentences)."""
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(2, 8))) for _ in range(n_lines)]
    tok = Tokenizer.train(lines, folder / "spm.model", vocab_size=60)
    cfg = minitf.TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=2, d_ff=24, n_layers=n_layers)
    save_checkpoint(folder / "model.npz", minitf.Transformer(cfg, seed=0), tokenizer=tok.to_bytes())
    return folder / "model.npz", lines
