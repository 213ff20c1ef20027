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


# ----------------------------------------------------------------------------- the scripts' command lines
def count(low=1):
    """argparse type of a count: an integer >= low (1: rounds, sentences, sizes; 0: warm-up rounds), else a one-line
    usage error naming the flag before anything is measured."""
    from minitf.flags import Number
    return Number(int, low)


def parser(doc):
    """An argument parser for a benchmark: its whole docstring as --help (what it measures, how to run it), each
    flag's default shown, and one-line usage errors (minitf.flags.Parser)."""
    import argparse
    from minitf.flags import Parser

    class Help(argparse.RawDescriptionHelpFormatter):
        def _get_help_string(self, action):   # "(default: 7)" where a default says something
            text = action.help or ""
            if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
                return text
            return f"{text} (default: %(default)s)".strip()

    class BenchParser(Parser):
        def add_argument(self, *names, **kw):   # a flag without help says its default
            if "help" not in kw and kw.get("default") not in (None, False):
                kw["help"] = "(default: %(default)s)"
            return super().add_argument(*names, **kw)

    return BenchParser(description=doc, formatter_class=Help)


def output_path(parser, path, flag):
    """A usage error, before anything is measured, where --out/--json `path` cannot be written (no such folder, or
    a folder there); a measurement had run to its end and then failed to save."""
    import os
    from minitf.errors import ConfigError
    from minitf.fileio import check_output_file
    if path is None:
        return
    try:   # a folder's name, or a folder that is not there: minitf's own check of an output file
        check_output_file(path, flag)
    except ConfigError as e:
        parser.error(str(e))
    if os.path.exists(path):   # written in place (a file of the user's, /dev/null): the file itself must take it
        if not os.access(path, os.W_OK):
            parser.error(f"{flag} {path} cannot be written")
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: the folder {folder} cannot be written")


def run(main):
    """main(), with what stops it said in one line: Ctrl-C (exit 130: nothing more is measured; what was printed
    stands) and minitf's own errors (a missing checkpoint or file, a model that does not fit: exit 2)."""
    import sys
    from minitf.errors import MinitfError
    try:
        return main()
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): nothing more is measured", file=sys.stderr)
        sys.exit(130)
    except MinitfError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.filename is None:
            raise
        print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        sys.exit(2)
