"""`python -m cleaner.cli`: the same app as the console script."""

from cleaner.cli import app

if __name__ == "__main__":  # an SGLang engine spawns processes that import this module again
    app()
