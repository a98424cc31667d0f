"""`cleaner run`: the iteration loop (iterations.py) over the stages' jobs, in one process or SPMD
on the ranks a launcher started (ranks.py), from the config resume.py resolves, docs/architecture.md §9.

Nothing is imported here: `cleaner.loop.ranks` is read by the CLI's error path, which must not load
the model stack that `iterations` brings (torch, transformers)."""
