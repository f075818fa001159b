"""report.html in a real headless Chromium: loads offline, no console error, every plot drawn.

Chromium comes from the system packages (`apt-get install chromium`; `make test` tries that) and
is driven through the DevTools protocol by playwright, pointed at that executable so no browser
is downloaded. Every request the page makes other than its own file is aborted and counted, so
a page that needs the network fails here. Screenshots are kept under tests/artifacts/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.sg_opt.test_report import invoke

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    found = next((shutil.which(name) for name in CANDIDATES if shutil.which(name)), None)
    return found or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.fixture(scope="module")
def browser():
    executable = chromium()
    if executable is None:
        pytest.skip("no Chromium found (apt-get install chromium): the HTML report is not checked in a browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


PLOTS_JS = """() => [...document.querySelectorAll('svg[data-plot]')].map(svg => {
    const box = svg.getBoundingClientRect();
    const drawn = [...svg.querySelectorAll('path, use')].filter(el => {
        const b = el.getBBox(); return b.width > 0 || b.height > 0; }).length;
    return {name: svg.dataset.plot, width: box.width, height: box.height, drawn: drawn};
})"""


def open_page(browser, html: Path, shot: str) -> tuple[list[dict], list[str]]:
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
               else (problems.append(f"network request: {route.request.url}"), route.abort()))
    page.goto(html.resolve().as_uri(), wait_until="load")
    plots = page.evaluate(PLOTS_JS)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
    print(f"screenshot: {ARTIFACTS / shot}")
    page.close()
    return plots, problems


def assert_drawn(plots: list[dict], expected: list[str]) -> None:
    assert [p["name"] for p in plots] == expected
    for p in plots:
        assert p["width"] > 100 and p["height"] > 50, p
        assert p["drawn"] >= 5, p  # axes, ticks, bars/lines, glyphs: a plot with data draws many


def test_run_report_in_chromium(browser, rich_run):
    plots, problems = open_page(browser, rich_run / "report.html", "report.png")
    assert problems == []
    assert_drawn(plots, ["step-times", "best-so-far", "phases", "roofline", "spend"])


def test_cpu_run_report_in_chromium_says_why_there_is_no_roofline(browser, agent_run):
    plots, problems = open_page(browser, agent_run / "report.html", "report-cpu.png")
    assert problems == []
    assert_drawn(plots, ["step-times", "best-so-far", "phases"])


def test_comparison_report_in_chromium(browser, agent_run, rich_run, tmp_path):
    out = tmp_path / "cmp"
    assert invoke("report", str(agent_run), str(rich_run), "--out", str(out)).exit_code == 0
    plots, problems = open_page(browser, out / "report.html", "comparison.png")
    assert problems == []
    assert_drawn(plots, ["step-times", "best-so-far", "spend"])
