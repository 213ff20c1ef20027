"""The architectures (fairseq's registry pattern): one table from the config's `arch` to the model class.

Training, checkpoints and decoding build a model with `build_model(cfg, ...)` (averaging reads only
`parameter_shapes`) and
otherwise drive only the surface every model shares (seq2seq.Seq2Seq): forward_loss,
backward, the flat parameter buffers, state_dict, and incremental_decoder for beam search.
"""
from .model import Transformer
from .rnn import RNNSearch

ARCHS = {"transformer": Transformer, "rnn": RNNSearch}


def build_model(cfg, device="cpu", dtype="float32", seed=0):
    """The model cfg.arch names (the config has checked the name against config.ARCHS)."""
    return ARCHS[cfg.arch](cfg, device=device, dtype=dtype, seed=seed)


def parameter_shapes(cfg):
    """{parameter name: shape} of the model `cfg` describes, learned without allocating or
    drawing its weights (the layer tree is built over broadcast zeros, never flattened): what a
    checkpoint's entries must hold, checked before any of them is read (checkpoint.py)."""
    cls = ARCHS[cfg.arch]
    model = cls.__new__(cls)
    model._shapes_only = True
    cls.__init__(model, cfg, device="cpu", dtype="float32", seed=0)
    return {name: tuple(layer.params[key].shape) for name, layer, key in model.named_parameters()}
