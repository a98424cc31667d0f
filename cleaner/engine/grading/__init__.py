"""Rewards (docs/architecture.md §5, §12): final answers (answers.py: math-verify, GPQA letters),
programs run against stdin/stdout tests (programs.py) and the user's reward file (reward_file.py),
each computed off the collection's loop under a timeout (runner.py). Collect and eval both grade
with them."""
