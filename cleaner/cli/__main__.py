"""`python -m cleaner.cli`: the same app as the console script."""

from cleaner.cli import app

app()
