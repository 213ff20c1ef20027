"""Reading any model file minitf takes, for translating, scoring, fine-tuning (--init-from) or describing (`info`):
a minitf checkpoint (.npz, or a .safetensors export: checkpoint.py) or a Marian model (an OPUS-MT folder or its .npz:
marian.py), as one StoredModel."""
from typing import NamedTuple

from .checkpoint import built_model, load_checkpoint
from .config import Config
from .data.tokenizer import tokenizer_from_bytes
from .marian import import_marian, is_marian, refuse_unreadable


class StoredModel(NamedTuple):
    """A model file read for use (read_model): config, params {name: array}, tokenizer (a Tokenizer, a
    MarianTokenizer, or None where the checkpoint holds none), train_state ({} for a Marian model), has_optimizer
    (the file holds Adam's moments, unread), marian (an imported Marian model)."""
    path: str
    config: Config
    params: dict
    tokenizer: object
    train_state: dict
    has_optimizer: bool
    marian: bool

    def build_model(self, device="cpu", dtype="float32"):
        """The model of the file's config with its weights, in eval mode."""
        return built_model(self.config, self.params, device, dtype)


def read_model(path):
    """Any model file minitf reads, for translating, scoring, fine-tuning or describing: a minitf checkpoint (.npz or
    a .safetensors export; Adam's moments not read) or a Marian model (an OPUS-MT folder or its .npz: marian.py)."""
    refuse_unreadable(path)
    if is_marian(path):
        config, params, tokenizer, languages = import_marian(path)
        return StoredModel(path, config, params, tokenizer, {"languages": languages} if languages else {}, False, True)
    ckpt = load_checkpoint(path, optimizer=False)
    tokenizer = tokenizer_from_bytes(ckpt.tokenizer) if ckpt.tokenizer else None
    return StoredModel(path, ckpt.config, ckpt.params, tokenizer, ckpt.train_state or {}, ckpt.has_optimizer, False)
