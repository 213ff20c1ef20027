"""Config: the paper's base model by default (Vaswani et al. 2017, Table 3 'base'); its recipe defaults
(4096-token updates, a checkpoint every 1000) are not the paper's: `Config.preset("base")` is.

Every knob of Table 3 is a field: the paper's N (`n_layers`), d_model, d_ff, h (`n_heads`), d_k = d_v
(`d_k`, default d_model // h), P_drop (`dropout`), eps_ls (`label_smoothing`) and row (E),
learned positional embeddings instead of sinusoids (`positional="learned"`).

`arch="rnn"` selects the recurrent baseline the paper compares against (rnn.py: a
bidirectional LSTM encoder and an attentional LSTM decoder); it reads d_model (embedding
and output width), n_layers, dropout, label_smoothing, output_vocab, rnn_hidden and attention, and the
same training recipe fields.
"""
import dataclasses
from dataclasses import dataclass
import math
import re

import numpy as np

from .errors import ConfigError
from .flags import MAX_ALPHA

# how a model is trained and decoded, not what it computes: checkpoints that differ only in these hold
# the same model (checkpoint averaging compares the other fields, `Config.model_fields`)
TRAINING_FIELDS = ("dropout", "attention_dropout", "relu_dropout", "label_smoothing", "bpe_dropout_source",
                   "bpe_dropout_target", "bidirectional_epochs", "output_layer", "warmup", "lr_factor", "lr_fade",
                   "weight_decay", "update_tokens", "max_tokens", "save_every", "save_every_minutes", "average_last",
                   "max_steps", "decode_alpha")
ARCHS = ("transformer", "rnn")                  # the classes: architectures.ARCHS
ATTENTIONS = ("general", "dot", "additive")     # arch "rnn": layers.rnn_attention.RecurrentAttention.KINDS
NORM_POSITIONS = ("post", "pre")                # the Transformer's LayerNorm: after the residual sum (3.1) or before the sublayer
# ONE table from train_wmt.py's flags (argparse names) to the config fields they set, in three kinds: the
# model's shape and architecture, the recipe (a --resume refuses both when they differ from the checkpoint's),
# and the run's schedule. recipe.build_config, the resume check (recipe.resolve_config), the ranks' agreement
# check (train._agree) and config.json's set_by_flags read it, train_cli.add_preset_defaults writes each flag's preset defaults into --help
# from it, tests/test_train.py holds every flag to it or to the run flags.
SIZE_FLAGS = {"d_model": "d_model", "heads": "n_heads", "d_ff": "d_ff", "layers": "n_layers",
              "decoder_layers": "n_decoder_layers", "norm": "norm_position"}
ARCH_FLAGS = {"arch": "arch", "attention": "attention", "output_vocab": "output_layer"}
RECIPE_FLAGS = {f: f for f in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing", "bpe_dropout_source",
                               "bpe_dropout_target", "bidirectional_epochs", "warmup", "lr_factor", "lr_fade",
                               "weight_decay")}
SCHEDULE_FLAGS = {f: f for f in ("max_tokens", "save_every", "save_every_minutes", "average_last", "max_steps")}
FLAG_FIELDS = {**SIZE_FLAGS, **ARCH_FLAGS, **RECIPE_FLAGS, **SCHEDULE_FLAGS}


def id_ranges(ids):
    """Sorted distinct ids -> "a-b,c,..." (runs of consecutive ids as ranges): the config's output_vocab."""
    ids = [int(i) for i in ids]
    runs, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            runs.append(f"{ids[start]}" if k - 1 == start else f"{ids[start]}-{ids[k - 1]}")
            start = k
    return ",".join(runs)


def parse_id_ranges(text, vocab_size):
    """"a-b,c,..." -> the ids as a sorted int64 array; a ConfigError unless they are distinct, ascending and
    inside the vocabulary."""
    parts = [re.fullmatch(r"(\d+)(?:-(\d+))?", part) for part in str(text).split(",")]
    if not all(parts):
        raise ConfigError(f"output_vocab must be id ranges like '3-1207,1209', got {str(text)[:60]!r}")
    ids = np.asarray([i for m in parts for i in range(int(m[1]), int(m[2] or m[1]) + 1)], dtype=np.int64)
    if ids.size == 0 or (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ConfigError(f"output_vocab must list distinct ascending piece ids in [0, {vocab_size}), "
                          f"got {str(text)[:60]!r}")
    return ids


def shown(field, value):
    """A config value as a message names it: an output_vocab (thousands of ids) as its count of pieces and its first
    ranges, everything else as it is."""
    if field == "output_vocab" and isinstance(value, str) and len(value) > 40:
        try:
            count = f"{parse_id_ranges(value, 2**62).size:,} pieces"   # counted as the config reads them
        except ConfigError:
            count = "not id ranges"
        return f"<{count}: {','.join(value.split(',')[:4])[:40]},...>"
    return value


@dataclass
class Config:
    """The settings of a run's model and recipe, one dataclass: the architecture and its sizes
    (the paper's Transformer, or with arch "rnn" the recurrent baseline, which reads the same
    fields), the training recipe (dropout, label smoothing, the schedule, tokens per update,
    checkpoint spacing and averaging) and the decoding default (alpha). Checkpoints and
    config.json record it (`to_dict`); `model_fields` are the part a trained model needs."""
    vocab_size: int = 37000          # V, one joint source/target vocabulary (5.1; tied three ways, 3.4)
    d_model: int = 512               # D
    n_heads: int = 8                 # H
    d_ff: int = 2048                 # F
    n_layers: int = 6                # the paper's N, for the encoder stack and (unless n_decoder_layers) the decoder's
    n_decoder_layers: int = None     # the decoder's layer count (the paper's N); None -> n_layers (the paper's: equal stacks)
    d_k: int = None                  # K = d_k = d_v; None -> d_model // n_heads
    dropout: float = 0.1             # P_drop (5.4)
    attention_dropout: float = 0.0   # on the attention weights (not in the paper; deviations.md)
    relu_dropout: float = 0.0        # on the FFN's hidden ReLU output (not in the paper; deviations.md)
    label_smoothing: float = 0.1     # eps_ls (5.4)
    bpe_dropout_source: float = 0.0  # BPE-dropout: training sentences segmented anew each epoch, each merge
    bpe_dropout_target: float = 0.0  # skipped with this probability (not in the paper; data/resegment.py)
    bidirectional_epochs: int = 0    # the first epochs train on the pairs in both directions, source -> target and
                                     # target -> source (Ding et al. 2021; not in the paper; data/bidirectional.py)
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    output_vocab: str = None         # the pieces the output layer scores, as id ranges "3-1207,1209,..."; None: all V
                                     # (the paper's joint vocabulary; not the paper's otherwise: deviations.md)
    output_layer: str = "joint"      # train_wmt.py's --output-vocab default: "target" fills output_vocab with the
                                     # pieces of the training data's target side (the model reads only output_vocab)
    layer_norm_eps: float = 1e-5
    norm_position: str = "post"      # "post": LayerNorm(x + Sublayer(x)) (3.1); "pre": x + Sublayer(LayerNorm(x))
                                     # and a LayerNorm after each stack (not the paper's; deviations.md)
    positional: str = "sinusoidal"   # or "learned" (Table 3 row E)
    activation: str = "relu"         # the FFN's: "relu" (3.3) or "swish" (x * sigmoid(x); Marian's option, for
                                     # imported models: docs/interop.md)
    output_bias: bool = False        # a bias [V] added to the logits (Marian's decoder_ff_logit_out_b; the paper has none)
    max_len: int = 1024              # learned positions: the longest input; sinusoids: the first table (it grows)
    arch: str = "transformer"        # or "rnn" (architectures.ARCHS)
    rnn_hidden: int = None           # rnn: LSTM width (the encoder's two directions together); None -> 2 * d_model
    attention: str = "general"       # rnn: Luong's "general" or "dot", or Bahdanau's "additive"
    # training recipe defaults of the preset (used by train_wmt.py, not by the model)
    warmup: int = 4000
    lr_factor: float = 1.0
    lr_fade: float = 0.0             # last fraction of the run over which the lr fades linearly to 0 (0: the paper's)
    weight_decay: float = 0.0        # decoupled weight decay (AdamW): p -= lr * weight_decay * p each update (0: the paper's)
    update_tokens: int = 4096        # tokens per UPDATE and side, padding included (5.1: ~25000, the base preset's)
    max_tokens: int = None           # tokens per batch and side on one rank; None: update_tokens split
                                     # over ranks x update_freq (batch_tokens)
    save_every: int = 1000           # steps between checkpoints, unless save_every_minutes is set
    save_every_minutes: float = None # paper 6.1: checkpoints "written at 10-minute intervals"
    average_last: int = 5            # checkpoints averaged at the end (6.1: base 5, big 20)
    max_steps: int = 100_000         # updates (5.2: base 100k, big 300k)
    decode_alpha: float = 0.6        # beam search's length penalty alpha (6.1: 0.6); translate's default

    def __post_init__(self):
        self._check_types()
        if self.d_k is None:
            if self.d_model % self.n_heads and self.arch != "rnn":   # (the recurrent baseline has no heads)
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set d_k explicitly")
            self.d_k = max(1, self.d_model // self.n_heads)
        if self.n_decoder_layers is None:
            self.n_decoder_layers = self.n_layers
        if self.arch == "rnn" and self.n_decoder_layers != self.n_layers:
            raise ConfigError("n_decoder_layers is the Transformer's (arch 'transformer'); the recurrent baseline's "
                              "n_layers sizes its encoder and decoder alike")
        if self.rnn_hidden is None:
            self.rnn_hidden = 2 * self.d_model
        if self.arch not in ARCHS:
            raise ConfigError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "rnn" and self.rnn_hidden % 2:
            raise ConfigError(f"rnn_hidden must be even (two encoder directions of rnn_hidden / 2), got {self.rnn_hidden}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "n_decoder_layers", "d_k", "max_len", "rnn_hidden",
                     "update_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_tokens is not None and int(self.max_tokens) <= 0:
            raise ConfigError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        for name in ("dropout", "attention_dropout", "relu_dropout", "bpe_dropout_source", "bpe_dropout_target",
                     "weight_decay", "label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if isinstance(self.bidirectional_epochs, bool) or int(self.bidirectional_epochs) != self.bidirectional_epochs \
                or self.bidirectional_epochs < 0:
            raise ConfigError(f"bidirectional_epochs must be a whole number of epochs >= 0, got {self.bidirectional_epochs!r}")
        if self.bidirectional_epochs and (self.bpe_dropout_source or self.bpe_dropout_target):
            raise ConfigError("bidirectional_epochs and BPE-dropout each choose an epoch's training pairs: use one or "
                              "the other")
        if self.arch == "rnn" and (self.attention_dropout or self.relu_dropout):
            raise ConfigError("attention_dropout and relu_dropout are the Transformer's (arch 'transformer'); "
                              "the recurrent baseline has only dropout")
        if not 0.0 <= self.lr_fade <= 1.0:
            raise ConfigError(f"lr_fade must be in [0, 1] (a fraction of the run), got {self.lr_fade}")
        if self.norm_position not in NORM_POSITIONS:
            raise ConfigError(f"norm_position must be one of {', '.join(NORM_POSITIONS)}, got {self.norm_position!r}")
        if self.arch == "rnn" and self.norm_position != "post":
            raise ConfigError("norm_position is the Transformer's (arch 'transformer'); the recurrent baseline has no "
                              "residual blocks")
        if self.activation not in ("relu", "swish"):
            raise ConfigError(f"activation must be 'relu' or 'swish', got {self.activation!r}")
        if not isinstance(self.output_bias, bool):
            raise ConfigError(f"output_bias must be true or false, got {self.output_bias!r}")
        if self.arch == "rnn" and (self.activation != "relu" or self.output_bias):
            raise ConfigError("activation and output_bias are the Transformer's (arch 'transformer')")
        if self.positional not in ("sinusoidal", "learned"):
            raise ConfigError(f"positional must be 'sinusoidal' or 'learned', got {self.positional!r}")
        if self.arch == "rnn" and self.positional != "sinusoidal":
            raise ConfigError("positional is the Transformer's (arch 'transformer'): the recurrent baseline reads "
                              "positions in order, and has no table of them")
        for name in ("pad_id", "unk_id", "bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name}={getattr(self, name)} is outside the vocabulary of {self.vocab_size}")
        if self.output_layer not in ("joint", "target"):
            raise ConfigError(f"output_layer must be 'joint' or 'target', got {self.output_layer!r}")
        if self.output_vocab is not None:
            ids = parse_id_ranges(self.output_vocab, self.vocab_size)
            self.output_vocab = id_ranges(ids)    # one spelling for one set of ids: "3,4,5" is "3-5"
            missing = [name for name in ("eos_id", "unk_id") if getattr(self, name) not in set(ids.tolist())]
            if missing:
                raise ConfigError(f"output_vocab must hold {' and '.join(missing)} (it scores the end of a sentence, and "
                                  f"a reference piece outside it as the unknown piece)")
            if self.bpe_dropout_target:
                raise ConfigError("output_vocab holds the pieces of the target side's plain segmentation; "
                                  "bpe_dropout_target makes smaller ones: use one or the other")

    def _check_types(self):
        """Each field of its annotation's type (a bool is not a number, a whole float not an int, a string neither;
        None only where the default is None), a float finite, and the recipe's numbers in range: such values had
        failed later, inside the model ('float' object cannot be interpreted as an integer), in a comparison or in the
        schedule (warmup 0: a division by zero)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            kind = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
            number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            ok = {int: number and isinstance(value, (int, np.integer)),
                  float: number and math.isfinite(value), str: isinstance(value, str),
                  bool: isinstance(value, (bool, np.bool_))}.get(kind, True)
            if not ok:
                what = {int: "a whole number", float: "a finite number", str: "a string", bool: "true or false"}[kind]
                raise ConfigError(f"{f.name} must be {what}{' or None' if f.default is None else ''}, got {value!r}")
            if isinstance(value, np.generic):   # NumPy's scalars as Python's: the config is written as JSON
                setattr(self, f.name, value.item())
        for name, low, strict in (("warmup", 1, False), ("lr_factor", 0, True), ("average_last", 1, False),
                                  ("save_every", 1, False), ("max_steps", 0, False), ("layer_norm_eps", 0, True),
                                  ("save_every_minutes", 0, True), ("decode_alpha", 0, False)):
            value = getattr(self, name)
            if value is not None and (value <= low if strict else value < low):
                raise ConfigError(f"{name} must be {'above' if strict else 'at least'} {low}, got {value!r}")
        if self.decode_alpha > MAX_ALPHA:
            raise ConfigError(f"decode_alpha must be at most {MAX_ALPHA:g} (the paper's: 0.6), got {self.decode_alpha}")

    def output_ids(self):
        """The sorted piece ids [V_o] the output layer scores (int64), or None: all V of them."""
        return None if self.output_vocab is None else parse_id_ranges(self.output_vocab, self.vocab_size)

    def batch_tokens(self, ranks=1, update_freq=1):
        """Tokens per batch and side on one rank. An explicit `max_tokens` is that (fairseq's
        --max-tokens); otherwise the preset's `update_tokens` is split over the ranks x update_freq
        batches of an update, so `mpiexec -n 8 ... --preset base` makes the paper's ~25000-token
        update (5.1) from 8 batches of 3125, and one process makes it from one batch."""
        if self.max_tokens is not None:
            return int(self.max_tokens)
        return max(1, int(self.update_tokens) // (int(ranks) * int(update_freq)))

    def to_dict(self):
        return dataclasses.asdict(self)

    def model_fields(self):
        """{field: value} of what defines the model's parameters and what it computes: every field
        but TRAINING_FIELDS (dropout and label smoothing act only while training)."""
        return {k: v for k, v in self.to_dict().items() if k not in TRAINING_FIELDS}

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def preset(cls, name, arch="transformer", **overrides):
        """`base` and `big` are Table 3's; `small` is sized for a CPU (Multi30k in minutes).
        With arch="rnn", RNN_PRESETS resizes the preset's model for the recurrent baseline
        (base, big and tiny keep the preset's training recipe; small has the recipe of its own runs)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
        sizes = RNN_PRESETS[name] if arch == "rnn" else {}
        return cls(**{**PRESETS[name], **sizes, "arch": arch, **overrides})


TransformerConfig = Config   # the former name, for code written against it

PRESETS = {
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, dropout=0.1,
                 warmup=4000, lr_factor=1.0, update_tokens=25000, save_every_minutes=10.0, average_last=5,
                 max_steps=100_000),
    "big": dict(d_model=1024, n_heads=16, d_ff=4096, n_layers=6, dropout=0.3,
                warmup=4000, lr_factor=1.0, update_tokens=25000, save_every_minutes=10.0, average_last=20,
                max_steps=300_000),
    # recipe chosen on Multi30k val for 30 minutes on 2 CPU cores (docs/benchmarks.md, deviations.md 17):
    # 4096-token updates at twice the rate of 2048 (the same schedule in tokens; 3072 since, below); 2+2 layers,
    # a third more updates in the time than 3+3 (val BLEU 39.29 against 38.68 over three seeds, dropout 0.1); dropout 0.2
    # for the ~16 epochs those updates make (val BLEU 39.65 over three seeds against 39.29); the output layer over
    # the target side's pieces: the same learning per update, a step 11-13% faster, 12% more updates in the time; D 192 and F 768
    # (from 256 and 1024): less learned per update, 1.7x the updates in the time (docs/deviations.md 17); on Multi30k
    # the tokenizer is a unigram model (the dataset's default, minitf.data.datasets; deviations.md 12); decoupled
    # weight decay 0.1: val BLEU 40.50 over three seeds against 40.19 (on a GPU at 3,200 updates 40.66 against 39.86;
    # deviations.md 17); label
    # smoothing 0.2 with a 40% higher rate: val BLEU 40.38 over three seeds against 40.00 at equal updates (ibid.);
    # 3072-token updates with the same warmup in tokens (1067 x 3072 ~ 800 x 4096): a third more updates in the
    # time (1.3x), val BLEU 40.73 over three seeds against 40.27-40.32 for 4096 (ibid.)
    "small": dict(d_model=192, n_heads=4, d_ff=768, n_layers=2, dropout=0.2, weight_decay=0.1,
                  label_smoothing=0.2, warmup=1067, lr_factor=1.4, update_tokens=3072, save_every=80,
                  # decode_alpha chosen on Multi30k val over three runs: 0.6 left translations 7-10% short (benchmarks.md)
                  output_layer="target", decode_alpha=2.0),
    # for tests and smoke runs only
    "tiny": dict(d_model=32, n_heads=2, d_ff=64, n_layers=1, dropout=0.1,
                 warmup=10, lr_factor=1.0, update_tokens=512, save_every=10),
}

# the recurrent baseline (arch="rnn"): base and big about three quarters of the parameter count of the
# Transformer preset of the same name, small that of the Transformer small of its runs (3+3 layers, 256 wide: 7.58M; the current
# small's is 3.61M) (RNNsearch-style widths; docs/rnn_vs_transformer.md)
RNN_PRESETS = {
    "base": dict(d_model=512, rnn_hidden=1024, n_layers=2),
    "big": dict(d_model=1024, rnn_hidden=2048, n_layers=2),
    # tuned on Multi30k val for 30 minutes on 2 CPU cores (rnn_vs_transformer.md): the training recipe the
    # Transformer small had when its runs were made; Bahdanau's additive score (screened on val: BLEU 39.86
    # against 36.87 for Luong's general score) and its own length penalty (1.5 brings the val length ratio to 1.00, 2.0 to 1.03)
    # (dropout 0.1: the value its runs were tuned and measured with; 0.2, the Transformer small's, was level on val)
    # (the joint output layer, no weight decay, label smoothing 0.1, factor 1.0, warmup 800 and 4096-token updates:
    # what its runs were measured with)
    "small": dict(d_model=256, rnn_hidden=640, n_layers=1, attention="additive", decode_alpha=1.5, dropout=0.1,
                  output_layer="joint", weight_decay=0.0, label_smoothing=0.1, lr_factor=1.0, warmup=800,
                  update_tokens=4096),
    "tiny": dict(d_model=32, rnn_hidden=32, n_layers=1),
}


def preset_defaults(field):
    """What each preset sets `field` to, as --help says it: "base 512, big 1024, small 192, tiny 32"
    (presets that agree are named together), and what --arch rnn changes."""
    def listing(values):
        groups = {}
        for name, value in values.items():
            groups.setdefault("unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value),
                              []).append(name)
        if len(groups) == 1:
            return f"every preset {next(iter(groups))}"
        return ", ".join(f"{' and '.join(names)} {value}" for value, names in groups.items())
    plain = {name: getattr(Config.preset(name), field) for name in PRESETS}
    rnn = {name: getattr(Config.preset(name, arch="rnn"), field) for name in PRESETS}
    text = listing(plain)
    return text if rnn == plain else f"{text}; with --arch rnn: {listing(rnn)}"
