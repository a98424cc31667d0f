"""Rewards (docs/architecture.md §5, §12): final answers (answers.py: math-verify, GPQA letters)
and programs run against stdin/stdout tests (programs.py). Collect and eval both grade with them."""
