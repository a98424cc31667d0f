"""jobs.py helpers that need no model."""

from __future__ import annotations

import gc

import pytest

from cleaner.jobs import _cyclic_gc_paused


def test_cyclic_gc_is_paused_inside_and_restored_after_an_error():
    assert gc.isenabled()
    with _cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _cyclic_gc_paused():
        raise RuntimeError("a failing job")
    assert gc.isenabled()


def test_a_collector_disabled_by_the_caller_stays_disabled():
    gc.disable()
    try:
        with _cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_purify_job_runs_with_the_collector_paused():
    from cleaner.jobs import JobError, purify_job

    seen = []

    class EmptyWarehouse:
        root = "empty"

        def read_rollouts(self, iteration):
            seen.append(gc.isenabled())
            return []

    with pytest.raises(JobError, match="no rollouts"):
        purify_job(EmptyWarehouse(), 0, [])
    assert seen == [False]
    assert gc.isenabled()
