"""Retention ratios per success rate, in the two syntaxes of the paper's filter
(`filter_dataset_by_statistics.py --success_rate_ratios`), and their meaning for a set of statistics
(docs/architecture.md §16).

Design decisions:
- Two syntaxes, as the reference's: `RATE:RATIO` pairs, comma-separated ("0.0:0.0,0.125:0.8,..."),
  or exactly nine ratios, for the rates 0/8, 1/8, ..., 8/8 in that order. A spec holding a `:` is
  read as pairs, so a mixed one is an error naming the item that is not a pair.
- Parsing (`parse_ratios`) needs no statistics: a value that is not a number, a ratio or rate
  outside [0, 1], a rate named twice, nine values that are not nine. Resolving (`resolve`) names
  each rate for the statistics at hand: success rates are exact fractions successes / attempts, and
  a named rate means the one fraction within the reference's tolerance (0.001) of it that some
  prompt's attempt count allows (j / n for an n that occurs). A rate no attempt count allows (0.3
  with 8 attempts: a typo of 0.375?) is an error, and so is one two fractions are within tolerance
  of (many attempts), or two named rates that mean one fraction. The reference instead looks the
  nine values i/8 up by float equality and silently skips any other rate (a prompt at 1/3).
- The nine-value form means i/8, so it is refused for statistics holding a rate that is not an
  eighth (attempts of 4 give eighths; of 3 or 16 do not).
- A rate not named keeps its prompts whole (ratio 1.0), as the reference's default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from cleaner.errors import CleanerError

TOLERANCE = 0.001  # the reference's epsilon between a named rate and a prompt's
EIGHTHS = tuple(Fraction(i, 8) for i in range(9))  # what the nine-value form names, in order


class RatioError(CleanerError, ValueError):
    """A --success-rate-ratios spec that does not parse, or does not fit the statistics."""


@dataclass(frozen=True)
class RatioSpec:
    """A parsed spec: (named rate, ratio) in the order given."""

    text: str  # as given
    pairs: tuple[tuple[float, float], ...]  # (rate as written, ratio)
    eighths: bool  # the nine-value form: the rates are exactly i/8

    def resolve(self, attempts: Iterable[int], rates: Iterable[Fraction]) -> dict[Fraction, float]:
        """{success rate: ratio} for statistics whose prompts have these attempt counts and rates."""
        if self.eighths:
            strays = sorted(rate for rate in set(rates) if rate not in EIGHTHS)
            if strays:
                raise RatioError(f"--success-rate-ratios {self.text!r}: the nine-value form names the rates 0/8 .. "
                                 f"8/8, but the statistics hold rate {strays[0]} ({len(strays)} rate(s) that are "
                                 "not eighths); name the rates instead, as '0.0:0.5,0.333:1.0,...'")
            return {rate: ratio for rate, (_, ratio) in zip(EIGHTHS, self.pairs, strict=True)}
        counts = sorted(set(attempts))
        resolved: dict[Fraction, float] = {}
        named: dict[Fraction, float] = {}
        for written, ratio in self.pairs:
            rate = _fraction_of(written, counts, self.text)
            if rate in resolved:
                raise RatioError(f"--success-rate-ratios {self.text!r}: rates {named[rate]:g} and {written:g} both "
                                 f"name success rate {rate} (within {TOLERANCE}); name each rate once")
            resolved[rate], named[rate] = ratio, written
        return resolved


def parse_ratios(text: str | None) -> RatioSpec | None:
    """The spec `text` (None: none given, every rate whole); RatioError naming the bad item."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise RatioError(f"--success-rate-ratios {text!r}: expected RATE:RATIO pairs or nine ratios, "
                         "comma-separated, without an empty item")
    if ":" not in text:
        if len(items) != 9:
            raise RatioError(f"--success-rate-ratios {text!r}: the short form takes exactly nine ratios (for the "
                             f"rates 0/8 .. 8/8), got {len(items)}")
        ratios = [_number(item, "ratio", text) for item in items]
        return RatioSpec(text, tuple((float(rate), ratio) for rate, ratio in zip(EIGHTHS, ratios, strict=True)), True)
    pairs, seen = [], {}
    for item in items:
        rate_text, colon, ratio_text = item.partition(":")
        if not colon or ":" in ratio_text:
            raise RatioError(f"--success-rate-ratios {text!r}: {item!r} is not RATE:RATIO")
        rate, ratio = _number(rate_text, "success rate", text), _number(ratio_text, "ratio", text)
        if rate in seen:
            raise RatioError(f"--success-rate-ratios {text!r}: success rate {rate:g} is named twice "
                             f"({seen[rate]!r} and {item!r})")
        seen[rate] = item
        pairs.append((rate, ratio))
    return RatioSpec(text, tuple(pairs), False)


def _number(item: str, what: str, text: str) -> float:
    """`item` as a number in [0, 1]; RatioError naming it otherwise."""
    try:
        value = float(item)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise RatioError(f"--success-rate-ratios {text!r}: {what} {item.strip()!r} is not a number")
    if not 0.0 <= value <= 1.0:
        raise RatioError(f"--success-rate-ratios {text!r}: {what} {item.strip()} is outside [0, 1]")
    return value


def _fraction_of(written: float, counts: list[int], text: str) -> Fraction:
    """The one fraction j/n (n in `counts`) within TOLERANCE of `written`; RatioError if none or several."""
    near = set()
    for n in counts:
        j = round(written * n)
        near |= {Fraction(k, n) for k in (j - 1, j, j + 1) if 0 <= k <= n and abs(written - k / n) <= TOLERANCE}
    if not near:
        shown = ", ".join(map(str, counts[:5])) + (", ..." if len(counts) > 5 else "")
        raise RatioError(f"--success-rate-ratios {text!r}: {written:g} is not a success rate of these statistics "
                         f"(within {TOLERANCE} of j/n for their attempts per prompt n = {shown})")
    if len(near) > 1:
        shown = " and ".join(map(str, sorted(near)[:2]))
        raise RatioError(f"--success-rate-ratios {text!r}: {written:g} is within {TOLERANCE} of the success rates "
                         f"{shown}; write the rate with more digits")
    return near.pop()
