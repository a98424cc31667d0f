"""The `cleaner` command line (typer): one module per group of commands, all on one app.

Importing the package registers every command, in the order `cleaner --help` lists them: the
phases, the loop, then the readers. `cleaner.cli:app` is the console script.
"""

# isort: off
from cleaner.cli import phases  # noqa: F401  (registers collect, eval, purify, ablate, train)
from cleaner.cli import loop  # noqa: F401  (run, demo, bootstrap)
from cleaner.cli import read  # noqa: F401  (report, sandbox run, sql, compact, show, ui)
from cleaner.cli import export  # noqa: F401  (export)
from cleaner.cli import curate  # noqa: F401  (curate)
from cleaner.cli import warehouse  # noqa: F401  (warehouse)
# isort: on
from cleaner.cli.common import app

__all__ = ["app"]
