"""Where a response budget binds: the share of each premise class that runs out of budget at iteration 0.

In the default toy setting (768 response tokens, 8 turns, K = 3) no rollout runs out of budget, so a
failed call costs tokens but never the answer. This bench collects iteration 0 of a toy policy under
the raw view (`--collect-view raw --rollback-prob 0`: every attempt stays in the context, so a failed
call uses up budget exactly as the baseline's collection does) for several `--max-response-tokens`
values, and counts per premise class (docs/architecture.md §4: clean, recovered, unrecovered) the
rollouts whose finish_reason says the budget ran out before an answer (`max_tokens` or
`max_turns`). Rollouts an infrastructure fault decided are in no class, as in the premise table.

The collections are exactly iteration 0 of `bench/paper_table.py` under the same budget (same
model, prompts, group size and seeds, raw view), so the shares describe the baseline's starting
point. Per budget and seed one warehouse under <out>/<toy>/budget-<B>/seed-<s>; re-running the
same command reuses what was collected.

    python bench/budget_binding.py --toys recover,env --budgets 256,216,212,208,204,200,192 \\
        --seeds 3 --out runs/budget_binding --results bench/results/budget_binding.md
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from heldout import OUT_OF_BUDGET  # bench/, beside this script

from cleaner.config import ENV_POLICY, RECOVER_POLICY, CollectConfig
from cleaner.config.flags import command_line
from cleaner.engine.collect.job import CollectRequest, collect_job
from cleaner.engine.purify.pipeline import infra_fault
from cleaner.engine.saar.premise import RolloutClass, classify
from cleaner.records import CollectView, Rollout, Segment
from cleaner.warehouse import Warehouse

# a path under the working directory is written relative to it, so the printed commands are portable
TOYS = {toy: Path(os.path.relpath(path)) if Path.cwd() in path.resolve().parents else path
        for toy, path in {"recover": RECOVER_POLICY, "env": ENV_POLICY}.items()}


# ---------------------------------------------------------------------------------------------
# Counting


@dataclass(frozen=True)
class ClassBudget:
    """The rollouts of one premise class in one collection: how many, how many ran out of budget."""

    rollouts: int
    out_of_budget: int  # finish_reason max_tokens or max_turns: no answer was given
    correct: int

    @property
    def share_out(self) -> float | None:
        return self.out_of_budget / self.rollouts if self.rollouts else None


def premise_classes(rollouts: Sequence[Rollout], segments: Sequence[Segment]) -> dict[str, RolloutClass]:
    """Each rollout's premise class by id; rollouts an infrastructure fault decided are left out."""
    grouped: dict[str, list[Segment]] = {rollout.rollout_id: [] for rollout in rollouts}
    for segment in segments:
        if segment.rollout_id in grouped:
            grouped[segment.rollout_id].append(segment)
    return {r.rollout_id: classify(grouped[r.rollout_id]) for r in rollouts
            if not infra_fault(r, grouped[r.rollout_id])}


def budget_by_class(classes: Mapping[str, RolloutClass], rollouts: Sequence[Rollout]) -> dict[RolloutClass, ClassBudget]:
    """Per premise class (every class, possibly empty): the rollouts, those out of budget, the
    correct ones. Each rollout counts under its class in `classes` (by id); one not there is left out.

    With the classes of the same collection this is the budgeted policy's own premise table; with
    those of an unbudgeted collection of the same seeds (same rollout ids, and the same samples up to
    where the budget cut them), it says what the budget does to the rollouts that would have recovered."""
    counts = {kind: [0, 0, 0] for kind in RolloutClass}
    for rollout in rollouts:
        if rollout.rollout_id not in classes:
            continue
        count = counts[classes[rollout.rollout_id]]
        count[0] += 1
        count[1] += rollout.finish_reason in OUT_OF_BUDGET
        count[2] += rollout.correct
    return {kind: ClassBudget(*count) for kind, count in counts.items()}


def pooled(parts: Sequence[dict[RolloutClass, ClassBudget]]) -> dict[RolloutClass, ClassBudget]:
    """The classes of several collections added up."""
    return {kind: ClassBudget(sum(p[kind].rollouts for p in parts), sum(p[kind].out_of_budget for p in parts),
                              sum(p[kind].correct for p in parts)) for kind in RolloutClass}


# ---------------------------------------------------------------------------------------------
# Collecting


def collect_config(args: argparse.Namespace, toy: str, budget: int, seed: int) -> CollectConfig:
    """Iteration 0 of the baseline arm of bench/paper_table.py under `budget`."""
    return CollectConfig(model=str(TOYS[toy]), n_prompts=args.prompts, group_size=args.group_size,
                         max_new_tokens=min(args.max_new_tokens, budget), max_response_tokens=budget,
                         max_turns=args.max_turns, max_retries=args.max_retries,
                         collect_view=CollectView.RAW, rollback_prob=0.0, seed=seed)


def command(config: CollectConfig, warehouse: Path) -> str:
    """The `cleaner collect` command that makes the same collection."""
    defaults = CollectConfig()
    flags = {"warehouse": str(warehouse), "model": config.model, "prompts": config.n_prompts,
             "group_size": config.group_size, "collect_view": "raw", "rollback_prob": 0, "seed": config.seed,
             "max_response_tokens": config.max_response_tokens}
    for name in ("max_new_tokens", "max_turns", "max_retries"):
        if getattr(config, name) != getattr(defaults, name):
            flags[name] = getattr(config, name)
    return command_line(flags, "collect")


@dataclass(frozen=True)
class MeasuredIteration:
    rollouts: list[Rollout]
    classes: dict[str, RolloutClass]  # premise class by rollout id (infrastructure faults left out)


def measure(args: argparse.Namespace, toy: str, budget: int, seed: int) -> MeasuredIteration:
    """Iteration 0 under `budget` (collected unless already stored), read back."""
    warehouse = Warehouse(Path(args.out) / toy / f"budget-{budget}" / f"seed-{seed}")
    collect_job(warehouse, CollectRequest(collect_config(args, toy, budget, seed), resume=True), progress=False)
    rollouts = warehouse.read_rollouts(0)
    return MeasuredIteration(rollouts, premise_classes(rollouts, warehouse.read_segments(0)))


@dataclass(frozen=True)
class BudgetRow:
    """One toy and budget over the seeds: the same rollouts classed without a budget and with it."""

    unbudgeted: list[dict[RolloutClass, ClassBudget]]  # per seed, classes of the reference collection
    own: list[dict[RolloutClass, ClassBudget]]  # per seed, classes of the budgeted collection itself
    accuracy: float
    reference_accuracy: float


def budget_row(reference: Sequence[MeasuredIteration], budgeted: Sequence[MeasuredIteration]) -> BudgetRow:
    rollouts = [r for c in budgeted for r in c.rollouts]
    before = [r for c in reference for r in c.rollouts]
    return BudgetRow([budget_by_class(ref.classes, b.rollouts) for ref, b in zip(reference, budgeted, strict=True)],
                     [budget_by_class(b.classes, b.rollouts) for b in budgeted],
                     sum(r.correct for r in rollouts) / len(rollouts), sum(r.correct for r in before) / len(before))


# ---------------------------------------------------------------------------------------------
# Table


def _cell(part: ClassBudget) -> str:
    share = "-" if part.share_out is None else f"{part.share_out:.0%}"
    return f"{part.rollouts}, {share}"


def markdown(rows: dict[tuple[str, int], BudgetRow], args: argparse.Namespace) -> str:
    lines = [f"| toy | `--max-response-tokens` | recovered at {args.reference}: out of budget, per seed | "
             f"recovered at {args.reference}: n, out | clean at {args.reference}: n, out | recovered at the budget: n, out | "
             "unrecovered at the budget: n, out | all: out of budget | accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (toy, budget), row in rows.items():
        before, own = pooled(row.unbudgeted), pooled(row.own)
        per_seed = " / ".join("-" if p[RolloutClass.RECOVERED].share_out is None
                              else f"{p[RolloutClass.RECOVERED].share_out:.2f}" for p in row.unbudgeted)
        n = sum(c.rollouts for c in own.values())
        out = sum(c.out_of_budget for c in own.values())
        lines.append(f"| {toy} | {budget} | {per_seed} | {_cell(before[RolloutClass.RECOVERED])} | "
                     f"{_cell(before[RolloutClass.CLEAN])} | {_cell(own[RolloutClass.RECOVERED])} | "
                     f"{_cell(own[RolloutClass.UNRECOVERED])} | {out / n:.1%} | "
                     f"{row.accuracy:.1%} ({row.accuracy - row.reference_accuracy:+.1%}) |")
    example = command(collect_config(args, args.toys[0], args.budgets[-1], 0),
                      Path(args.out) / args.toys[0] / f"budget-{args.budgets[-1]}" / "seed-0")
    return "\n".join([
        f"# Where the budget binds: iteration 0, raw view, {args.seeds} seed(s) x {args.prompts} x "
        f"{args.group_size} rollouts per toy and budget",
        "",
        "Out of budget: finish_reason `max_tokens` or `max_turns` (no answer). Classes as in the premise table "
        f"(clean, recovered, unrecovered). \"at {args.reference}\": the class of the same rollout (same id, the same "
        f"samples until the budget cuts them) collected with `--max-response-tokens {args.reference}`, where no "
        "rollout runs out; \"at the budget\": its class in the budgeted collection itself, where a retry the "
        "budget cut makes the rollout unrecovered. Accuracy in brackets: against the unbudgeted collection. "
        "Each cell is one `cleaner collect` per seed (seeds 0.."
        f"{args.seeds - 1}), e.g.:",
        "",
        f"```\n{example}\n```",
        "",
        *lines,
    ]) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toys", default="recover,env", help="comma-separated subset of " + ",".join(TOYS))
    parser.add_argument("--budgets", default="256,216,212,208,204,200,192",
                        help="comma-separated --max-response-tokens values")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    defaults = CollectConfig()
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                        help="per generation; capped at each budget")
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
    parser.add_argument("--max-retries", type=int, default=defaults.max_retries)
    parser.add_argument("--reference", type=int, default=768,
                        help="the budget no rollout reaches (the default): the rollouts' classes without a budget")
    parser.add_argument("--out", default="runs/budget_binding")
    parser.add_argument("--results", default="bench/results/budget_binding.md")
    args = parser.parse_args()
    args.toys = [toy for toy in args.toys.split(",") if toy]
    if not args.toys or set(args.toys) - set(TOYS):
        parser.error(f"toys come from {list(TOYS)}; got {args.toys}")
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = {}
    for toy in args.toys:
        reference = [measure(args, toy, args.reference, seed) for seed in range(args.seeds)]
        binding = sum(r.finish_reason in OUT_OF_BUDGET for c in reference for r in c.rollouts)
        if binding:
            raise SystemExit(f"error: {binding} rollouts of {toy} ran out of the reference budget {args.reference}; "
                             "give a larger --reference")
        for budget in args.budgets:
            rows[toy, budget] = budget_row(reference, [measure(args, toy, budget, seed) for seed in range(args.seeds)])
            recovered = pooled(rows[toy, budget].unbudgeted)[RolloutClass.RECOVERED]
            logging.info("%s budget %d: %d of %d recovered rollouts out of budget", toy, budget,
                         recovered.out_of_budget, recovered.rollouts)
    text = markdown(rows, args)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
