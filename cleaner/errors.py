"""The one base class of expected failures.

A `CleanerError` is bad input or an unusable environment, never a bug: its message names the input
(a file, a directory, an option) and what was expected. The CLI prints it as one `error: ...` line
and exits with code 1; anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class CleanerError(Exception):
    """An expected failure; the message says which input and what was expected."""


class JobError(CleanerError):
    """A job cannot start or finish; the message says why and what to do."""
