"""A minitf Transformer as a CTranslate2 model (docs/interop.md): the Marian files of marian.py
read by CTranslate2's own Marian converter, with what minitf does differently told to it: the
decoder starts from <s>'s embedding (Marian's from zeros), the source ends with </s>, and the
LayerNorms' epsilon. Needs the `ctranslate2` package (pip install 'minitf[serve]')."""
import json
import os
import shutil

from .errors import MinitfError
from .fileio import check_export_folder, export_into, move_in, staging_folder
from .marian import is_ctranslate2

MARK = "minitf_export"   # the key of config.json that says minitf wrote the folder
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int16", "float16", "bfloat16", "float32")


def _converter_class():
    try:
        from ctranslate2.converters.marian import MarianConverter
    except ImportError:
        raise MinitfError("export --format ctranslate2 needs the ctranslate2 package: pip install 'minitf[serve]'") \
            from None

    class MinitfMarianConverter(MarianConverter):
        def __init__(self, model_path, vocab_paths, layer_norm_eps):
            super().__init__(model_path, vocab_paths)
            self.layer_norm_eps = layer_norm_eps

        def _load(self):
            spec = super()._load()
            spec.decoder.start_from_zero_embedding = False   # minitf: <s>'s embedding, not zeros
            spec.config.decoder_start_token = "<s>"
            spec.config.add_source_bos = False
            spec.config.add_source_eos = True
            spec.config.layer_norm_epsilon = self.layer_norm_eps
            spec.config.add_attribute(MARK, True)   # config.json: this folder is minitf's export (CTranslate2 ignores it)
            return spec

    return MinitfMarianConverter


def export_ctranslate2(checkpoint, out_dir, quantization=None):
    """Write the checkpoint as a CTranslate2 model folder (model.bin, shared_vocabulary.json,
    config.json) plus its SentencePiece model (source.spm, target.spm). `quantization`: one of
    QUANTIZATIONS, or None (the weights' float32). The folder's other files are kept; a file of the same name that no
    earlier CTranslate2 export wrote is refused (fileio.check_export_folder). Returns the folder."""
    from .marian import checkpoint_model, write_marian
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise MinitfError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    converter_class = _converter_class()
    cfg, params, tokenizer, languages = checkpoint_model(checkpoint)   # the checkpoint read once
    check_export_folder(out_dir, (), is_minitf_export, "CTranslate2 model")   # a file named out_dir: refused now
    with export_into(out_dir), staging_folder(out_dir, "marian") as tmp, staging_folder(out_dir, "ct2") as made:
        write_marian(cfg, params, tokenizer, languages, tmp)
        converter = converter_class(os.path.join(tmp, "model.npz"), [os.path.join(tmp, "vocab.yml")],
                                    cfg.layer_norm_eps)
        # CTranslate2 empties the folder it converts into (shutil.rmtree with force=True): a folder of its own,
        # inside out_dir, whose files then replace their namesakes in out_dir and nothing else
        converter.convert(made, quantization=quantization, force=True)
        for name in ("source.spm", "target.spm"):
            shutil.copyfile(os.path.join(tmp, name), os.path.join(made, name))
        names = sorted(os.listdir(made))
        check_export_folder(out_dir, names, is_minitf_export, "CTranslate2 model")
        move_in(made, out_dir, names)
    return out_dir


def is_minitf_export(folder):
    """Whether `folder` holds a CTranslate2 model minitf wrote: its config.json carries MARK, or (an export of a minitf
    that wrote no mark) starts the decoder from <s>, ends the source with </s> and has source.spm beside it. A model
    another converter wrote (ct2-opus-mt-converter's: </s> as the start, no .spm files) is not."""
    if not is_ctranslate2(folder):
        return False
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    return config.get(MARK) is True or (config.get("decoder_start_token") == "<s>" and config.get("add_source_eos") is True
                                        and os.path.isfile(os.path.join(folder, "source.spm")))
