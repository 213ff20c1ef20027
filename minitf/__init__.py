"""minitf: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on NumPy/CuPy,
with a hand-written forward and backward pass for every layer."""
from .config import PRESETS, Config, TransformerConfig
from .errors import CheckpointError, ConfigError, DataError, DeviceError, MinitfError
from .model import Transformer
from .optim import Adam, LossScaler
from .schedule import NoamSchedule, noam
from .translate import Hypothesis, Translator, load

__version__ = "0.1.0"
__all__ = ["Config", "TransformerConfig", "PRESETS", "Transformer", "Adam", "LossScaler", "noam", "NoamSchedule",
           "load", "Translator", "Hypothesis", "MinitfError", "DeviceError", "DataError", "CheckpointError", "ConfigError"]
