import sys

_package = sys.modules.get(__package__ or "minitf")
if getattr(_package, "__file__", None) is None:   # a namespace package: minitf/__init__.py never ran
    # `python -m minitf` from the folder that holds a clone named minitf: Python takes that folder for the
    # package (it comes first on the path) and only the editable install's modules are found inside it
    _where = next(iter(getattr(_package, "__path__", [])), "./minitf")
    print(f"error: the folder {_where} (a clone of minitf?) shadows the installed package here; run the command "
          f"from another folder (or inside the clone), or use the `minitf` command", file=sys.stderr)
    sys.exit(2)

from .cli import main  # noqa: E402

sys.exit(main())
