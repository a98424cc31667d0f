"""bench/budget_binding.py: which rollouts of each premise class ran out of budget, by hand."""

from __future__ import annotations

from budget_binding import ClassBudget, budget_by_class, pooled, premise_classes

from cleaner.engine.saar.premise import RolloutClass
from tests.factories import budget_rollout, tool_chain

CLEAN, RECOVERED, UNRECOVERED = RolloutClass.CLEAN, RolloutClass.RECOVERED, RolloutClass.UNRECOVERED


def collection():
    """clean (answered, right); recovered, out of tokens; recovered, answered, right; unrecovered,
    out of turns; a rollout an infrastructure fault ended; a rollout that never called the tool."""
    rollouts = [budget_rollout("clean"), budget_rollout("cut", "max_tokens", correct=False),
                budget_rollout("fixed"), budget_rollout("lost", "max_turns", correct=False),
                budget_rollout("fault", "error", correct=False), budget_rollout("guess", correct=False)]
    segments = (tool_chain("clean", ("ok",)) + tool_chain("cut", ("error", "ok")) + tool_chain("fixed", ("error", "ok"))
                + tool_chain("lost", ("error", "error")) + tool_chain("fault", ("error", "ok"))
                + tool_chain("guess", ()))
    return rollouts, segments


def test_premise_classes_leave_out_infrastructure_faults():
    rollouts, segments = collection()
    assert premise_classes(rollouts, segments) == {"clean": CLEAN, "cut": RECOVERED, "fixed": RECOVERED,
                                                   "lost": UNRECOVERED, "guess": CLEAN}


def test_out_of_budget_counts_max_tokens_and_max_turns_per_class():
    rollouts, segments = collection()
    counts = budget_by_class(premise_classes(rollouts, segments), rollouts)
    assert counts == {CLEAN: ClassBudget(2, 0, 1), RECOVERED: ClassBudget(2, 1, 1), UNRECOVERED: ClassBudget(1, 1, 0)}
    assert counts[RECOVERED].share_out == 0.5
    assert ClassBudget(0, 0, 0).share_out is None


def test_classes_of_an_unbudgeted_collection_follow_the_rollout_into_the_budgeted_one():
    # Without a budget "lost" would have recovered; with it, its retry was cut (unrecovered, out of
    # tokens). Counted under the unbudgeted classes it is a recovered rollout that ran out.
    rollouts, _ = collection()
    unbudgeted = {"clean": CLEAN, "cut": RECOVERED, "fixed": RECOVERED, "lost": RECOVERED}
    counts = budget_by_class(unbudgeted, rollouts)  # "fault" and "guess" are not classed: left out
    assert counts == {CLEAN: ClassBudget(1, 0, 1), RECOVERED: ClassBudget(3, 2, 1), UNRECOVERED: ClassBudget(0, 0, 0)}


def test_pooled_adds_seeds_up():
    one = {CLEAN: ClassBudget(3, 0, 2), RECOVERED: ClassBudget(2, 1, 1), UNRECOVERED: ClassBudget(0, 0, 0)}
    two = {CLEAN: ClassBudget(1, 1, 0), RECOVERED: ClassBudget(4, 3, 0), UNRECOVERED: ClassBudget(1, 1, 0)}
    assert pooled([one, two]) == {CLEAN: ClassBudget(4, 1, 2), RECOVERED: ClassBudget(6, 4, 1),
                                  UNRECOVERED: ClassBudget(1, 1, 0)}
