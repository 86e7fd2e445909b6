"""The report page in a real browser: Debian's chromium, headless, driven by selenium
through Debian's chromedriver, against a real ``embgeom serve`` (embedded Redis and
worker) that ingested 100 BBC paragraphs with MiniLM.

The page must render with no console error, every figure ``<img>`` must load
(``naturalWidth > 0``), and every number on the page (each ``data-value``) must equal the
JSON endpoints' value exactly (``.../layers`` for the per-layer table and ``as_of``,
``.../layers/{l}/isotropy`` for the isotropy table, ``.../similarity`` for the CKA section of
this ``cross_layer`` collection). A full-page screenshot is kept under
the test's tmp folder; with ``EMBGEOM_UPDATE_DOCS=1`` it is also copied to
``docs/report.png`` (the README's), which a plain test run never touches.

``make setup`` installs chromium and chromium-driver (apt) when missing. Without them the
test fails, saying so: a browser test must not pass by being skipped. Set
``EMBGEOM_ALLOW_NO_BROWSER=1`` to skip it instead on a machine that cannot have them.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import httpx
import pytest

from embgeom import figures
from embgeom.corpora import bbc_texts
from embgeom.testing.serve import REPO
from tests.conftest import wait_for_jobs

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = REPO / "docs" / "report.png"  # written only with EMBGEOM_UPDATE_DOCS=1
UPDATE_DOCS = os.environ.get("EMBGEOM_UPDATE_DOCS") == "1"
ALLOW_NO_BROWSER = os.environ.get("EMBGEOM_ALLOW_NO_BROWSER") == "1"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1280,1000")
TEXTS = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 160][:100]


def _missing() -> list[str]:
    """What this test needs and this machine lacks."""
    missing = [f"{path} (apt-get install {package})"
               for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver"))
               if not path.exists()]
    try:
        import selenium.webdriver  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    return missing


@pytest.fixture(autouse=True)
def _needs_browser():
    """Fails (before any service starts) when the browser is missing; skips instead only
    with EMBGEOM_ALLOW_NO_BROWSER=1."""
    missing = _missing()
    if missing:
        message = ("the report page's browser test needs " + ", ".join(missing)
                   + "; `make setup` installs them (set EMBGEOM_ALLOW_NO_BROWSER=1 to skip instead)")
        if ALLOW_NO_BROWSER:
            pytest.skip(message)
        pytest.fail(message, pytrace=False)


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")),
                              options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


def exact(text: str, value) -> bool:
    """A data-value (Python's repr of the number, or "" for none) against a JSON value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return text == ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return text != "" and float(text) == value and (not isinstance(value, int) or text == str(value))


def test_report_page_renders_in_chromium_and_its_numbers_equal_the_json(embedded_service, browser, tmp_path):
    url, _ = embedded_service
    base = f"{url}/v1/collections/browser/models/minilm"
    with httpx.Client(base_url=url, timeout=120) as client:
        # cross_layer: the page has its CKA section (heatmap and matrix), and its links answer
        assert client.put("/v1/collections/browser", json={"cross_layer": True}).status_code == 201
        r = client.post("/v1/jobs", json={"collection": "browser", "model": "minilm", "texts": TEXTS})
        assert r.status_code == 202, r.text
        (status,) = wait_for_jobs(client, [r.json()["job_id"]], timeout=300)
        assert status["status"] == "done", status
        layers = client.get(f"{base}/layers").json()
        isotropy = {row["layer"]: client.get(f"{base}/layers/{row['layer']}/isotropy").json()
                    for row in layers["layers"]}
        similarity = client.get(f"{base}/similarity").json()
        head = client.get(f"{base}/report")
        assert head.status_code == 200, head.text
        shown = int(head.headers["x-embgeom-layer"])
        assert client.get(f"{base}/layers").json()["as_of"] == layers["as_of"]  # nothing changed since

    browser.get(f"{base}/report")
    assert browser.title == "embgeom report: browser / minilm"

    # No console errors (a failed load, a CSP violation, a script error).
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe

    # Every figure is there and decoded.
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('img[data-figure]')).map(i => "
        "[i.dataset.figure, i.complete, i.naturalWidth, i.naturalHeight]);")
    # The CKA heatmap first, in its section; then the other figures in their order.
    assert [name for name, *_ in images] == ["cka"] + [n for n in figures.FIGURES if n != "cka"]
    for name, complete, width, height in images:
        w, h = figures.SIZES[name]
        assert complete and (width, height) == (round(w * figures.DPI), round(h * figures.DPI)), name

    # Every number on the page, against the JSON.
    values = browser.execute_script("""
        return Array.from(document.querySelectorAll('[data-value]')).map(e => {
            const row = e.closest('tr'), table = e.closest('table'), field = e.closest('[data-field]');
            return {value: e.dataset.value, column: e.dataset.column || null,
                    layer: row ? row.dataset.layer : null, table: table ? table.id : null,
                    field: field ? field.dataset.field : null};
        });""")
    columns = {"types": "num_types"}
    by_layer = {str(row["layer"]): row for row in layers["layers"]}
    checked = {"layer-table": 0, "isotropy-table": 0, "cka-table": 0, "header": 0}
    cka = {(str(i), str(j)): v for i, row in zip(similarity["layers"], similarity["matrix"])
           for j, v in zip(similarity["layers"], row)}
    for v in values:
        if v["table"] == "layer-table":
            want = by_layer[v["layer"]][columns.get(v["column"], v["column"])]
        elif v["table"] == "isotropy-table":
            want = isotropy[int(v["layer"])][v["column"]]
        elif v["table"] == "cka-table":
            want = int(v["layer"]) if v["column"] == "layer" else cka[(v["layer"], v["column"])]
        elif v["field"] == "cka_n":
            want = similarity["n"]
        elif v["field"] == "as_of":
            continue  # below
        elif v["field"] == "layer of the per-layer figures":
            want = shown
        else:
            pytest.fail(f"a number the test does not know: {v}")
        assert exact(v["value"], want), (v, want)
        checked[v["table"] or "header"] += 1
    num_layers = len(layers["layers"])
    assert checked["layer-table"] == num_layers * 14
    assert checked["isotropy-table"] == num_layers * 7
    assert checked["cka-table"] == num_layers * (num_layers + 1)
    assert checked["header"] == 2  # the layer shown and the CKA section's n
    version, updated_at = (v["value"] for v in values if v["field"] == "as_of")
    assert exact(version, layers["as_of"]["version"]) and exact(updated_at, layers["as_of"]["updated_at"])

    # The table of contents: one entry per section or figure, each leading somewhere.
    toc = browser.execute_script(
        "return Array.from(document.querySelectorAll('nav a')).map(a => "
        "[a.textContent, !!document.getElementById(a.getAttribute('href').slice(1))]);")
    labels = [label for label, _ in toc]
    # per-layer, isotropy and CKA sections, and the figures but cka (in the CKA section)
    assert len(labels) == len(set(labels)) == 3 + len(figures.FIGURES) - 1, labels
    assert all(found for _, found in toc), toc

    # The links to the JSON endpoints answer.
    hrefs = browser.execute_script(
        "return Array.from(document.querySelectorAll('#links-section ~ ul a')).map(a => a.href);")
    assert any(h.endswith(f"/models/minilm/layers?min_count=1") for h in hrefs), hrefs
    with httpx.Client(timeout=120) as client:
        for href in hrefs:
            assert client.get(href).status_code == 200, href

    # A full-page screenshot.
    height = browser.execute_script("return document.documentElement.scrollHeight;")
    browser.set_window_size(1280, min(int(height) + 40, 16000))
    kept = tmp_path / "report.png"
    assert browser.save_screenshot(str(kept))
    assert kept.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    if UPDATE_DOCS:
        SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(kept, SCREENSHOT)
