#!/usr/bin/env python
"""Train the Transformer of "Attention Is All You Need" and report sacreBLEU: the flags, their
defaults and example commands are in `python train_wmt.py --help` (minitf/train_cli.py)."""
import sys

from minitf.train_cli import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
