"""One file per layer; each a forward/backward pair (see base.Layer)."""
from .attention import MultiHeadAttention
from .base import Layer, flatten_parameters
from .conv import Conv1d
from .dropout import Dropout
from .embedding import TokenEmbedding
from .feedforward import FeedForward
from .layernorm import LayerNorm
from .linear import Linear
from .recurrent import LSTM, BiLSTM
from .rnn_attention import RecurrentAttention
from .positional import LearnedPositional, SinusoidalPositional, sinusoid_table

__all__ = ["Layer", "flatten_parameters", "Linear", "TokenEmbedding", "SinusoidalPositional",
           "LearnedPositional", "sinusoid_table", "LayerNorm", "Dropout", "FeedForward",
           "MultiHeadAttention", "LSTM", "BiLSTM", "RecurrentAttention", "Conv1d"]
