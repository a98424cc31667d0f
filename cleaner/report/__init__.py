"""Everything that reads a warehouse for people (docs/architecture.md §13): the `cleaner report`
job, its figures and page, `cleaner show`, the printed tables and the metrics loggers.

Nothing here loads torch (tests/test_layers.py checks it): a report is read on machines that never
train."""
