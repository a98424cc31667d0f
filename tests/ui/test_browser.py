"""`cleaner ui` in a real headless Chromium (Debian's chromium and chromium-driver, through selenium),
against the CLI serving the `small_run` warehouse (two iterations of `cleaner run` of the tiny
policy, iteration 1 purified under three configs). Run with `make test-ui`, which installs them.

Few tests, small pages: Chromium on two shared cores is slow. The rollout page's screenshot goes to
$CLEANER_UI_SCREENSHOTS (docs/figures for the README) or the test's temporary directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

from cleaner.warehouse import Warehouse
from tests.helpers import cli

pytestmark = pytest.mark.ui

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# a closed network stalls Chromium's background services; none of them is needed here
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
                    "apt-get install -y chromium chromium-driver, or `make test-ui`")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: `make test-ui` installs it")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    browser.set_page_load_timeout(120)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def served(small_run):
    """`cleaner ui` serving the run's warehouse on a free port; yields its base URL."""
    process = subprocess.Popen(cli("ui", "-w", str(small_run / "warehouse"), "--port", "0"), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120):
        process.kill()
        pytest.fail(f"cleaner ui did not start: {process.stderr.read() if process.poll() is not None else ''}")
    (url,) = re.findall(r"read-only at (http://\S+)/", lines[0])
    yield url
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def connection(small_run):
    return Warehouse(small_run / "warehouse", read_only=True).connect()


def wait_for_page(driver, predicate) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.readyState") == "complete"
                                    and predicate(d))


# ----------------------------------------------------------------------------------------------


def test_the_overview_renders_its_charts(driver, served):
    driver.get(served + "/")
    images = driver.find_elements("css selector", ".chart img")
    names = [image.get_attribute("src").rsplit("/", 1)[1] for image in images]
    assert names == ["accuracy.svg", "failures.svg", "merges.svg", "premise.svg", "train.svg", "error_types.svg",
                     "ablation-iteration-1.svg"]
    wait_for_page(driver, lambda d: all(d.execute_script("return arguments[0].complete", i) for i in images))
    for image in images:  # each SVG decoded, at the report's 16:9 (960 x 540 px are 691.2 x 388.8 pt)
        width, height = driver.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", image)
        assert width > 900 and abs(width / height - 16 / 9) < 0.01, image.get_attribute("src")


def test_filtering_by_error_type_shows_exactly_the_matching_rollouts(driver, served, connection):
    from selenium.webdriver.support.ui import Select

    error, count = connection.sql(
        "SELECT coalesce(error_type, tool_status) AS e, count(DISTINCT rollout_id) AS n FROM failures "
        "GROUP BY e ORDER BY n DESC, e LIMIT 1").fetchall()[0]
    expected = sorted(row[0] for row in connection.execute(
        "SELECT DISTINCT rollout_id FROM failures WHERE coalesce(error_type, tool_status) = ?", [error]).fetchall())
    assert 0 < count == len(expected) < 50  # one page: the whole answer is on it
    driver.get(served + "/rollouts")
    assert driver.find_element("id", "total").text.startswith("32 rollouts")
    Select(driver.find_element("id", "filter-error_type")).select_by_value(error)
    driver.find_element("id", "apply").click()
    wait_for_page(driver, lambda d: "error_type=" in d.current_url)
    assert driver.find_element("id", "total").text.startswith(f"{count} rollout")
    shown = [a.text for a in driver.find_elements("css selector", "#rollouts tbody tr td:first-child a")]
    assert sorted(shown) == expected


def test_a_recovered_rollout_shows_the_failure_its_fix_and_the_purified_row(driver, served, connection, tmp_path):
    failed_tool, failed_call, fix_call, fix_tool, error, rollout_id = connection.sql("""
        SELECT f.seq, a.seq, fa.seq, ft.seq, f.error_type, f.rollout_id
        FROM segments f
        JOIN segments a ON a.rollout_id = f.rollout_id AND a.kind = 'assistant' AND a.step = f.step AND a.attempt = f.attempt
        JOIN segments fa ON fa.rollout_id = f.rollout_id AND fa.kind = 'assistant' AND fa.step = f.step AND fa.attempt = f.attempt + 1
        JOIN segments ft ON ft.rollout_id = f.rollout_id AND ft.kind = 'tool' AND ft.step = f.step AND ft.attempt = f.attempt + 1
        WHERE f.kind = 'tool' AND f.tool_status = 'error' AND ft.tool_status = 'ok' AND f.iteration = 1
        ORDER BY f.rollout_id, f.seq LIMIT 1""").fetchall()[0]
    driver.get(f"{served}/rollouts/{rollout_id}")
    raw = driver.find_element("id", "raw")
    failed = raw.find_element("id", f"seg-{failed_tool}")
    assert "failed" in failed.get_attribute("class") and error in failed.text
    assert "<tool_call>" in raw.find_element("id", f"seg-{failed_call}").text  # the failed call itself
    fix_link = failed.find_element("css selector", "a.fix")
    assert fix_link.get_attribute("href").endswith(f"#seg-{fix_call}")
    retry = raw.find_element("id", f"seg-{fix_call}").find_element("css selector", "a.retry")
    assert retry.get_attribute("href").endswith(f"#seg-{failed_tool}")
    purified = driver.find_element("id", "purified").text
    fix_response = raw.find_element("id", f"seg-{fix_tool}").find_element("tag name", "pre").text
    failed_response = failed.find_element("tag name", "pre").text
    assert fix_response in purified and failed_response not in purified  # decoded the same way
    assert re.search(r"a1 (shallow|deep) \d\.\d{3}", purified)  # the merge and its similarity
    screenshots = Path(os.environ.get("CLEANER_UI_SCREENSHOTS") or tmp_path)
    screenshots.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(screenshots / "ui-rollout.png"))


def test_the_sql_box_returns_rows_and_refuses_writes(driver, served, connection):
    ((expected,),) = connection.sql("SELECT count(*) FROM rollouts WHERE correct").fetchall()

    def run(query: str) -> None:
        driver.get(served + "/sql")
        box = driver.find_element("id", "query")
        box.clear()
        box.send_keys(query)
        driver.find_element("id", "run").click()
        wait_for_page(driver, lambda d: "q=" in d.current_url)

    run("SELECT count(*) AS n FROM rollouts WHERE correct")
    assert [c.text for c in driver.find_elements("css selector", "#sql-result td")] == [str(expected)]
    for query, refusal in (("DROP VIEW rollouts", "a DROP"), ("COPY rollouts TO 'out.csv'", "a COPY"),
                           ("ATTACH 'other.duckdb'", "an ATTACH")):
        run(query)
        assert f"{refusal} statement" in driver.find_element("id", "sql-error").text
        assert not driver.find_elements("id", "sql-result")
