"""Data pipeline: reading corpora, downloading datasets, tokenizing, batching.

NumPy only (no CuPy here): batches are numpy int64 arrays the trainer moves to the
device itself.
"""

from minitf.data.readers import find_file, read_lines, read_parallel, read_sgm, read_text
from minitf.data.clean import clean_mask, clean_pairs
from minitf.data.tokenizer import Tokenizer
from minitf.data.batching import (collate, collate_src, iterate_batches, pad_ids,
                                  token_batches)
from minitf.data.download import download, extract, file_digest
from minitf.data.datasets import DATASETS, default_data_dir, prepare_dataset, user_dataset
from minitf.data.binarized import BinarizedCorpus, TokenPairs, open_cache
from minitf.data.prepare import prepare_cache

__all__ = [
    "find_file", "read_lines", "read_parallel", "read_sgm", "read_text",
    "clean_mask", "clean_pairs",
    "Tokenizer",
    "collate", "collate_src", "iterate_batches", "pad_ids", "token_batches",
    "download", "extract", "file_digest",
    "DATASETS", "default_data_dir", "prepare_dataset", "user_dataset",
    "BinarizedCorpus", "TokenPairs", "open_cache", "prepare_cache",
]
