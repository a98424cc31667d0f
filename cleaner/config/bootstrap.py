"""`cleaner bootstrap`'s options: the tiny policy's corpus and supervised training (docs/architecture.md §11).

Design decisions:
- One flat settings dataclass, so its flags come from config/flags.py as every command's do (one
  per field, same name, the field's default and help) and its checks are the fields' own.
- It holds only what the command line sets. `cleaner bootstrap` builds the corpus's and the
  trainer's configs from it (cleaner/toys: CorpusConfig, sft.BootstrapConfig), whose other fields
  keep their defaults, so the config saved next to a model is what it was.
- `seed` is one option for the corpus, the initialisation and the batch order alike.
- A bootstrap writes a model, never a warehouse, so it has no config id; its threads and
  checkpoints are still marked as how it runs (identity never), as every settings group marks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleaner.config.groups import _check, _check_fields, setting

FAILURE_MIXES = ("mixed", "environment")  # cleaner/toys/corpus.py's FAILURE_SETS


@dataclass(frozen=True)
class BootstrapOptions:
    steps: int = setting(2000, check=">= 1", help="optimiser steps")
    seed: int = setting(0, help="corpus, init and batch-order seed")
    corpus_size: int = setting(40_000, check=">= 1", help="synthetic trajectories")
    fail_share: float = setting(0.3, check="in [0, 1]", help="share of first calls that fail")
    failures: str = setting("mixed", choices=FAILURE_MIXES, help="mixed (typos, wrong approaches) | environment "
        "(missing functions only: the second policy)")
    slip_share: float = setting(0.0, check="in [0, 1]", help="share of trajectories that miscopy one digit of the "
        "question in every call")
    no_tool_share: float = setting(0.0, check="in [0, 1]", help="share of trajectories that answer with a guess, "
        "without calling the tool (the third policy)")
    batch_size: int = setting(32, check=">= 1", help="sequences per step")
    checkpoint_every: int = setting(0, identity="never", help="save <out>-checkpoints/step-N every N steps; 0 = off")
    lr: float = setting(3e-3, check="> 0", help="peak learning rate")
    init_from: str | None = setting(None, help="continue from this policy (and its tokenizer): the calibration stage")
    threads: int = setting(2, identity="never", check=">= 1", help="torch CPU threads")

    def __post_init__(self) -> None:
        _check_fields(self)
        _check(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0 (0 = off), got {self.checkpoint_every}")
