"""The dashboard in a real browser: Debian's headless Chromium, driven through chromedriver, during a run."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from moeswarm.sources.source import open_source
from moeswarm_bench.serve_process import ServeProcess

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="Debian's chromium and chromium-driver are not installed (the README's test command installs them)")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1100,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def test_dashboard_shows_workers_and_expert_heat_while_a_generation_runs(qwen2_moe, qwen2_workers, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    workers = qwen2_workers  # conftest's: experts 0-3 and 4-7
    with ServeProcess(qwen2_moe, workers, "--model-name", "tiny", "--api-key", "k") as server:
        server.wait_ready()
        body = {"model": "tiny", "prompt": "abcabc", "max_tokens": 120, "temperature": 0, "stream": True}
        generating = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120,
                                                                headers={"Authorization": "Bearer k"}))
        generating.start()
        browser = _browser()
        try:
            browser.get(server.url + "/?key=k")
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#workers tbody tr")) == 2)
            wait.until(lambda b: b.find_element(By.ID, "generated").text not in ("-", "0"))
            rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")]
            for address, experts in zip(workers, ("0-3", "4-7")):
                assert any(address in row and experts in row and "up" in row for row in rows)
            cells = open_source(qwen2_moe).config.num_hidden_layers * 8  # every layer is MoE, 8 experts each
            heat = _cells(browser, "#heat td")  # [(title, background colour)]
            assert len(heat) == cells
            assert any("layer 0 expert" in title and not title.endswith(" 0 routed tokens") for title, _ in heat)
            coverage = _cells(browser, "#coverage td")
            assert [title.rsplit(": ", 1)[1] for title, _ in coverage] == ["1 holder(s)"] * cells
            for grid in ("heat", "coverage"):  # an expert-number axis over each grid, and a legend beside it
                assert [text for text, _ in _cells(browser, f"#{grid} thead th", "textContent")] == \
                    ["expert"] + [str(e) for e in range(8)]
            assert "none (uncovered)" in browser.find_element(By.ID, "coverage-legend").text
            assert "busiest" in browser.find_element(By.ID, "heat-legend").text
            colours = {colour for _, colour in coverage} | {colour for _, colour in heat}
            assert not any(colour.startswith(("rgb(198, 40, 40", "rgba(198, 40, 40")) for colour in colours)  # red: uncovered only
            # the last minutes as time series: a line once two samples are in
            wait.until(lambda b: " L" in (b.find_element(By.CSS_SELECTOR, "#tps-series path").get_attribute("d") or ""))
            assert browser.find_element(By.ID, "tps-range").text.startswith("now ")
            for chart, legend in (("tps", "tokens generated per second"), ("batch", "sequences stepped together"),
                                  ("rtt", "median round trip")):  # a scale, a time axis and a legend on each
                texts = [t for t, _ in _cells(browser, f"#{chart}-series text", "textContent")]
                assert texts[3:] == ["-5 min", "-4 min", "-3 min", "-2 min", "-1 min", "now"]
                assert float(texts[0]) == 0 and float(texts[2]) == 2 * float(texts[1]) > 0
                assert legend in browser.find_element(By.CSS_SELECTOR, f"#{chart}-series + .legend").text
            top = float(_cells(browser, "#tps-series text", "textContent")[2][0])
            most = float(browser.find_element(By.ID, "tps-range").text.rsplit("max ", 1)[1])
            assert 0 < most <= top < 10 * most  # the scale's top: a round number at or above the largest value
            line = browser.find_element(By.CSS_SELECTOR, "#tps-series path").get_attribute("d")
            assert line.rsplit(" L", 1)[-1].split()[0] == "292.0"  # the last sample at "now", the axis' right end
            time.sleep(0.5)
            # MOESWARM_DASHBOARD_SCREENSHOT=docs/dashboard.png refreshes the picture docs/dashboard.md shows
            assert browser.save_screenshot(os.environ.get("MOESWARM_DASHBOARD_SCREENSHOT", str(tmp_path / "dashboard.png")))
            browser.set_window_size(390, 844)  # a phone: the page itself never scrolls sideways
            time.sleep(0.5)
            assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
            assert browser.save_screenshot(str(tmp_path / "dashboard-phone.png"))
            browser.get(server.url + "/")  # no key: the page says how to give it
            wait.until(lambda b: "?key=YOUR_API_KEY" in b.find_element(By.ID, "problems").text)
        finally:
            browser.quit()
            generating.join(timeout=120)
        unauthorized = httpx.get(server.url + "/v1/dashboard")
        assert unauthorized.status_code == 401


def _cells(browser, selector: str, text: str = "title") -> list[tuple[str, str]]:
    """(text or title, computed background colour) of every element `selector` finds, read in one
    script: the page replaces its grids on every refresh, so element handles kept across reads go stale."""
    return [tuple(cell) for cell in browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".map(c => [c[arguments[1]].trim(), getComputedStyle(c).backgroundColor])", selector, text)]
