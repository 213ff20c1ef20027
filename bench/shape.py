"""The model-shape flags the benchmarks share, named as train_wmt.py names them: each overrides
the preset's value (so a figure measured on an earlier preset can be repeated with its sizes)."""

FLAGS = {  # flag -> (config field, help)
    "--layers": ("n_layers", "encoder layers, and decoder layers unless --decoder-layers (default: the preset's)"),
    "--decoder-layers": ("n_decoder_layers", "decoder layers (default: as the encoder's)"),
    "--d-model": ("d_model", "model width D (default: the preset's)"),
    "--d-ff": ("d_ff", "feed-forward width F (default: the preset's)"),
    "--heads": ("n_heads", "attention heads H (default: the preset's)"),
}


def add_shape_flags(ap):
    """The flags of FLAGS (--layers, --decoder-layers, --d-model, --d-ff, --heads) on an argparse parser."""
    from bench.flags import count
    for flag, (_, help_text) in FLAGS.items():
        ap.add_argument(flag, type=count(), help=help_text)   # 0 heads or layers: a usage error, not a traceback


def shape_overrides(args):
    """The config fields the shape flags given on the command line set: {field: value}."""
    return {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in FLAGS.items()
            if getattr(args, flag[2:].replace("-", "_")) is not None}
