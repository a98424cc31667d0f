"""`cleaner show`'s views (cleaner/report/show.py): purified text, drop marks, loading, tokenizer fallback.

Token ids are character codes (decode = chr), so the decoded purified text can be checked by hand.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from rich.console import Console

from cleaner.engine.model.chat import format_call
from cleaner.engine.saar.walk import RenderSettings, explain, render
from cleaner.records import PurifiedRow, PurifyConfigRow, Segment, SegmentKind, ToolStatus
from cleaner.report.inspection import ConfigOutcome, Decoder, load_decoder, load_inspection
from cleaner.report.show import purified_texts, raw_panel, show_rollout
from cleaner.report.tables import visible
from cleaner.warehouse import Warehouse
from tests.factories import make_rollout, make_segments

# ----------------------------------------------------------------------------------------------
# Builders


def decode(token_ids) -> str:
    return "".join(chr(i) for i in token_ids)


def segment(seq, kind, step, attempt, text, code=None, reasoning="", status=None) -> Segment:
    ids = tuple(ord(c) for c in text)
    return Segment("r", 0, seq, kind, step, attempt, ids,
                   tuple(-0.1 for _ in ids) if kind == SegmentKind.ASSISTANT else None, text,
                   call_start=len(reasoning) if code is not None and kind == SegmentKind.ASSISTANT else None,
                   tool_code=code, tool_status=status)


def call_turn(seq, attempt, reasoning, code) -> Segment:
    return segment(seq, SegmentKind.ASSISTANT, 0, attempt, reasoning + format_call(code), code, reasoning)


def chain() -> list[Segment]:
    """Q, a failed call, its fix (ratio 0.875: shallow at 0.5, deep at 0.9), the answer."""
    return [
        segment(0, SegmentKind.PROMPT, None, None, "Q?"),
        call_turn(1, 0, "Think. ", "pirnt(1)"),
        segment(2, SegmentKind.TOOL, 0, 0, "<E>", status=ToolStatus.ERROR),
        call_turn(3, 1, "Fix. ", "print(1)"),
        segment(4, SegmentKind.TOOL, 0, 1, "<1>", status=ToolStatus.OK),
        segment(5, SegmentKind.ASSISTANT, 1, 0, "42"),
    ]


SHALLOW_VIEW, DEEP_VIEW = RenderSettings(True, gamma=0.5, similarity_on="code"), RenderSettings(True, gamma=0.9, similarity_on="code")


def plain(renderable) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(renderable)
    return console.export_text()


# ----------------------------------------------------------------------------------------------
# Purified text and drop marks


@pytest.mark.parametrize("view", [SHALLOW_VIEW, DEEP_VIEW])
def test_purified_text_is_the_decoded_rendering(view):
    segments = chain()
    texts = purified_texts(segments, explain(segments, view, decode), decode)
    assert "".join(t.text for t in texts) == decode(render(segments, view, decode).token_ids)
    assert [t.step.outcome if t.step else None for t in texts] == [None, view is SHALLOW_VIEW and "shallow" or "deep", "clean"]


def test_purified_text_without_tokenizer_cuts_segment_text_at_the_call():
    segments = chain()
    texts = purified_texts(segments, explain(segments, SHALLOW_VIEW), None)
    assert [t.text for t in texts] == ["Q?", "Think. " + format_call("print(1)") + "<1>", "42"]


def test_text_cut_falls_back_to_a_token_range_when_the_call_marker_is_missing():
    segments = [dataclasses.replace(s, text=f"text{s.seq}") for s in chain()]
    texts = purified_texts(segments, explain(segments, SHALLOW_VIEW), None)
    assert texts[1].text == "<tokens 0:7 of #1><tokens 5:" + str(len(segments[3].token_ids)) + " of #3>text4"


def test_raw_view_strikes_what_the_purified_rendering_drops():
    segments = chain()
    out = plain(raw_panel(None, segments, steps=explain(segments, SHALLOW_VIEW)))
    lines = [line for line in out.splitlines() if "#" in line and "tok)" in line]
    assert "partly removed (keeps tokens 0:7)" in lines[1]
    assert lines[2].rstrip(" ─╮").endswith("removed") and "error" in lines[2]
    assert "partly removed (keeps tokens 5:" in lines[3]
    assert not any("removed" in line for line in (lines[0], lines[4], lines[5]))
    assert "Think. [-<tool_call>" in out and "[-Fix. -]" in out
    deep = plain(raw_panel(None, segments, steps=explain(segments, DEEP_VIEW)))
    assert "[-" not in deep and deep.count(" removed ") == 2  # a_0 and its error, whole


def test_without_steps_nothing_is_marked():
    assert "removed" not in plain(raw_panel(None, chain()))


# ----------------------------------------------------------------------------------------------
# Loading from a warehouse, the tokenizer and its fallback


def small_warehouse(tmp_path) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    return wh


def purified_row(config_id: str, rollout_id: str, advantage: float) -> PurifiedRow:
    return PurifiedRow(config_id, 0, rollout_id, "it0-p0", (1, 2, 3), 1, (0, 1, 1), (0.0, -0.5, -0.5),
                       (0.0, -0.4, -0.4), 1.0, advantage, True, 1, 0, 0, 5, "test")


def test_load_inspection_reads_rollout_segments_configs_and_model(tmp_path):
    wh = small_warehouse(tmp_path)
    config = PurifyConfigRow("cfg-a", 0.5, 1.0, "code", "always", "{}")
    wh.write_purified(0, config, [purified_row("cfg-a", "r0", 0.7071), purified_row("cfg-a", "r1", -0.7071)])
    wh.save_config("collect-iteration=0", json.dumps({"model": "some/model", "gamma": 0.5}))
    inspection = load_inspection(wh, "r0")
    assert inspection.rollout.rollout_id == "r0" and inspection.iteration == 0
    assert [s.seq for s in inspection.segments] == [0, 1, 2, 3, 4, 5]
    assert inspection.configs == (ConfigOutcome("cfg-a", 0.5, 1.0, "code", "always", True, 1, 0, 0, 5,
                                                1.0, pytest.approx(0.7071), edit="replace"),)
    assert inspection.model == "some/model"
    assert load_inspection(wh, "nope") is None


def test_negative_samples_are_counted_under_their_config_not_listed_as_configs(tmp_path):
    wh = small_warehouse(tmp_path)
    config = PurifyConfigRow("cfg-n", 0.5, 1.0, "code", "always", "{}")
    negatives = [dataclasses.replace(purified_row("cfg-n", "r0", 0.0), negative_seq=seq) for seq in (1, 3)]
    wh.write_purified(0, config, [purified_row("cfg-n", "r0", 0.7071), *negatives, purified_row("cfg-n", "r1", -0.7071)])
    (outcome,) = load_inspection(wh, "r0").configs
    assert (outcome.config_id, outcome.advantage, outcome.n_negatives) == ("cfg-n", pytest.approx(0.7071), 2)
    table = plain(show_rollout(load_inspection(wh, "r0"), SHALLOW_VIEW, Decoder(None, "")))
    assert table.count("cfg-n") == 1 and "negative_samples" in table  # one row for the config, its negatives a column
    (other,) = load_inspection(wh, "r1").configs
    assert other.n_negatives == 0


def test_no_collect_config_means_no_model(tmp_path):
    inspection = load_inspection(small_warehouse(tmp_path), "r1")
    assert (inspection.model, inspection.configs) == (None, ())
    decoder = load_decoder(inspection.model)
    assert decoder.decode is None and "no collect config" in decoder.note


def test_unloadable_tokenizer_falls_back_and_says_why(tmp_path):
    decoder = load_decoder(str(tmp_path / "missing-model"))
    assert decoder.decode is None
    assert "could not be loaded" in decoder.note and "missing-model" in decoder.note


def test_tokenizer_of_the_collecting_policy_decodes(tmp_path):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(ord("a") + i): i for i in range(26)}  # id i <-> letter i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path / "policy")
    decoder = load_decoder(str(tmp_path / "policy"))
    assert decoder.decode is not None and "tokenizer of" in decoder.note
    segments = make_segments("r0")  # prompt 1 2 3, a_0 4 5 6 (call at 1), t_0 7 8, a_1 4 5 9, t_1 7 10, 11 12
    texts = purified_texts(segments, explain(segments, SHALLOW_VIEW), decoder.decode)
    assert [t.text for t in texts] == ["bcd", "efjhk", "lm"]  # a_0's reasoning "e" + a_1's call "fj"


def test_show_rollout_puts_raw_purified_and_configs_in_order(tmp_path):
    inspection = load_inspection(small_warehouse(tmp_path), "r0")
    out = plain(show_rollout(inspection, SHALLOW_VIEW, Decoder(None, "fallback note")))
    assert out.index("#5") < out.index("purified view (gamma 0.5") < out.index("no purified rows")
    assert "fallback note" in out and "tokens removed 5 · shallow 1 · deep 0 · unrecovered 0" in out
    raw_only = plain(show_rollout(inspection, SHALLOW_VIEW, Decoder(None, ""), "raw"))
    assert "purified view" not in raw_only and "removed" not in raw_only
    with pytest.raises(ValueError, match="view must be one of"):
        show_rollout(inspection, SHALLOW_VIEW, Decoder(None, ""), "sideways")


def test_visible_escapes_every_control_character_but_newline_and_tab():
    assert visible("a\x1b[31mb\tc\nd\re\x00\x7f\x9b\u00a0é") == "a\\x1b[31mb\tc\nd\\re\\x00\\x7f\\x9b\u00a0é"
