"""`cleaner ui` under strain (cleaner/ui/app.py, warehouse/browse.py, warehouse/readonly.py): the
SQL box's page is bounded in rows and characters, a snapshot whose parts a compaction removed or
whose warehouse moved says so in one line, every response carries the security headers, and a
cross-site POST is refused.

The warehouse: iteration 0 holds r0 and r1 (a failed call and its fix each) in two parts, so a
compaction has something to merge; iteration 1 holds r2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

import cleaner.ui.app as ui_app
from cleaner.ui.app import PAGE_POLICY, SVG_POLICY, create_app
from cleaner.warehouse import Warehouse
from cleaner.warehouse.browse import Browser
from cleaner.warehouse.compact import compact
from tests.factories import make_rollout, make_segments

BASE = "http://127.0.0.1"


def build(root: Path) -> Path:
    warehouse = Warehouse(root)
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    warehouse.write_rollouts(0, [make_rollout("r1", reward=0.0)], make_segments("r1"))
    warehouse.write_rollouts(1, [make_rollout("r2", iteration=1)], make_segments("r2", iteration=1))
    return root


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    root = build(tmp_path_factory.mktemp("ui") / "wh")
    return TestClient(create_app(Browser(Warehouse(root, read_only=True))), base_url=BASE)


def _client(root: Path, **kwargs) -> TestClient:
    return TestClient(create_app(Browser(Warehouse(root, read_only=True)), **kwargs), base_url=BASE,
                      raise_server_exceptions=False)


# ----------------------------------------------------------------------------------------------
# The SQL box's page is bounded


def test_a_huge_cell_is_cut_in_duckdb_and_the_page_says_so(client):
    """A 300 MB string (the kind of query that once made a 1 GB page) renders as its first
    characters; the page stays small."""
    response = client.get("/sql", params={"q": "SELECT repeat('x', 300000000) AS big, 7 AS n"})
    assert response.status_code == 200 and len(response.content) < 100_000
    cells = re.findall(r"<td>([^<]*)</td>", response.text)
    assert cells == ["x" * ui_app.SQL_CELL_CHARS + " …", "7"]


def test_rows_past_the_cap_are_cut_and_the_page_says_so(client):
    html = client.get("/sql", params={"q": "SELECT range AS i FROM range(5000)"}).text
    assert len(re.findall(r"<tr><td>", html)) == ui_app.SQL_MAX_ROWS
    assert "1000 rows (cut: the first 1,000 rows; the CSV holds up to 1,000,000 rows" in html


def test_characters_past_the_cap_are_cut_and_the_page_says_so(client):
    """3,000 characters a row: 666 rows fit in 2,000,000 characters, below the row cap."""
    query = "SELECT repeat('x', 1500) AS a, repeat('y', 1500) AS b FROM range(1500)"
    response = client.get("/sql", params={"q": query})
    assert len(re.findall(r"<tr><td>", response.text)) == 2_000_000 // 3000 == 666
    assert "(cut: the first 666 rows: the next would pass 2,000,000 characters" in response.text
    assert len(response.content) < 2_100_000


def test_the_csv_is_cut_at_its_character_cap_and_says_so_in_a_header(client, monkeypatch):
    monkeypatch.setattr(ui_app, "CSV_MAX_CHARS", 10_000)
    response = client.get("/sql.csv", params={"q": "SELECT repeat('y', 1000) AS line FROM range(100)"})
    assert response.status_code == 200 and response.text.splitlines()[1:] == ["y" * 1000] * 10
    assert response.headers["x-cleaner-cut"] == "the first 10 rows: the next would pass 10,000 characters"
    whole = client.get("/sql.csv", params={"q": "SELECT 1 AS one"})
    assert "x-cleaner-cut" not in whole.headers


# ----------------------------------------------------------------------------------------------
# A snapshot older than its warehouse


def test_after_a_compaction_pages_say_to_refresh_and_a_refresh_reads_it_again(tmp_path):
    root = build(tmp_path / "wh")
    client = _client(root)
    assert client.get("/rollouts").status_code == 200  # the index is in memory
    merged = compact(root, None, None, 128 * 2**20)
    assert merged.merges  # iteration 0's two parts are one now
    for url in ("/rollouts/r0", "/"):
        response = client.get(url)
        message = re.search(r'<p id="error-message" class="error">([^<]*)</p>', response.text).group(1)
        assert response.status_code == 409, response.text
        assert "the warehouse changed since the browser&#39;s snapshot" in message and "refresh" in message
        assert "a bug" not in response.text and "IOException" not in response.text
    box = client.get("/sql", params={"q": "SELECT count(*) FROM segments"})
    assert box.status_code == 400 and "refresh and run it again" in box.text
    assert client.post("/refresh", data={"next": "/rollouts/r0"}, follow_redirects=False).status_code == 303
    assert client.get("/rollouts/r0").status_code == 200 and client.get("/").status_code == 200
    assert "<td>6</td>" in client.get("/sql", params={"q": "SELECT count(*) FROM segments WHERE iteration = 0 "
                                                           "AND rollout_id = 'r0'"}).text


def test_a_moved_warehouse_is_said_in_one_line_and_a_refresh_is_no_500(tmp_path):
    root = build(tmp_path / "wh")
    client = _client(root)
    root.rename(tmp_path / "elsewhere")
    page = client.get("/rollouts/r0")
    assert page.status_code == 410 and f"{root}: the warehouse is gone (moved or deleted)" in page.text
    refreshed = client.post("/refresh", follow_redirects=False)
    assert refreshed.status_code == 410 and "the pages read the previous snapshot" in refreshed.text
    assert "a bug" not in page.text + refreshed.text
    assert client.get("/rollouts").status_code == 200  # the old snapshot's index still answers


# ----------------------------------------------------------------------------------------------
# Headers and the Origin check


EXPECTED = {"x-frame-options": "DENY", "referrer-policy": "no-referrer", "x-content-type-options": "nosniff"}


def _secured(response, policy: str = PAGE_POLICY) -> bool:
    return (response.headers.get("content-security-policy") == policy
            and all(response.headers.get(name) == value for name, value in EXPECTED.items()))


def test_every_response_carries_the_security_headers(tmp_path, monkeypatch):
    root = build(tmp_path / "wh")
    client = _client(root)
    for url, status in (("/", 200), ("/rollouts", 200), ("/rollouts/r0", 200), ("/sql?q=SELECT+1", 200),
                        ("/sql?q=DROP+VIEW+rollouts", 400), ("/sql.csv?q=SELECT+1", 200), ("/static/style.css", 200),
                        ("/rollouts/nope", 404), ("/rollouts?offset=x", 400)):
        response = client.get(url)
        assert response.status_code == status and _secured(response), (url, response.headers)
    assert "default-src 'none'" in PAGE_POLICY and "script" not in PAGE_POLICY
    chart = next(name for name in re.findall(r'src="/charts/([^"]+)\.svg"', client.get("/").text))
    assert _secured(client.get(f"/charts/{chart}.svg"), SVG_POLICY)
    assert _secured(client.post("/refresh", follow_redirects=False))
    assert _secured(client.get("/", headers={"host": "evil.example"}))  # the host check's 400
    guarded = _client(root, token="sesame-123")
    assert guarded.get("/").status_code == 401 and _secured(guarded.get("/"))
    monkeypatch.setattr(ui_app, "raw_segments", lambda *_: 1 / 0)  # a bug: the 500 page
    broken = client.get("/rollouts/r0")
    assert broken.status_code == 500 and _secured(broken)


@pytest.mark.parametrize(("headers", "status"), [
    ({"origin": "http://evil.example"}, 403),
    ({"origin": "null"}, 403),  # a sandboxed frame, a file:// page
    ({"origin": "http://127.0.0.1:9999"}, 403),  # another port is another origin
    ({"sec-fetch-site": "cross-site"}, 403),
    ({"sec-fetch-site": "same-site"}, 403),  # a sibling subdomain is another origin too
    ({"origin": BASE, "sec-fetch-site": "same-origin"}, 303),
    ({"origin": BASE}, 303),
    ({"sec-fetch-site": "none"}, 303),  # typed by the user
    ({}, 303),  # curl
])
def test_a_cross_site_post_is_refused_and_refreshes_nothing(client, headers, status):
    browser = client.app.state.ui.browser
    before = browser.sql
    response = client.post("/refresh", headers=headers, follow_redirects=False)
    assert response.status_code == status and _secured(response)
    assert (browser.sql is before) == (status == 403)


@pytest.mark.parametrize(("back", "location"), [
    ("/rollouts?iteration=1&offset=0", "/rollouts?iteration=1&offset=0"),
    ("//evil.example/x", "/"), ("/\\evil.example", "/"), ("http://evil.example/", "/"), ("", "/"),
])
def test_a_refresh_returns_to_its_page_and_never_to_another_site(client, back, location):
    response = client.post("/refresh", data={"next": back}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == location


def test_the_refresh_form_names_the_page_it_is_on(client):
    html = client.get("/rollouts", params={"iteration": "1"}).text
    assert '<input type="hidden" name="next" value="/rollouts?iteration=1">' in html
