"""The corpus has the intended failure mix, real error texts, and the stated similarity ranges."""

from __future__ import annotations

import difflib
import re

import pytest

from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.model.chat import parse_tool_call
from cleaner.toys.corpus import APPROACH, NONE, TYPO, CorpusConfig, build_corpus


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(CorpusConfig(size=1000, seed=0, fail_share=0.3, approach_share=0.5))


def test_failure_shares_match_the_config(corpus):
    typo = sum(e.failure == TYPO for e in corpus)
    approach = sum(e.failure == APPROACH for e in corpus)
    # 1000 draws: the binomial sd of the failure count is ~14.5, of each kind ~11
    assert 255 <= typo + approach <= 345
    assert 110 <= typo <= 190 and 110 <= approach <= 190


def test_typo_fixes_are_near_copies_and_approach_fixes_are_different_code(corpus):
    for example in corpus:
        if example.failed_code is None:
            assert example.failure == NONE
            continue
        # the ratio SAAR's merge compares calls by (cleaner/engine/saar/merge.py)
        ratio = difflib.SequenceMatcher(None, example.failed_code, example.fixed_code).ratio()
        if example.failure == TYPO:
            assert 0.9 <= ratio < 1.0
        else:
            assert example.failure == APPROACH and 0.2 <= ratio <= 0.45


def test_failures_carry_the_real_error_and_are_then_fixed(corpus):
    for example in corpus:
        calls = [parse_tool_call(text) for text in example.assistant_texts[:-1]]
        assert [c.code for c in calls][-1] == example.fixed_code
        assert "Tool call success" in example.tool_texts[-1]
        if example.failure == NONE:
            assert len(example.assistant_texts) == 2
            continue
        assert len(example.assistant_texts) == 3 and calls[0].code == example.failed_code
        error_text = example.tool_texts[0]
        assert "Tool call failure\nreason: error\nstderr: " in error_text
        expected = ("ModuleNotFoundError",) if example.failure == APPROACH else ("NameError", "SyntaxError")
        assert any(f"stderr: {name} at line " in error_text for name in expected)
        # the retry's reasoning differs from the first attempt's
        assert example.assistant_texts[0].split("\n")[0] != example.assistant_texts[1].split("\n")[0]


def test_final_answers_are_correct_and_boxed(corpus):
    for example in corpus[:150]:  # math-verify costs ~7 ms a call
        response = "".join(a + t for a, t in zip(example.assistant_texts, example.tool_texts + ("",), strict=True))
        assert example.assistant_texts[-1].endswith("<|im_end|>")
        assert compute_reward(response, example.task.ground_truth, "toy").correct


def test_deterministic_and_fail_share_zero():
    assert build_corpus(CorpusConfig(size=50, seed=3)) == build_corpus(CorpusConfig(size=50, seed=3))
    assert all(e.failure == NONE for e in build_corpus(CorpusConfig(size=100, fail_share=0.0)))
    with pytest.raises(ValueError, match="fail_share"):
        CorpusConfig(fail_share=1.5)


def test_local_exec_words_errors_exactly_like_the_real_sandbox():
    sandbox_module = pytest.importorskip("cleaner.sandbox")
    from cleaner.tools.responses import format_tool_response
    from cleaner.toys.local_exec import run_snippets

    examples = build_corpus(CorpusConfig(size=80, seed=5, fail_share=0.6))
    codes = [e.failed_code for e in examples if e.failed_code] + [e.fixed_code for e in examples[:10]]
    assert {e.failure for e in examples} == {NONE, TYPO, APPROACH}
    with sandbox_module.make_sandbox(sandbox_module.SandboxConfig()) as sandbox:
        real = sandbox.run_many(codes)
    local = run_snippets(codes)
    worded = [format_tool_response(r.status == "ok", r.stdout, r.stderr, None if r.status == "ok" else r.status)
              for r in real]  # as the collect loop words the sandbox's results
    assert [r.response for r in local] == worded
    assert [r.error_type for r in local] == [r.error_type for r in real]


def test_environment_failures_fix_with_the_same_numbers_in_the_same_order():
    from cleaner.toys.corpus import ENVIRONMENT

    examples = build_corpus(CorpusConfig(size=200, seed=4, fail_share=0.5, failures="environment"))
    failed = [e for e in examples if e.failure != NONE]
    assert failed and {e.failure for e in failed} == {ENVIRONMENT}
    number = re.compile(r"(?<![A-Za-z_\d])\d+")  # not the 2 of sympy2
    for example in failed:
        numbers = [int(n) for n in number.findall(example.task.messages[-1]["content"])]
        # the failed call and its fix write the problem's numbers in the problem's order
        for code in (example.failed_code, example.fixed_code):
            assert [int(n) for n in number.findall(code)] == numbers[:4]
        assert example.fixed_code == "print(({} * {} + {}) % {})".format(*numbers[:4])
    assert {e.tool_texts[0].split("stderr: ")[1].split(" ")[0] for e in failed} == {
        "ModuleNotFoundError", "AttributeError"}
    with pytest.raises(ValueError, match="failures"):
        CorpusConfig(failures="some")


def test_no_tool_trajectories_answer_a_wrong_guess_at_once():
    from cleaner.toys.corpus import ENVIRONMENT, NO_TOOL

    config = CorpusConfig(size=300, seed=5, fail_share=0.5, failures="environment", no_tool_share=0.3)
    examples = build_corpus(config)
    kinds = [e.failure for e in examples]
    assert 0.2 < kinds.count(NO_TOOL) / len(kinds) < 0.4 and {NONE, ENVIRONMENT, NO_TOOL} == set(kinds)
    for example in (e for e in examples if e.failure == NO_TOOL):
        (text,) = example.assistant_texts  # one turn, no call, no tool segment
        assert example.tool_texts == () and "<tool_call>" not in text and text.endswith("<|im_end|>")
        guess = int(re.search(r"\\boxed\{(\d+)\}", text).group(1))
        modulus = int(re.findall(r"\d+", example.task.messages[-1]["content"])[3])
        assert 0 <= guess < modulus and str(guess) != example.task.ground_truth
    # a share of 0 draws nothing: the corpora of the other policies are unchanged
    assert build_corpus(CorpusConfig(size=50, seed=2)) == build_corpus(CorpusConfig(size=50, seed=2, no_tool_share=0.0))
