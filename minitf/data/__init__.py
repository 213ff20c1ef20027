"""Data pipeline: reading corpora, downloading datasets, tokenizing, batching.

NumPy only (no CuPy here): batches are numpy int64 arrays the trainer moves to the
device itself.
"""

from minitf.data.readers import find_file, read_lines, read_parallel, read_sgm, read_text
from minitf.data.clean import clean_pairs
from minitf.data.tokenizer import Tokenizer, get_or_train_tokenizer, tokenizer_path
from minitf.data.batching import (collate, collate_src, iterate_batches, pad_ids,
                                  token_batches)
from minitf.data.download import download, extract, file_digest
from minitf.data.datasets import DATASETS, default_data_dir, prepare_dataset

__all__ = [
    "find_file", "read_lines", "read_parallel", "read_sgm", "read_text",
    "clean_pairs",
    "Tokenizer", "get_or_train_tokenizer", "tokenizer_path",
    "collate", "collate_src", "iterate_batches", "pad_ids", "token_batches",
    "download", "extract", "file_digest",
    "DATASETS", "default_data_dir", "prepare_dataset",
]
