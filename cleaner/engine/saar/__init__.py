"""SAAR (docs/architecture.md §4): the one walk that renders a trajectory raw, replaced or masked
(walk.py), the merges of a failed call's retries and the IS gate (merge.py), and the premise
diagnostic (premise.py). Collect renders its context with it, purify its training rows, and
`cleaner show` explains it."""
