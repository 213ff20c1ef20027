"""Command-line flags: a parser whose errors are one line, and number types that check their range.

`Parser` is argparse's parser, except that a usage error is ONE line on stderr
(`prog: error: argument --beam: ...`, exit status 2) instead of the whole usage text and
then the error: a script or a scheduler's log keeps the line that matters. `Number` is an
argparse `type` that reads an int or a float and refuses what the flag cannot mean (zero,
negative, NaN, infinite, above a cap), so every numeric flag is checked where it is
declared and a bad value never reaches the code that would trip over it.
"""
import argparse
import math
import os
import sys

MAX_BEAM = 1024   # beams per sentence: far past any use (the paper: 4), well before memory runs out
MAX_ALPHA = 10.0  # the length penalty's exponent: far past any use (the paper: 0.6), before ((5 + |Y|) / 6) ** alpha overflows
MAX_LEN_B = 10_000   # pieces a translation may add to its source's length


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with one-line errors (sub-parsers made from it are the same). `ends_mpi_job`: the
    command runs as every rank of an MPI job (training), so a usage error ends the whole job (`distributed.end_job`)."""
    ends_mpi_job = False

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    def exit(self, status=0, message=None):
        from .distributed import end_job, launcher_rank, launcher_size
        if status and message and self.ends_mpi_job and (launcher_size() or 1) > 1:
            end_job(message.rstrip("\n"), status)   # one rank alone may refuse its flags: the others would wait for it
        if message and launcher_rank() not in (None, 0):   # every rank of an MPI job parses alike: rank 0 says it
            message = None
        if message:
            sys.stderr.write(message)   # one write: lines of several processes do not interleave
            sys.stderr.flush()
        sys.exit(status)


def path_arg(text):
    """argparse type of a flag naming a file or folder: `~` at its start is the home folder, as the shell makes it of
    a word but not after `=` (`--out=~/runs/x` had made a folder named `~`); an empty value (`--tokenizer=$UNSET`) is
    an error, not the flag left out."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or folder, or leave the flag out")
    return os.path.expanduser(text) if text.startswith("~") else text


def language_arg(text):
    """argparse type of a language code (--src, --tgt): the suffix of the corpus files (train.en), so not empty and
    with no space or path separator."""
    if not text or any(c.isspace() or c in "/\\" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a language code (the corpus files' suffix: en for "
                                         f"train.en): give one such as en or de")
    return text


class Number:
    """argparse type: `kind` (int or float) within the bounds given: `low` / `high` inclusive,
    `above` / `below` strict; `allowed`: values taken outside them too (e.g. 0 = off). NaN and
    infinities are refused. The error says what the flag takes; argparse names the flag
    (`argument --beam: must be ...`)."""

    def __init__(self, kind, low=None, high=None, above=None, below=None, allowed=(), meaning=""):
        self.kind, self.low, self.high, self.above, self.below = kind, low, high, above, below
        self.allowed, self.meaning = tuple(allowed), meaning
        self.__name__ = "integer" if kind is int else "number"   # argparse's fallback message uses it

    def describe(self):
        left = f"[{self.low}" if self.low is not None else f"({self.above}" if self.above is not None else None
        right = f"{self.high}]" if self.high is not None else f"{self.below})" if self.below is not None else None
        if left and right:
            rng = f" in {left}, {right}"
        elif left:
            rng = f" {'>=' if left[0] == '[' else '>'} {left[1:]}"
        elif right:
            rng = f" {'<=' if right[-1] == ']' else '<'} {right[:-1]}"
        else:
            rng = ""
        also = "".join(f" or {a}" for a in self.allowed)
        return f"{'an integer' if self.kind is int else 'a finite number'}{rng}{also}{self.meaning}"

    def __call__(self, text):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        if value in self.allowed:
            return value
        bad = (self.kind is float and not math.isfinite(value)) or \
            (self.low is not None and value < self.low) or (self.high is not None and value > self.high) or \
            (self.above is not None and not value > self.above) or (self.below is not None and not value < self.below)
        if bad:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value


def positive(kind=int, high=None):
    """An int >= 1, or a float > 0 (at most `high`)."""
    return Number(int, 1, high) if kind is int else Number(float, above=0, high=high)


def fraction(closed=True):
    """A float in [0, 1] (`closed`), or in [0, 1)."""
    return Number(float, 0, 1) if closed else Number(float, 0, below=1)


def numeric_actions(parser):
    """{(sub-command path, option string): action} of every option of `parser` and its sub-parsers
    that takes a number (type int, float or Number): what tests/test_cli_bad_values.py walks."""
    found = {}

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, path + (name,))
            elif a.option_strings and (a.type in (int, float) or isinstance(a.type, Number)):
                found[path, max(a.option_strings, key=len)] = a
    walk(parser, ())
    return found
