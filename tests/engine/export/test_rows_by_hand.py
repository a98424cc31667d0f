"""`cleaner export` on small hand-built warehouses of the tiny chat format (engine/export/job.py,
rows.py, folder.py, card.py, warehouse/selection.py): every column of a row against the value the
rollouts it came from give by construction — which attempt of a chain is rejected and which error
it met, which rollouts of which group an outcome pair joins and which side is chosen, the
provenance of each row, the card's counts by depth and error type, the SQL count under a
`--where`, shard sizes at an exact multiple, and a warehouse whose manifest is not yet written
left as it was."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from cleaner.config import DEFAULT_POLICY, PurifyConfig, SimilarityOn
from cleaner.engine.export.conversation import Template
from cleaner.engine.export.job import ExportRequest, export_job
from cleaner.engine.export.rows import chain_pairs, purified_conversation
from cleaner.engine.model.chat import format_call, tool_response_text
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.saar.walk import RenderSettings
from cleaner.records import FinishReason, PurifyConfigRow, Segment, SegmentKind, ToolStatus
from cleaner.warehouse import Warehouse
from tests.factories import make_rollout
from tests.helpers import tree_digest

OK, ERROR, TIMEOUT, INFRA = ToolStatus.OK, ToolStatus.ERROR, ToolStatus.TIMEOUT, ToolStatus.INFRA_ERROR


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_POLICY)


def _prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def _segments(tokenizer, rollout_id: str, question: str, steps, answer: str | None) -> list[Segment]:
    """A rollout's segments as the collection stores them: the prompt; per step, each attempt as
    (reasoning, code, status, error_type), an assistant call and its tool answer (reasoning None: the
    turn is the call alone); the final answer (None: the rollout stops after its calls)."""
    def segment(seq, kind, step, attempt, text, status=None, code=None, error_type=None):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        assistant = kind == SegmentKind.ASSISTANT
        call_start = next((i for i in range(len(ids)) if "<tool_call>" in tokenizer.decode(ids[:i + 1])), None) \
            if assistant and code is not None else None
        return Segment(rollout_id, 0, seq, kind, step, attempt, ids, (-0.1,) * len(ids) if assistant else None, text,
                       call_start=call_start, tool_code=code, tool_status=status, error_type=error_type)

    own = [segment(0, SegmentKind.PROMPT, None, None, _prompt(tokenizer, question))]
    for step, attempts in enumerate(steps):
        for attempt, (reasoning, code, status, error_type) in enumerate(attempts):
            text = format_call(code) if reasoning is None else f"{reasoning}\n{format_call(code)}"
            own.append(segment(len(own), SegmentKind.ASSISTANT, step, attempt, text, code=code))
            response = "Tool call success\nstdout: 42\n" if status == OK else f"Tool call failure\nreason: {status}"
            own.append(segment(len(own), SegmentKind.TOOL, step, attempt, tool_response_text(response), status,
                               code=code, error_type=error_type))
    if answer is not None:
        own.append(segment(len(own), SegmentKind.ASSISTANT, len(steps), 0, f"So \\boxed{{{answer}}}.<|im_end|>"))
    return own


def _export(root, tmp_path, name: str = "ds", **changes):
    request = ExportRequest(**{"iterations": (0,), "form": "sft", "out": tmp_path / name, "policy": DEFAULT_POLICY,
                               **changes})
    outcome = export_job(Warehouse(root), request, progress=False)
    return outcome, pq.read_table(outcome.out / "data").to_pylist() if request.form != "messages" else None


# ---------------------------------------------------------------------------------------------
# Chain pairs


def _chain_warehouse(root, tokenizer):
    """R3 fails step 0 twice (NameError, then ZeroDivisionError) and fixes it at the third attempt
    with similar code (a shallow chain); D times out at step 0 and fixes it with different code (a
    deep chain)."""
    rollouts = [make_rollout("D", reward=0.5), make_rollout("R3", reward=1.0)]
    segments = [
        *_segments(tokenizer, "D", "What is 6 * 7?", [[
            ("Compute.", "print(6 * 7)", TIMEOUT, None),
            ("Differently.", "a = 6\nb = 7\nfor _ in range(1):\n    total = a * b\nprint(total)", OK, None)]], "42"),
        *_segments(tokenizer, "R3", "What is 6 * 7?", [[
            ("Compute.", "print(6 * 7)", ERROR, "NameError"),
            ("Retry.", "print(6 * 8)", ERROR, "ZeroDivisionError"),
            ("Again.", "print(6 * 9)", OK, None)]], "42"),
    ]
    Warehouse(root).write_rollouts(0, rollouts, segments)


def _call(reasoning: str, code: str) -> dict:
    """An assistant message with one code call, as a Parquet row holds it (arguments as JSON text)."""
    arguments = json.dumps({"code": code})
    return {"role": "assistant", "content": reasoning, "tool_calls": [
        {"type": "function", "function": {"name": "code_interpreter", "arguments": arguments}}]}


def _user(question: str) -> dict:
    return {"role": "user", "content": question, "tool_calls": None}


def test_a_chain_pair_rejects_the_first_attempt_and_names_its_error(tmp_path, tokenizer):
    """Of a chain of three attempts, `rejected` is the first (the turn the policy wrote at that
    context, not the last failure before the fix) and `error_type` its exception; `chosen` is
    SAAR's merge (shallow: the first reasoning with the fixed call; deep: the fixing attempt). The
    row names the rollout, says the view is SAAR's rendering whatever --view was, and the card
    counts the pairs by depth and by error type."""
    _chain_warehouse(tmp_path / "wh", tokenizer)
    outcome, rows = _export(tmp_path / "wh", tmp_path, form="preference")
    assert outcome.rows == outcome.counted == 2
    deep, shallow = sorted(rows, key=lambda row: row["rollout_id"])
    assert shallow["prompt"] == deep["prompt"] == [_user("What is 6 * 7?")]
    assert shallow["rejected"] == [_call("Compute.", "print(6 * 7)")]
    assert shallow["chosen"] == [_call("Compute.", "print(6 * 9)")]
    assert (shallow["step"], shallow["depth"], shallow["error_type"]) == (0, "shallow", "NameError")
    assert deep["rejected"] == [_call("Compute.", "print(6 * 7)")]
    assert deep["chosen"] == [_call("Differently.", "a = 6\nb = 7\nfor _ in range(1):\n    total = a * b\nprint(total)")]
    assert (deep["step"], deep["depth"], deep["error_type"]) == (0, "deep", "timeout")  # no exception: the status
    for row, reward in ((shallow, 1.0), (deep, 0.5)):
        assert {key: row[key] for key in ("pair", "rejected_rollout_id", "iteration", "group_id", "prompt_id",
                                          "policy_version", "collect_config_id", "purify_config_id", "view",
                                          "reward", "rejected_reward")} == {
            "pair": "chain", "rejected_rollout_id": None, "iteration": 0, "group_id": "it0-p0", "prompt_id": "p0",
            "policy_version": "test", "collect_config_id": "cfg", "purify_config_id": None, "view": "purified",
            "reward": reward, "rejected_reward": None}
    card = (outcome.out / "README.md").read_text()
    for line in ("- pairs deep: 1", "- pairs shallow: 1", "- pairs failing with NameError: 1",
                 "- pairs failing with timeout: 1", "- pairs by the warehouse's SQL count: 2 (rows: 2)"):
        assert f"\n{line}\n" in card, line


def _stored_apart(segments: list[Segment]) -> list[Segment]:
    """The segments with each assistant turn's stored text unlike its tokens' decoding ("Stored "
    before it), so a row shows which of the two it took."""
    return [dataclasses.replace(s, text="Stored " + s.text) if s.kind == SegmentKind.ASSISTANT else s
            for s in segments]


def _message(role: str, content: str, code: str | None = None) -> dict:
    """A message as rows.py builds it (arguments as a dict, before the Parquet row's JSON text)."""
    calls = [{"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}]
    return {"role": role, "content": content, **({"tool_calls": calls} if code is not None else {})}


def test_a_pairs_context_keeps_whole_turns_stored_text_and_decodes_what_saar_spliced(tokenizer):
    """A chain at step 1 after a clean step 0: the pair's prompt holds step 0's turns with their
    roles, each whole segment as stored; `chosen`, the shallow merge spliced from two attempts, is
    decoded from its tokens; `rejected` is the first attempt as stored. A merge whose earlier
    reasoning is empty keeps one piece of the fix, its call alone, decoded, never the fix's whole
    stored turn (its own reasoning included)."""
    question, ok_step = "What is 6 * 7?", [("Look.", "print(1)", OK, None)]
    context = [_message("user", question), _message("assistant", "Stored Look.", "print(1)"),
               _message("tool", "Tool call success\nstdout: 42\n")]
    chain = [("Compute.", "print(6 * 7)", ERROR, "NameError"), ("Retry.", "print(6 * 8)", OK, None)]
    segments = _stored_apart(_segments(tokenizer, "C", question, [ok_step, chain], "42"))
    [pair] = chain_pairs(segments, RenderSettings(True), Template(tokenizer, []), tokenizer.decode)
    assert pair.prompt == context
    assert pair.chosen == [_message("assistant", "Compute.", "print(6 * 8)")]
    assert pair.rejected == [_message("assistant", "Stored Compute.", "print(6 * 7)")]
    assert (pair.step, pair.depth, pair.error_type) == (1, "shallow", "NameError")

    bare = [(None, "print(6 * 7)", ERROR, "NameError"), chain[1]]
    segments = _stored_apart(_segments(tokenizer, "B", question, [ok_step, bare], "42"))
    assert segments[3].call_start == 0  # the failed turn is its call alone: SAAR keeps none of it
    [pair] = chain_pairs(segments, RenderSettings(True), Template(tokenizer, []), tokenizer.decode)
    assert pair.chosen == [_message("assistant", "", "print(6 * 8)")]


def test_a_purified_conversation_is_the_stored_row_split_where_its_loss_mask_changes(tokenizer):
    """SAAR's row of a chain fixed at its third attempt: the first reasoning with the fixed call,
    the fix's tool answer, the final answer; each turn decoded from the row's tokens, and the whole
    renders back to them."""
    chain = [("Compute.", "print(6 * 7)", ERROR, "NameError"), ("Retry.", "print(6 * 8)", ERROR, "ZeroDivisionError"),
             ("Again.", "print(6 * 9)", OK, None)]
    segments = _segments(tokenizer, "R3", "What is 6 * 7?", [chain], "42")
    rows, _ = render_iteration([make_rollout("R3", reward=1.0)], segments, PurifyConfig(rollback_prob=1.0),
                               tokenizer.decode)
    conversation = purified_conversation(_stored_apart(segments), rows[0], Template(tokenizer, []), tokenizer.decode)
    assert conversation.messages == [_message("user", "What is 6 * 7?"),
                                     _message("assistant", "Compute.", "print(6 * 9)"),
                                     _message("tool", "Tool call success\nstdout: 42\n"),
                                     _message("assistant", "So \\boxed{42}.")]
    assert conversation.exact and conversation.prompt_length == 1


def _down_sampled_warehouse(root, tokenizer) -> PurifyConfig:
    """One group of four (two correct, two wrong) purified under RoC keeping two: a correct and a
    wrong rollout are dropped, their rows stored with nothing trained."""
    rollouts = [dataclasses.replace(make_rollout(f"s{i}", reward=reward), sample_index=i)
                for i, reward in enumerate((1.0, 1.0, 0.0, 0.0))]
    segments = [s for r in rollouts for s in _segments(tokenizer, r.rollout_id, "What is 6 * 7?",
                                                       [[("Compute.", "print(6 * 7)", OK, None)]], "42")]
    config = PurifyConfig(rollback_prob=1.0, down_sample="roc", down_sample_to=2, roc_min_negatives=1,
                          roc_min_positives=1)
    rows, _ = render_iteration(rollouts, segments, config, tokenizer.decode)
    assert [row.dropped for row in rows] == [False, True, False, True]
    warehouse = Warehouse(root)
    warehouse.write_rollouts(0, rollouts, segments)
    warehouse.write_purified(0, PurifyConfigRow(config_id=config.config_id, gamma=config.gamma,
                                                rollback_prob=config.rollback_prob, similarity_on=config.similarity_on,
                                                purify_when=config.purify_when, params_json=config.to_json(),
                                                edit=config.edit), rows)
    return config


def test_the_purified_view_leaves_out_the_rollouts_its_config_trains_nothing_of(tmp_path, tokenizer):
    """What the config trained: the two kept rollouts, each a conversation (never a response as one
    tool turn); the card counts the two left out; outcome pairs pair the kept ones, as their SQL
    count says."""
    config = _down_sampled_warehouse(tmp_path / "wh", tokenizer)
    outcome, rows = _export(tmp_path / "wh", tmp_path, view="purified", config_id=config.config_id)
    assert [row["rollout_id"] for row in rows] == ["s0", "s2"] and outcome.rows == 2
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"] and row["exact"]
    card = (outcome.out / "README.md").read_text()
    assert ("\n- rollouts left out, their purified rows training nothing (down-sampled out, or masked by the void-turn "
            "filter): 2\n") in card
    pairs, pair_rows = _export(tmp_path / "wh", tmp_path, "pairs", view="purified", config_id=config.config_id,
                               form="preference", pairs="outcome")
    assert pairs.rows == pairs.counted == 1
    assert (pair_rows[0]["rollout_id"], pair_rows[0]["rejected_rollout_id"]) == ("s0", "s2")


def test_chain_pairs_compare_calls_by_their_tokens_with_the_policys_decoding(tokenizer):
    """similarity_on call decodes the two calls' tokens (SAAR refuses it without a decode
    function): the export hands its decoding to the walk, and the pair comes out as with code."""
    chain = [("Compute.", "print(6 * 7)", ERROR, "NameError"), ("Retry.", "print(6 * 8)", OK, None)]
    segments = _segments(tokenizer, "C", "What is 6 * 7?", [chain], "42")
    view = RenderSettings(True, similarity_on=SimilarityOn.CALL)
    [pair] = chain_pairs(segments, view, Template(tokenizer, []), tokenizer.decode)
    assert (pair.depth, pair.chosen) == ("shallow", [_message("assistant", "Compute.", "print(6 * 8)")])


def test_where_narrows_the_pairs_and_the_sql_count_alike(tmp_path, tokenizer):
    """--where selects the rollouts before anything is counted: the documented SQL count of the
    chains is over the selection, so it still equals the pairs written."""
    _chain_warehouse(tmp_path / "wh", tokenizer)
    outcome, rows = _export(tmp_path / "wh", tmp_path, form="preference", where="rollout_id = 'R3'")
    assert [row["rollout_id"] for row in rows] == ["R3"]
    assert outcome.rows == outcome.counted == 1 and outcome.rollouts == 1
    assert "- pairs by the warehouse's SQL count: 1 (rows: 1)" in (outcome.out / "README.md").read_text()


def test_an_export_leaves_a_warehouse_without_its_manifest_as_it_was(tmp_path, tokenizer):
    """A warehouse whose validation manifest was never written (as a writer leaves it) stays byte
    for byte as it was: the export opens it read-only and keeps the manifest in memory."""
    _chain_warehouse(tmp_path / "wh", tokenizer)
    assert not (tmp_path / "wh" / ".manifest").exists()
    digest = tree_digest(tmp_path / "wh")
    _export(tmp_path / "wh", tmp_path, form="preference")
    _export(tmp_path / "wh", tmp_path, name="sft")
    assert tree_digest(tmp_path / "wh") == digest


# ---------------------------------------------------------------------------------------------
# Outcome pairs and the provenance of rows


def _outcome_warehouse(root, tokenizer):
    """Two groups of four. it0-g1: s0 incorrect after an infrastructure fault, s1 correct, s2
    incorrect, s3 correct. it0-g2: t0 correct, t1 a failed generation, t2 and t3 incorrect.
    Every reward differs within a group."""
    def rollout(rollout_id, group, sample_index, reward, correct, n_failed=0, finish=FinishReason.ANSWER):
        return dataclasses.replace(make_rollout(rollout_id, reward=reward, n_failed=n_failed), group_id=f"it0-{group}",
                                   prompt_id=group.replace("g", "p"), sample_index=sample_index, correct=correct,
                                   finish_reason=finish)

    six, five = "What is 6 * 7?", "What is 5 * 8?"
    rollouts = [rollout("s0", "g1", 0, 0.0, False, n_failed=1), rollout("s1", "g1", 1, 1.0, True),
                rollout("s2", "g1", 2, 0.25, False), rollout("s3", "g1", 3, 0.75, True),
                rollout("t0", "g2", 0, 1.0, True), rollout("t1", "g2", 1, 0.0, False, finish=FinishReason.ERROR),
                rollout("t2", "g2", 2, 0.5, False), rollout("t3", "g2", 3, 0.125, False)]
    segments = [
        *_segments(tokenizer, "s0", six, [[("Compute.", "print(6 * 7)", INFRA, None),
                                           ("Compute.", "print(6 * 7)", OK, None)]], "41"),
        *_segments(tokenizer, "s1", six, [[("Compute.", "print(6 * 7)", OK, None)]], "42"),
        *_segments(tokenizer, "s2", six, [[("Guess.", "print(6 + 7)", OK, None)]], "13"),
        *_segments(tokenizer, "s3", six, [], "42"),
        *_segments(tokenizer, "t0", five, [[("Compute.", "print(5 * 8)", OK, None)]], "40"),
        *_segments(tokenizer, "t1", five, [], None),
        *_segments(tokenizer, "t2", five, [], "45"),
        *_segments(tokenizer, "t3", five, [], "35"),
    ]
    Warehouse(root).write_rollouts(0, rollouts, segments)


SUCCESS = {"role": "tool", "content": "Tool call success\nstdout: 42\n", "tool_calls": None}


def _answer(value: str) -> dict:
    return {"role": "assistant", "content": f"So \\boxed{{{value}}}.", "tool_calls": None}


@pytest.mark.parametrize("batch_rows", [256, 1, 3])
def test_outcome_pairs_join_the_ith_correct_and_incorrect_rollouts_of_one_group(tmp_path, tokenizer, batch_rows):
    """Per group, in sample order and leaving out what an infrastructure fault decided (s0's call,
    t1's generation): it0-g1 pairs s1 with s2 (s3 has no partner), it0-g2 t0 with t2. `chosen` is the
    correct rollout's conversation after the shared prompt, `rejected` the incorrect one's, and each
    reward is its own rollout's. However the rollouts are read in batches, a group is never split."""
    _outcome_warehouse(tmp_path / "wh", tokenizer)
    outcome, rows = _export(tmp_path / "wh", tmp_path, form="preference", pairs="outcome", batch_rows=batch_rows)
    assert outcome.rows == outcome.counted == 2
    first, second = rows
    assert {key: first[key] for key in ("pair", "rollout_id", "rejected_rollout_id", "group_id", "prompt_id",
                                        "reward", "rejected_reward", "view", "step", "depth", "error_type")} == {
        "pair": "outcome", "rollout_id": "s1", "rejected_rollout_id": "s2", "group_id": "it0-g1", "prompt_id": "p1",
        "reward": 1.0, "rejected_reward": 0.25, "view": "raw", "step": None, "depth": None, "error_type": None}
    assert first["prompt"] == [_user("What is 6 * 7?")]
    assert first["chosen"] == [_call("Compute.", "print(6 * 7)"), SUCCESS, _answer("42")]
    assert first["rejected"] == [_call("Guess.", "print(6 + 7)"), SUCCESS, _answer("13")]
    assert (second["rollout_id"], second["rejected_rollout_id"], second["reward"], second["rejected_reward"]) == (
        "t0", "t2", 1.0, 0.5)
    assert second["prompt"] == [_user("What is 5 * 8?")]
    assert second["chosen"] == [_call("Compute.", "print(5 * 8)"), SUCCESS, _answer("40")]
    assert second["rejected"] == [_answer("45")]


def test_sft_rows_carry_their_own_rollouts_provenance_in_shards_of_the_size_asked(tmp_path, tokenizer):
    """Each sft row's provenance is its rollout's, column for column (iteration and sample index
    not swapped); 8 rows in shards of 4 are two full shards and no empty third one. The failed
    generation t1 (a prompt the template closes without the assistant's opening) is not exact."""
    _outcome_warehouse(tmp_path / "wh", tokenizer)
    outcome, rows = _export(tmp_path / "wh", tmp_path, rows_per_shard=4)
    shards = sorted((outcome.out / "data").iterdir())
    assert [shard.name for shard in shards] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert [pq.read_metadata(shard).num_rows for shard in shards] == [4, 4] and outcome.shards == 2
    columns = ("iteration", "group_id", "prompt_id", "sample_index", "data_source", "reward", "correct",
               "finish_reason", "n_failed_calls", "view", "purify_config_id", "exact")
    assert {row["rollout_id"]: tuple(row[c] for c in columns) for row in rows} == {
        "s0": (0, "it0-g1", "p1", 0, "toy", 0.0, False, "answer", 1, "raw", None, True),
        "s1": (0, "it0-g1", "p1", 1, "toy", 1.0, True, "answer", 0, "raw", None, True),
        "s2": (0, "it0-g1", "p1", 2, "toy", 0.25, False, "answer", 0, "raw", None, True),
        "s3": (0, "it0-g1", "p1", 3, "toy", 0.75, True, "answer", 0, "raw", None, True),
        "t0": (0, "it0-g2", "p2", 0, "toy", 1.0, True, "answer", 0, "raw", None, True),
        "t1": (0, "it0-g2", "p2", 1, "toy", 0.0, False, "error", 0, "raw", None, False),
        "t2": (0, "it0-g2", "p2", 2, "toy", 0.5, False, "answer", 0, "raw", None, True),
        "t3": (0, "it0-g2", "p2", 3, "toy", 0.125, False, "answer", 0, "raw", None, True),
    }
    assert outcome.exact == 7
    s0 = next(row for row in rows if row["rollout_id"] == "s0")
    assert [m["role"] for m in s0["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
