"""`cleaner ui` without a browser: Starlette's TestClient against a hand-made warehouse.

The warehouse (tests/factories.py): iteration 0 holds r0 (reward 1) and r1 (reward 0),
each a NameError on `pirnt(1)` fixed by `print(1)` at step 0, then an answer; iteration 1 holds r2,
whose first call times out and is never retried (unrecovered), and r3, clean. r0 and r1 are
purified under a config at gamma 0.5 (a shallow merge, 5 tokens removed) and under a masked row
(the raw tokens, loss mask 0 on the failed attempt), as `--edit mask` stores them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from cleaner.cli import app as cli_app
from cleaner.engine.saar.premise import classify
from cleaner.engine.saar.walk import RAW, RenderSettings, render
from cleaner.records import PurifiedRow, PurifyConfigRow, Segment
from cleaner.report.inspection import load_inspection
from cleaner.ui.app import create_app
from cleaner.ui.rollout_view import StoredLogprobs, purified_pane
from cleaner.ui.server import UiConfig, UiError, check_host, is_loopback
from cleaner.warehouse import Warehouse, WarehouseError
from cleaner.warehouse.browse import Browser, RolloutFilter
from cleaner.warehouse.readonly import QueryBusy, QueryRefused, SqlLimits, check_select
from tests.factories import make_eval_run, make_rollout, make_segments

SHALLOW = PurifyConfigRow("cfg-shallow", 0.5, 1.0, "code", "always", json.dumps({"gamma": 0.5}))
MASKED = PurifyConfigRow("cfg-masked", 0.5, 1.0, "code", "always", json.dumps({"gamma": 0.5, "edit": "mask"}))


def stored_row(config: PurifyConfigRow, segments: list[Segment], advantage: float, view: RenderSettings,
               loss_mask: tuple[int, ...] | None = None) -> PurifiedRow:
    rendered = render(segments, view)
    mask = loss_mask or rendered.loss_mask
    old = tuple(-0.25 if m else 0.0 for m in mask)
    return PurifiedRow(config.config_id, segments[0].iteration, segments[0].rollout_id, "it0-p0",
                       rendered.token_ids, rendered.prompt_len, mask, rendered.behavior_logprobs, old, 1.0,
                       advantage, True, rendered.stats.n_shallow, rendered.stats.n_deep,
                       rendered.stats.n_unrecovered, rendered.stats.tokens_removed, "test")


def clean_segments(rollout_id: str, iteration: int) -> list[Segment]:
    """prompt, one successful call, the answer."""
    return [s if s.seq < 1 else dataclasses.replace(s, seq=s.seq - 2, attempt=0)
            for s in make_segments(rollout_id, iteration) if s.seq not in (1, 2)]


def build(root: Path) -> Warehouse:
    wh = Warehouse(root)
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    timeout = [dataclasses.replace(s, tool_status="timeout", error_type=None) if s.seq == 2 else s
               for s in make_segments("r2", iteration=1) if s.seq < 3]
    wh.write_rollouts(1, [make_rollout("r2", iteration=1, reward=0.0), make_rollout("r3", iteration=1, n_failed=0)],
                      timeout + clean_segments("r3", 1))
    view = RenderSettings(True, gamma=0.5)
    wh.write_purified(0, SHALLOW, [stored_row(SHALLOW, make_segments(r), a, view) for r, a in (("r0", 1.0), ("r1", -1.0))])
    raw_mask = render(make_segments("r0"), RAW).loss_mask  # a_0 (seq 1, tokens 3..5) and its error masked
    masked = tuple(0 if 3 <= i < 6 else m for i, m in enumerate(raw_mask))
    wh.write_purified(0, MASKED, [dataclasses.replace(stored_row(MASKED, make_segments("r0"), 1.0, RAW, masked),
                                                      rolled_back=True)])
    wh.write_eval_run(make_eval_run("e1", saar=True))
    return wh


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("ui") / "wh").root


@pytest.fixture(scope="module")
def client(warehouse) -> TestClient:
    return TestClient(create_app(Browser(Warehouse(warehouse, read_only=True))), base_url="http://127.0.0.1")


# ----------------------------------------------------------------------------------------------
# The list and its index


def listed_ids(html: str) -> list[str]:
    return re.findall(r'<td><a href="/rollouts/([^"]+)">', html)


def test_index_classes_are_the_premise_classes(warehouse):
    browser = Browser(Warehouse(warehouse, read_only=True))
    page = browser.list_rollouts(RolloutFilter())
    assert [(r.rollout_id, r.premise_class, r.error_types) for r in page.rows] == [
        ("r0", "recovered", ("NameError",)), ("r1", "recovered", ("NameError",)),
        ("r2", "unrecovered", ("timeout",)), ("r3", "clean", ())]
    for row in page.rows:
        assert row.premise_class == classify(browser.read_rollout(row.rollout_id)[1])


@pytest.mark.parametrize(("query", "expected"), [
    ("error_type=NameError", ["r0", "r1"]), ("error_type=timeout", ["r2"]), ("class=clean", ["r3"]),
    ("iteration=1", ["r2", "r3"]), ("reward_min=0.5", ["r0", "r3"]), ("reward_max=0", ["r1", "r2"]),
    ("class=recovered&reward_min=1", ["r0"]), ("group=it1-p0&iteration=1", ["r2", "r3"]), ("error_type=KeyError", []),
])
def test_filters_show_exactly_the_matching_rollouts(client, query, expected):
    response = client.get(f"/rollouts?{query}")
    assert response.status_code == 200
    assert listed_ids(response.text) == expected
    assert f'<p id="total">{len(expected)} rollout' in response.text


def test_pages_are_limit_offset_windows(warehouse):
    browser = Browser(Warehouse(warehouse, read_only=True))
    second = browser.list_rollouts(RolloutFilter(), offset=1, limit=2)
    assert [r.rollout_id for r in second.rows] == ["r1", "r2"] and second.total == 4


@pytest.mark.parametrize("query", ["iteration=x", "reward_min=high", "class=dirty", "offset=-x",
                                   "offset=99999999999999999999", f"offset={2**62 + 1}"])
def test_a_bad_filter_is_a_400_page(client, query):
    response = client.get(f"/rollouts?{query}")
    assert response.status_code == 400 and "Traceback" not in response.text
    assert 'id="error-message"' in response.text


def test_an_offset_past_the_last_rollout_is_an_empty_page(client):
    response = client.get(f"/rollouts?offset={2**62}")
    assert response.status_code == 200 and listed_ids(response.text) == []


# ----------------------------------------------------------------------------------------------
# One rollout


def pane_text(html: str, pane: str) -> str:
    """The pane's HTML, without the white space between tags."""
    start = html.index(f'<section id="{pane}"')
    return re.sub(r">\s+<", "><", html[start:html.index("</section>", start)])


def test_a_recovered_rollout_shows_the_failure_its_fix_and_the_purified_row(client):
    html = client.get("/rollouts/r0?config=cfg-shallow").text
    raw, purified = pane_text(html, "raw"), pane_text(html, "purified")
    assert 'class="seg tool failed removed" id="seg-2"' in raw and '<span class="error-type">NameError</span>' in raw
    assert '<a class="link fix" href="#seg-3">fixed by #3</a>' in raw  # the failed call -> its fix
    assert '<a class="link retry" href="#seg-2">' in raw  # the fix -> the failure it follows
    assert "tool2" in raw and "tool2" not in purified  # the error response is gone from the row
    # the shallow merge, its similarity (difflib of pirnt(1) / print(1)), and the stored row's numbers
    assert "<td>a1</td><td>shallow</td><td>0.875</td><td>off</td>" in purified
    assert 'id="advantage">+1.0000<' in html and 'id="trained-tokens">5</strong> of 10' in html
    assert '<strong class="badge recovered">#0 r=1</strong>' in html and 'href="/rollouts/r1"' in html


def test_a_masked_row_shows_its_untrained_assistant_tokens_apart(client):
    html = client.get("/rollouts/r0?config=cfg-masked").text
    purified = pane_text(html, "purified")
    assert '<span class="piece masked">' in purified and "masked assistant tokens <strong>3</strong>" in html
    assert "tool2" in purified  # the raw tokens, the error response included (not trained)
    assert 'id="trained-tokens">5</strong> of 15' in html


def test_the_is_gate_reads_old_logprobs_from_the_stored_row():
    segments = make_segments("r0")
    config = PurifyConfigRow("cfg-is", 0.5, 1.0, "code", "always",
                             json.dumps({"rollback_is_threshold": 0.01, "rollback_is_mode": "sum"}))
    row = stored_row(config, segments, 1.0, RenderSettings(True, gamma=0.5))
    # the shallow merge takes a_1's call tokens [1:3] (2 tokens): old -0.25 each, behaviour -0.5 each
    assert StoredLogprobs(row).logprob_sum(row.token_ids[:4], row.token_ids[4:6]) == -0.5
    pane = purified_pane(segments, row, config, None)
    (merge,) = pane.steps[1].merges
    assert pane.note is None and merge.log_is == pytest.approx(-0.5 - (-1.0)) and not merge.rejected


def test_a_row_that_is_no_re_rendering_is_shown_from_its_own_tokens_and_says_so():
    segments = make_segments("r0")
    row = dataclasses.replace(stored_row(SHALLOW, segments, 1.0, RenderSettings(True, gamma=0.5)),
                              token_ids=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    pane = purified_pane(segments, row, SHALLOW, lambda ids: "".join(chr(96 + i) for i in ids))
    assert "not a re-rendering" in pane.note
    # the shallow row's mask: prompt 0 0 0, merged turn 1 1 1, tool 0 0, answer 1 1; ids 1..10 -> a..j
    assert [(p.text, p.css) for p in pane.steps[0].pieces] == [("abc", "prompt"), ("def", "trained"), ("gh", "tool"),
                                                               ("ij", "trained")]
    foreign = dataclasses.replace(SHALLOW, params_json=json.dumps({"rollback_is_mode": "median"}))
    assert "cannot re-render" in purified_pane(segments, row, foreign, None).note


@pytest.mark.parametrize(("url", "says"), [
    ("/rollouts/nope", "no rollout &#39;nope&#39;"), ("/rollouts/r0?config=cfg-x", "no purified row under config"),
    ("/rollouts/r2?config=cfg-shallow", "no purified row"), ("/charts/nothing.svg", "no figure"), ("/nowhere", "Not Found"),
])
def test_unknown_rollouts_configs_and_pages_are_404_pages(client, url, says):
    response = client.get(url)
    assert response.status_code == 404 and says in response.text and "Traceback" not in response.text


def test_an_eval_rollout_is_shown_without_purified_rows(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    rollout = dataclasses.replace(make_rollout("e0"), collect_config_id="e1")
    wh.write_eval_batch("e1", [rollout], make_segments("e0"))
    wh.save_eval_config("e1", json.dumps({"model": None}))
    html = TestClient(create_app(Browser(Warehouse(wh.root, read_only=True))),
                      base_url="http://127.0.0.1").get("/rollouts/e0").text
    assert "A rollout of evaluation e1" in html and 'id="seg-2"' in html


# ----------------------------------------------------------------------------------------------
# Overview


def test_the_overview_draws_what_the_warehouse_allows_and_says_why_not(client):
    html = client.get("/").text
    assert "4 rollouts in 2 collected iteration(s)" in html and 'id="eval-runs"' in html
    assert "skipped: no `iterations` rows" in html  # no cleaner run: the run's curves are skipped
    for name in ("error_types", "eval"):
        assert f'src="/charts/{name}.svg"' in html
        svg = client.get(f"/charts/{name}.svg")
        assert svg.headers["content-type"] == "image/svg+xml" and b"<svg" in svg.content
    assert client.get("/charts/accuracy.svg").status_code == 404  # skipped for want of data
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html


# ----------------------------------------------------------------------------------------------
# SQL


def test_a_select_returns_its_rows_and_a_csv(client):
    query = "SELECT rollout_id, reward FROM rollouts WHERE iteration = 0 ORDER BY rollout_id"
    html = client.get("/sql", params={"q": query}).text
    assert '<p id="sql-count">2 rows' in html and "<td>r0</td><td>1.0</td>" in html
    csv = client.get("/sql.csv", params={"q": query})
    assert csv.text.splitlines() == ["rollout_id,reward", "r0,1.0", "r1,0.0"]
    assert "attachment" in csv.headers["content-disposition"]


@pytest.mark.parametrize(("query", "says"), [
    ("DROP VIEW rollouts", "a DROP statement"), ("COPY rollouts TO '/tmp/out.csv'", "a COPY statement"),
    ("ATTACH '/tmp/other.duckdb'", "an ATTACH statement"), ("INSTALL httpfs", "an INSTALL statement"),
    ("FORCE INSTALL httpfs", "an INSTALL statement"), ("LOAD httpfs", "a LOAD statement"),
    ("INSERT INTO t VALUES (1)", "an INSERT statement"), ("UPDATE t SET a = 1", "an UPDATE statement"),
    ("PRAGMA version", "a PRAGMA statement"),
    ("SET threads = 1", "a SET statement"), ("CREATE TABLE t AS SELECT 1", "a CREATE statement"),
    ("SELECT 1; DROP VIEW rollouts", "2 statements"), ("", None), ("SELEC 1", "does not parse"),
    ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
    ("SELECT * FROM glob('/etc/*')", "Permission Error"),
    ("SELECT nope FROM rollouts", "the query failed"),
    ("EXPLAIN ANALYZE COPY rollouts TO '/tmp/out.csv'", "an EXPLAIN statement"),  # it would run the COPY
    ("UPDATE EXTENSIONS", "a statement of a kind cleaner does not know"),
])
def test_anything_but_one_select_is_refused(client, query, says):
    response = client.get("/sql", params={"q": query})
    if says is None:  # an empty box is just the form
        assert response.status_code == 200 and "refused" not in response.text
        return
    assert response.status_code == 400 and says in response.text and 'id="sql-error"' in response.text
    assert client.get("/sql.csv", params={"q": query}).status_code == 400
    assert client.get("/sql", params={"q": "SELECT count(*) FROM rollouts"}).status_code == 200  # views intact


def test_a_csv_holds_nested_cells_as_json_text(client):
    query = "SELECT seq, token_ids, {'kind': kind, 'n': len(token_ids)} AS s FROM segments WHERE rollout_id = 'r0' AND seq < 2 ORDER BY seq"
    csv = client.get("/sql.csv", params={"q": query})
    assert csv.status_code == 200
    assert csv.text.splitlines() == ['seq,token_ids,s', '0,"[1, 2, 3]","{""kind"": ""prompt"", ""n"": 3}"',
                                     '1,"[4, 5, 6]","{""kind"": ""assistant"", ""n"": 3}"']


RUNAWAY = "SELECT count(*) FROM range(1000000000000) t(a) WHERE a % 7 = 3"  # hours on one thread


def test_a_runaway_query_holds_up_no_page_and_no_second_query_queues(warehouse):
    """The SQL box runs on a database of its own: while a query runs, every read of the pages
    answers at once, a second query is refused at once, and the runaway stops at its timeout."""
    # 10 s: the pages' first reads on a loaded machine must end well before the runaway is stopped
    browser = Browser(Warehouse(warehouse, read_only=True), SqlLimits(timeout_s=10))
    outcome: list[Exception] = []
    runaway = threading.Thread(target=lambda: outcome.append(_refused(browser.sql.run, RUNAWAY, 10)))
    started = time.monotonic()
    runaway.start()
    while not browser.sql.busy:
        assert time.monotonic() - started < 10, "the runaway query never started"
        time.sleep(0.01)
    before = time.monotonic()
    assert browser.list_rollouts(RolloutFilter()).total == 4
    assert load_inspection(browser, "r0").rollout.rollout_id == "r0"
    assert browser.facets().iterations == (0, 1)
    assert time.monotonic() - before < 5  # not held until the runaway's 10 s
    busy = _refused(browser.sql.run, "SELECT 1", 1)
    assert isinstance(busy, QueryBusy) and time.monotonic() - before < 5
    assert re.fullmatch(r"another query is running \(for \d+ s; it is stopped at 10 s\): one query runs at a "
                        r"time, run this one after it", str(busy))
    runaway.join(timeout=20)
    assert str(outcome[0]) == "the query ran past 10 s and was interrupted"
    assert 10 <= time.monotonic() - started < 25
    assert browser.sql.run("SELECT count(*) FROM rollouts", 1).rows == ((4,),)  # free again
    browser.close()


def _refused(run, query: str, max_rows: int) -> Exception | None:
    try:
        run(query, max_rows)
    except QueryRefused as refused:
        return refused
    return None


def test_the_sql_box_has_its_own_limits_and_reads_no_temporary_directory(warehouse, tmp_path, monkeypatch):
    """DuckDB lets a connection read its temporary directory whatever else it forbids; the box has
    none, and the pages' is a private one: neither it nor a `.tmp` where the ui started is readable."""
    monkeypatch.chdir(tmp_path)  # DuckDB's default temporary directory is ./.tmp
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "spill.csv").write_text("secret\n1\n")
    browser = Browser(Warehouse(warehouse, read_only=True), SqlLimits(memory_mb=100, threads=1))
    with browser.cursor() as pages:
        ((pages_temp, pages_memory),) = pages.execute(
            "SELECT current_setting('temp_directory'), current_setting('memory_limit')").fetchall()
    assert Path(pages_temp).is_dir() and not Path(pages_temp).is_relative_to(warehouse)
    assert pages_memory != "95.3 MiB"
    assert browser.sql.run("SELECT current_setting('temp_directory'), current_setting('memory_limit'), "
                           "current_setting('threads')", 1).rows == (("", "95.3 MiB", 1),)
    for path in (tmp_path / ".tmp" / "spill.csv", ".tmp/spill.csv", f"{pages_temp}/x.csv"):
        with pytest.raises(QueryRefused, match="Permission Error"):
            browser.sql.run(f"SELECT * FROM read_csv('{path}')", 1)
    with pytest.raises(QueryRefused, match="Permission Error"):
        browser.sql.run(f"SELECT * FROM glob('{pages_temp}/*')", 1)
    browser.close()
    assert not Path(pages_temp).exists()


def test_check_select_parses_with_duckdb():
    assert check_select("WITH a AS (SELECT 1) SELECT * FROM a") and check_select("FROM rollouts")
    with pytest.raises(QueryRefused, match="EXPORT"):
        check_select("EXPORT DATABASE '/tmp/x'")


# ----------------------------------------------------------------------------------------------
# Safety: the token, the host, nothing written


def test_a_token_is_required_on_every_request_and_a_query_token_sets_a_cookie(warehouse):
    client = TestClient(create_app(Browser(Warehouse(warehouse, read_only=True)), token="s3cret-token",
                                   loopback=False), base_url="http://192.0.2.1")
    assert client.get("/rollouts").status_code == 401
    assert client.get("/rollouts", params={"token": "wrong-token"}).status_code == 401
    assert client.get("/rollouts", headers={"X-Cleaner-Token": "s3cret-token"}).status_code == 200
    assert client.get("/static/style.css", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert client.get("/sql", params={"token": "s3cret-token"}).status_code == 200
    assert client.cookies.get("cleaner_ui_token") == "s3cret-token"
    assert client.get("/rollouts/r0").status_code == 200  # the cookie carries it now


def test_on_loopback_only_loopback_host_names_are_served(client):
    assert client.get("/", headers={"host": "attacker.example"}).status_code == 400


def test_a_non_loopback_host_needs_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    with pytest.raises(UiError, match="--host 0.0.0.0 is not a loopback address"):
        check_host(UiConfig(Path("wh"), host="0.0.0.0"))
    check_host(UiConfig(Path("wh"), host="0.0.0.0", token="long-enough"))


def test_cli_refuses_a_non_loopback_host_without_a_token_in_one_line(warehouse):
    result = CliRunner().invoke(cli_app, ["ui", "-w", str(warehouse), "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("error: --host 0.0.0.0 is not a loopback")


def test_cli_names_a_missing_warehouse_in_one_line(tmp_path):
    result = CliRunner().invoke(cli_app, ["ui", "-w", str(tmp_path / "none"), "--port", "0"])
    assert result.exit_code == 1 and result.output.startswith("error: ") and result.output.count("\n") == 1


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root: content digest, or 'dir'."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def test_a_session_of_requests_leaves_the_warehouse_byte_identical(tmp_path):
    root = build(tmp_path / "wh").root
    shutil.rmtree(root / ".manifest")  # the build's own reads pinned its parts; a writing reader would pin anew
    before = tree(root)
    client = TestClient(create_app(Browser(Warehouse(root, read_only=True))), base_url="http://127.0.0.1")
    for url in ("/", "/charts/error_types.svg", "/rollouts?error_type=NameError", "/rollouts/r0",
                "/rollouts/r0?config=cfg-masked", "/sql?q=SELECT+count(*)+FROM+segments",
                "/sql?q=COPY+rollouts+TO+'out.csv'", "/rollouts/nope"):
        client.get(url)
    assert client.post("/refresh", headers={"referer": "/rollouts"}, follow_redirects=False).status_code == 303
    assert tree(root) == before and not (root / ".manifest").exists()


def test_a_read_only_warehouse_refuses_writes(warehouse):
    with pytest.raises(WarehouseError, match="read-only"):
        Warehouse(warehouse, read_only=True).write_iteration(None)
    with pytest.raises(WarehouseError, match="read-only"):
        Warehouse(warehouse, read_only=True).save_config("x", "{}")


def test_without_the_ui_extra_the_cli_prints_the_install_hint(warehouse, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    result = CliRunner().invoke(cli_app, ["ui", "-w", str(warehouse)])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "pip install 'cleaner[ui]'" in result.output and "uvicorn" in result.output


def test_the_cli_flags_default_to_the_config():
    from cleaner.cli.read import ui

    defaults = {name: p.default for name, p in inspect.signature(ui).parameters.items()}
    assert (defaults["host"], defaults["port"], defaults["token"]) == (UiConfig.host, UiConfig.port, UiConfig.token)
