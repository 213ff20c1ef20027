"""Checks of the benchmarks' command-line values that their parsers share."""


def at_least_one(parser, args, *names):
    """A usage error (the parser's: exit status 2) naming the first of the flags `names` (argparse's dest names:
    'per_update' for --per-update) given a value below 1; a flag left at None is not checked."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def known_modes(parser, text, modes):
    """The comma-separated --modes `text` as a list, each one a name of `modes` (bench/launches.MODES: pairs of a
    name and what it stands for), else a usage error naming the first that is not."""
    names = [m for m, _ in modes]
    chosen = text.split(",")
    for mode in chosen:
        if mode not in names:
            parser.error(f"--modes: unknown mode {mode!r} ({', '.join(names)})")
    return chosen


def need_torch(parser, flag="--vs-torch"):
    """A usage error where `flag` asks for PyTorch and it is not installed (it is never a dependency of minitf; a CPU
    build for the comparisons: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        parser.error(f"{flag} times the same model in PyTorch, which is not installed here: pip install torch (a CPU "
                     f"build is enough on a CPU), or drop {flag}")
