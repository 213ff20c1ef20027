#!/usr/bin/env python
"""Train the Transformer of "Attention Is All You Need" and report sacreBLEU: the flags, their
defaults and example commands are in `python train_wmt.py --help` (minitf/train_cli.py)."""
import sys

try:
    from minitf.train_cli import main, parse_args
except KeyboardInterrupt:   # Ctrl-C while NumPy and the rest load: nothing has begun, so no traceback
    if __name__ != "__main__":
        raise
    sys.stderr.write("interrupted while starting: nothing was written\n")
    sys.exit(130)

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
