"""`cleaner run`: the iteration loop (iterations.py) over the stages' jobs, in one process or SPMD
on the ranks a launcher started (ranks.py), docs/architecture.md §9."""

from cleaner.loop.iterations import checkpoint_dir, remove_run, run_loop

__all__ = ["checkpoint_dir", "remove_run", "run_loop"]
