"""Reading any model file minitf takes, for translating, scoring, fine-tuning (--init-from) or describing (`info`):
a minitf checkpoint (.npz, or a .safetensors export: checkpoint.py) or a Marian model (an OPUS-MT folder or its .npz:
marian.py), as one StoredModel."""
import os
from typing import NamedTuple

from .checkpoint import built_model, load_checkpoint
from .config import Config
from .ctranslate2_export import is_ctranslate2
from .data.tokenizer import tokenizer_from_bytes
from .errors import CheckpointError
from .marian import import_marian, is_marian, marian_files


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

    def build_model(self, device="cpu"):
        """The model of the file's config with its weights, in eval mode."""
        return built_model(self.config, self.params, device)


def read_model(path):
    """Any model file minitf reads, for translating, scoring, fine-tuning or describing: a minitf checkpoint (.npz or
    a .safetensors export; Adam's moments not read) or a Marian model (an OPUS-MT folder or its .npz: marian.py)."""
    _refuse_ctranslate2(path)
    if os.path.isdir(path) and not is_marian(path):   # Marian .npz files, but no decoder.yml to say which: said so
        npz = [n for n in os.listdir(path) if n.endswith(".npz")]
        if len(npz) > 1 and any(is_marian(os.path.join(path, n)) for n in npz):
            marian_files(path)
    if is_marian(path):
        config, params, tokenizer, languages = import_marian(path)
        return StoredModel(path, config, params, tokenizer, {"languages": languages} if languages else {}, False, True)
    ckpt = load_checkpoint(path, optimizer=False)
    tokenizer = tokenizer_from_bytes(ckpt.tokenizer) if ckpt.tokenizer else None
    return StoredModel(path, ckpt.config, ckpt.params, tokenizer, ckpt.train_state or {}, ckpt.has_optimizer, False)


def _refuse_ctranslate2(path):
    """A CheckpointError naming a CTranslate2 model (a folder, or its model.bin), which minitf writes but does not read."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) if os.path.basename(path) == "model.bin" else None
    if folder is not None and is_ctranslate2(folder):
        raise CheckpointError(f"{path} is a CTranslate2 model: minitf writes that format (export --format ctranslate2) "
                              f"but reads its own checkpoints and Marian models; translate it with ctranslate2 "
                              f"(docs/interop.md), or name the minitf checkpoint it was exported from")
