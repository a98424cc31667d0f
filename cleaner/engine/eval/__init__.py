"""Evaluation with test-time SAAR (docs/architecture.md §12): the eval job, its plans and metrics."""
