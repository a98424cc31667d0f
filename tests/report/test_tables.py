"""The purify comparison table: counters per config, varying parameters only, token counts."""

from __future__ import annotations

from rich.console import Console

from cleaner.config import PurifyConfig
from cleaner.engine.purify.pipeline import PurifyResult, PurifyStats
from cleaner.records import PurifiedRow
from cleaner.report.tables import stats_frame, stats_table


def _row(config_id: str, loss_mask, old, behaviour) -> PurifiedRow:
    n = len(loss_mask)
    return PurifiedRow(config_id=config_id, iteration=0, rollout_id="r", group_id="g",
                       token_ids=tuple(range(n)), prompt_len=1, loss_mask=tuple(loss_mask),
                       behavior_logprobs=tuple(behaviour), old_logprobs=tuple(old), reward=1.0,
                       advantage=0.0, rolled_back=True, n_shallow=1, n_deep=0, n_unrecovered=0,
                       tokens_removed=3, scorer_version="t")


def _result(gamma: float) -> PurifyResult:
    config = PurifyConfig(gamma=gamma)
    rows = [
        # 3 trained tokens, one of them rewritten (|-1.0 - -0.5| > 1e-3); the masked one never counts
        _row(config.config_id, [0, 1, 1, 1], [0.0, -0.5, -1.0, -0.2], [-9.0, -0.5, -0.5, -0.2]),
        _row(config.config_id, [0, 1], [0.0, -0.3], [0.0, -0.3002]),  # within tolerance
    ]
    stats = PurifyStats(config_id=config.config_id, n_rollouts=2, n_rolled_back=2, n_shallow=1,
                        n_deep=int(gamma > 1), n_unrecovered=0, tokens_removed=6,
                        errors_by_type=(("NameError", 3), ("timeout", 1)))
    return PurifyResult(config, rows, stats)


def test_frame_counts_trained_and_rewritten_tokens():
    frame = stats_frame([_result(0.5)])
    assert frame.select("trained", "rewritten", "rolled", "removed").row(0) == (4, 1, 2, 6)


def test_table_shows_only_varying_parameters():
    results = [_result(0.5), _result(1.1)]
    console = Console(width=200, record=True)
    console.print(stats_table(results))
    text = console.export_text()
    assert "purify (2 rollouts, p 1, sim code, when always)" in text
    line = next(line for line in text.splitlines() if results[1].config.config_id[:8] in line)
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells == [results[1].config.config_id[:8], "1.1", "2", "1", "1", "0", "0", "6", "4", "1"]
    assert "failed calls in the input: NameError 3, timeout 1" in text
