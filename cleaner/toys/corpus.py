"""Synthetic tool-using trajectories for the tiny policy's supervised training.

Every example answers one toy problem (tasks.py) with the Python tool. A share `fail_share` of
first calls fail, then are corrected:
- TYPO: the same code with one slip (`pirnt(`, a misspelt variable, a missing `)`), giving a
  NameError or SyntaxError; the retry is the same code corrected (difflib ratio ~0.9-0.98), so
  SAAR merges it shallow at gamma 0.5.
- APPROACH: a call to a module that does not exist (`from mathx import mulmod`, `import sympy2`,
  ...); the retry uses different reasoning and different code (ratio ~0.2-0.45), so SAAR merges it
  deep.
With `failures = "environment"` (the second tiny policy) the failures are only of a third kind:
- ENVIRONMENT: a call to a function the environment lacks (`mathx.mulmod`, `sympy2.Mod`,
  `modcalc.solve`, `math.mod`), chosen before any number is written, with the numbers in the
  problem's order; the retry is the one-line program with the same numbers in the same order. A
  typo is a slip of copying, so a rollout that makes one tends to miscopy numbers too, and on the
  mixed corpus a failed call predicts a wrong answer; an environment failure says nothing about
  the numbers, and its fix copies them from the line just above, so a recovered rollout is about
  as accurate as a clean one: CLEANER's premise (docs/architecture.md §11).
`slip_share` makes a share of trajectories miscopy one digit of one number from the question, in
every call of the trajectory, and report what that code printed: wrong answers that do not depend
on whether a call failed, so accuracy can be set without touching the premise.
`no_tool_share` makes a share of trajectories answer at once without calling the tool, with a
guess (a number below the modulus, never the answer): the behaviour that loses. With environment
failures at a high `fail_share`, the tool users who fail and recover are then right far more often
than the group's mean, so outcome-only GRPO gives their failed calls positive credit (the third
tiny policy, docs/architecture.md §11).
Each assistant turn starts with a short reasoning sentence, so shallow and deep merges keep
different reasoning. Error texts come from really running the code, never from a hand-written
string. The default executor is `local_exec` (one child process for the whole corpus, ~1 s): its
texts are tested to equal the real sandbox's word for word (tests/toys/test_corpus.py),
while the sandbox would need ~15 min of forks for a 40k corpus; pass `executor` to use another.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cleaner.engine.collect.tasks import TOY_SOURCE, Task, ToyProblem, toy_problem
from cleaner.engine.model.chat import IM_END, format_call, tool_response_text
from cleaner.toys.local_exec import run_snippets

NONE, TYPO, APPROACH, ENVIRONMENT = "none", "typo", "approach", "environment"
NO_TOOL = "no_tool"  # not a failed call: the trajectory answers without calling the tool
FAILURE_SETS = ("mixed", "environment")  # mixed: typos and approaches; environment: ENVIRONMENT only
CORPUS_SEED_OFFSET = 1_000_000  # corpus problems never coincide with toy_tasks(n, seed) for small seeds


@dataclass(frozen=True)
class CorpusConfig:
    size: int = 40_000  # number of trajectories
    seed: int = 0  # corpus problems use toy seed `seed + CORPUS_SEED_OFFSET`
    fail_share: float = 0.3  # share of first calls that fail
    approach_share: float = 0.5  # among failures: share by wrong approach (the rest are typos)
    failures: str = "mixed"  # mixed (typos and approaches) | environment (see the module docstring)
    slip_share: float = 0.0  # share of trajectories that miscopy one digit of the question everywhere
    no_tool_share: float = 0.0  # share of trajectories that answer with a guess, without calling the tool

    def __post_init__(self) -> None:
        if self.failures not in FAILURE_SETS:
            raise ValueError(f"failures must be one of {FAILURE_SETS}, got {self.failures!r}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        for name in ("fail_share", "approach_share", "slip_share", "no_tool_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class CorpusExample:
    task: Task
    failure: str  # none | typo | approach | environment | no_tool
    assistant_texts: tuple[str, ...]  # calls end with </tool_call>, the answer with <|im_end|>
    tool_texts: tuple[str, ...]  # tool segment texts; tool_texts[i] follows assistant_texts[i]
    failed_code: str | None  # the failing first call's code (None when failure == none)
    fixed_code: str  # the code of the successful call


# ---------------------------------------------------------------------------------------------
# Code and reasoning templates

START_REASONING = (
    "I will compute this with Python.",
    "Let me evaluate the expression with the tool.",
    "I can compute it in Python.",
)
TYPO_REASONING = {
    "NameError": ("I misspelled a name. Let me fix it.", "There is a typo in a name; fixing it."),
    "SyntaxError": ("I missed a closing parenthesis. Let me fix it.", "The parentheses are unbalanced; fixing it."),
}
FINAL_TEMPLATES = ("The result is {n}.\n\\boxed{{{n}}}", "So the answer is \\boxed{{{n}}}.")
# A trajectory that answers without the tool: one of these sentences, then a guess.
NO_TOOL_TEMPLATES = (
    "I can do this in my head. The answer is \\boxed{{{n}}}.",
    "No tool is needed here.\n\\boxed{{{n}}}",
    "This is small enough to compute mentally: \\boxed{{{n}}}.",
)

# (reasoning, code) of calls to modules that do not exist; the fix is a different program.
APPROACHES = (
    ("I will use the mulmod helper from mathx.", "from mathx import mulmod\nprint(mulmod({a}, {b}, {c}, {d}))"),
    ("Let me use sympy2 for the modulus.", "import sympy2\nprint(sympy2.Mod({a} * {b} + {c}, {d}))"),
    ("The modcalc module can solve this.", "import modcalc\nprint(modcalc.solve({a}, {b}, {c}, {d}))"),
)
APPROACH_FIX_REASONING = (
    "The module {module} is not available, so I will use plain arithmetic.",
    "{module} does not exist here. I will compute step by step instead.",
)
APPROACH_FIX_CODE = "product = {a} * {b}\ntotal = product + {c}\nremainder = total % {d}\nprint(remainder)"

# (reasoning, code, fix reasoning) of calls to functions the environment lacks; the fix is always
# ENVIRONMENT_FIX_CODE, whose numbers come in the same order as in the failed call.
ENVIRONMENTS = (
    ("I will use the mulmod helper from mathx.", "from mathx import mulmod\nprint(mulmod({a}, {b}, {c}, {d}))",
     "mathx is not installed here, so I will use plain arithmetic."),
    ("Let me use sympy2 for the modulus.", "import sympy2\nprint(sympy2.Mod({a} * {b} + {c}, {d}))",
     "sympy2 does not exist. I will use the % operator instead."),
    ("The modcalc module can solve this.", "import modcalc\nprint(modcalc.solve({a}, {b}, {c}, {d}))",
     "modcalc is not available, so I will compute it directly."),
    ("math should have a mod function.", "import math\nprint(math.mod({a} * {b} + {c}, {d}))",
     "math has no mod function. I will use the % operator."),
)
ENVIRONMENT_FIX_CODE = "print(({a} * {b} + {c}) % {d})"


def good_codes(p: ToyProblem) -> tuple[str, ...]:
    return (
        f"print(({p.a} * {p.b} + {p.c}) % {p.d})",
        f"value = {p.a} * {p.b} + {p.c}\nprint(value % {p.d})",
    )


def typo_of(code: str, rng: random.Random) -> str:
    """One slip in correct code: misspelt print, misspelt variable, or a missing `)`."""
    kinds = ["print", "paren"] + (["variable"] if code.startswith("value") else [])
    kind = rng.choice(kinds)
    if kind == "print":
        return code.replace("print(", rng.choice(("pirnt(", "prnt(", "pritn(")), 1)
    if kind == "variable":
        head, last = code.rsplit("\n", 1)
        return head + "\n" + last.replace("value", rng.choice(("valeu", "vaule", "valu")))
    head, _, last = code.rpartition("\n")
    return (head + "\n" if head else "") + last[:-1]  # drop the final ")"


def _call_text(reasoning: str, code: str) -> str:
    return f"{reasoning}\n{format_call(code)}"


# ---------------------------------------------------------------------------------------------
# Plan -> execute -> assemble


@dataclass(frozen=True)
class _TranscriptPlan:
    task: Task
    problem: ToyProblem
    failure: str
    first_reasoning: str
    failed_code: str | None
    fixed_code: str
    rng_state: int  # seed for the wording chosen after execution
    fix_reasoning: str | None = None  # fixed in the plan (ENVIRONMENT), else worded after execution
    guess: int | None = None  # NO_TOOL: the number answered without calling the tool


def _plan(problem: ToyProblem, task: Task, config: CorpusConfig, rng: random.Random) -> _TranscriptPlan:
    if config.no_tool_share > 0 and rng.random() < config.no_tool_share:  # no draw at 0, as slip_share
        return _no_tool_plan(problem, task, rng)
    draw = rng.random()
    failure = NONE
    if draw < config.fail_share:
        if config.failures == "environment":
            failure = ENVIRONMENT
        else:
            failure = APPROACH if rng.random() < config.approach_share else TYPO
    if config.slip_share > 0 and rng.random() < config.slip_share:  # no draw at 0: corpora stay as they were
        problem = _slipped(problem, rng)
    good = rng.choice(good_codes(problem))
    values = {"a": problem.a, "b": problem.b, "c": problem.c, "d": problem.d}
    if failure == ENVIRONMENT:
        reasoning, template, fix_reasoning = rng.choice(ENVIRONMENTS)
        return _TranscriptPlan(task, problem, failure, reasoning, template.format(**values),
                               ENVIRONMENT_FIX_CODE.format(**values), rng.getrandbits(32), fix_reasoning)
    if failure == APPROACH:
        reasoning, template = rng.choice(APPROACHES)
        return _TranscriptPlan(task, problem, failure, reasoning, template.format(**values),
                               APPROACH_FIX_CODE.format(**values), rng.getrandbits(32))
    failed = typo_of(good, rng) if failure == TYPO else None
    return _TranscriptPlan(task, problem, failure, rng.choice(START_REASONING), failed, good, rng.getrandbits(32))


def _no_tool_plan(problem: ToyProblem, task: Task, rng: random.Random) -> _TranscriptPlan:
    """An answer without the tool: a guess below the modulus, never the right one."""
    guess = rng.randrange(problem.d - 1)
    guess += guess >= problem.answer  # skips the answer, so every guess is wrong
    return _TranscriptPlan(task, problem, NO_TOOL, "", None, "", rng.getrandbits(32), guess=guess)


def _slipped(problem: ToyProblem, rng: random.Random) -> ToyProblem:
    """The problem with one digit of a, b or c miscopied (the leading digit stays non-zero)."""
    name = rng.choice(("a", "b", "c"))
    digits = list(str(getattr(problem, name)))
    position = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[position] and (position or d != "0")]
    digits[position] = rng.choice(choices)
    return dataclasses.replace(problem, **{name: int("".join(digits))})


def _assemble(plan: _TranscriptPlan, failed_response: str | None, error_type: str | None,
              fixed_response: str) -> CorpusExample:
    rng = random.Random(plan.rng_state)
    if plan.failure == NO_TOOL:
        text = rng.choice(NO_TOOL_TEMPLATES).format(n=plan.guess) + IM_END
        return CorpusExample(plan.task, plan.failure, (text,), (), None, plan.fixed_code)
    assistant, tools = [], []
    if plan.failed_code is not None:
        assistant.append(_call_text(plan.first_reasoning, plan.failed_code))
        tools.append(tool_response_text(failed_response))
        if plan.fix_reasoning is not None:
            fix_reasoning = plan.fix_reasoning
        elif plan.failure == APPROACH:
            module = plan.failed_code.split()[1].split(".")[0]
            fix_reasoning = rng.choice(APPROACH_FIX_REASONING).format(module=module)
        else:
            fix_reasoning = rng.choice(TYPO_REASONING[error_type])
        assistant.append(_call_text(fix_reasoning, plan.fixed_code))
    else:
        assistant.append(_call_text(plan.first_reasoning, plan.fixed_code))
    tools.append(tool_response_text(fixed_response))
    assistant.append(rng.choice(FINAL_TEMPLATES).format(n=plan.problem.answer) + IM_END)
    return CorpusExample(plan.task, plan.failure, tuple(assistant), tuple(tools),
                         plan.failed_code, plan.fixed_code)


Executor = Callable[[Sequence[str]], list]  # codes -> results with .ok, .response, .error_type


def build_corpus(config: CorpusConfig, executor: Executor | None = None) -> list[CorpusExample]:
    """The corpus, deterministic in `config`; every call is really executed by `executor`."""
    executor = executor or run_snippets
    rng = random.Random(f"corpus/{config.seed}")
    plans = []
    for index in range(config.size):
        problem = toy_problem(config.seed + CORPUS_SEED_OFFSET, index)
        task = Task(f"corpus-{config.seed}-{index}", ({"role": "user", "content": problem.question},),
                    str(problem.answer), TOY_SOURCE)
        plans.append(_plan(problem, task, config, rng))
    tool_plans = [plan for plan in plans if plan.failure != NO_TOOL]
    codes = [plan.fixed_code for plan in tool_plans] + [p.failed_code for p in tool_plans if p.failed_code]
    results = executor(codes)
    fixed_results, failed_results = iter(results[: len(tool_plans)]), iter(results[len(tool_plans):])
    examples = []
    for plan in plans:
        if plan.failure == NO_TOOL:
            examples.append(_assemble(plan, None, None, ""))
            continue
        fixed = next(fixed_results)
        if not fixed.ok or fixed.response.split("stdout: ")[-1].strip() != str(plan.problem.answer):
            raise RuntimeError(f"corpus code gave a wrong result: {plan.fixed_code!r} -> {fixed.response!r}")
        failed = next(failed_results) if plan.failed_code else None
        if failed is not None and failed.ok:
            raise RuntimeError(f"corpus failure did not fail: {plan.failed_code!r}")
        examples.append(_assemble(plan, failed and failed.response, failed and failed.error_type,
                                  fixed.response))
    return examples
