"""Evaluation with test-time SAAR (docs/architecture.md §12): graders, metrics and the report."""
