"""`python -m cleaner`: the same app as the console script and `python -m cleaner.cli`."""

from cleaner.cli import app

if __name__ == "__main__":  # an SGLang engine spawns processes that import this module again
    app()
