"""The `/swarm` page of `moeswarm serve` in a real browser (Debian's headless Chromium): members and
the coverage per MoE layer, the least-held experts and the weakest layers marked, refreshed live."""

from __future__ import annotations

import shutil

import httpx
import pytest

from moeswarm.sources.source import open_source
from moeswarm.local.workers import local_workers
from moeswarm_bench.serve_process import ServeProcess

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="Debian's chromium and chromium-driver are not installed")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def test_the_swarm_page_shows_members_and_marks_the_least_held_experts(qwen2_moe):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    layers = open_source(qwen2_moe).config.num_hidden_layers
    with local_workers(qwen2_moe, [list(range(8)), list(range(4))]) as workers, \
            ServeProcess(qwen2_moe, workers, "--model-name", "tiny", "--api-key", "k") as server:
        server.wait_ready()
        assert httpx.get(server.url + "/v1/swarm").status_code == 401  # the data needs the key; the page does not
        data = httpx.get(server.url + "/v1/swarm", headers={"Authorization": "Bearer k"}).json()
        assert [(r["fewest"], r["weakest"], r["weakest_layer"]) for r in data["layers"]] == [(1, [4, 5, 6, 7], True)] * layers
        browser = _browser()
        try:
            browser.get(server.url + "/swarm?key=k")
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#layers tbody tr")) == layers)
            members = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#members tbody tr")]
            assert len(members) == 2
            assert any(workers[0] in row and "0-7" in row and "up" in row for row in members)
            assert any(workers[1] in row and "0-3" in row for row in members)
            rows = browser.find_elements(By.CSS_SELECTOR, "#layers tbody tr")
            assert all("4-7" in r.text and "weakest" in r.text and r.get_attribute("class") == "weakest" for r in rows)
            assert browser.find_element(By.ID, "model").text == "tiny"
            browser.get(server.url + "/swarm")  # no key: the page says how to open it
            wait.until(lambda b: "needs its API key" in b.find_element(By.ID, "problems").text)
        finally:
            browser.quit()
