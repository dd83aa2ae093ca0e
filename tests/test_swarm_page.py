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
            assert not browser.find_element(By.ID, "chain").is_displayed()  # no stages: no route part
            browser.get(server.url + "/swarm")  # no key: the page says how to open it
            wait.until(lambda b: "needs its API key" in b.find_element(By.ID, "problems").text)
        finally:
            browser.quit()


def test_the_swarm_page_of_a_stages_gateway_shows_its_stages_the_coverage_per_span_and_the_route():
    """A gateway (`serve --stages-swarm`) over stages 0-2 (twice) and 3-5 announced on a DHT: the
    page lists the three stages with the moeswarm version and uptime their records say and their
    round trips from the gateway, the one of each span in
    use marked, the coverage per span with 3-5 (one stage) the weakest, and the route in use; a
    stage of every layer announced later becomes the route in use on the page, live."""
    pytest.importorskip("hivemind")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from swarm_processes import announced, lines_until

    from moeswarm.discovery.announce import moeswarm_version
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop

    model = "models/pymoe/hf"  # 6 decoder layers
    meeting = SwarmDht.open([], host="127.0.0.1")
    peer = meeting.addresses()[0]
    stages = [spawn_stage(model, span, extra_args=["--announce-swarm", peer]) for span in ("0-2", "0-2", "3-5")]
    try:
        first, first2, second = (announced(lines_until(s, "announced on the swarm as ")) for s in stages)
        with ServeProcess(model, [], "--stages-swarm", peer, "--model-name", "tiny") as server:
            server.wait_ready()
            chain = httpx.get(server.url + "/v1/swarm").json()["chain"]
            used = chain["route"][0]["address"]
            assert used in (first, first2)
            assert chain["route"] == [{"layers": [0, 2], "address": used}, {"layers": [3, 5], "address": second}]
            assert chain["spans"] == [{"layers": [0, 2], "stages": 2, "weakest": False},
                                      {"layers": [3, 5], "stages": 1, "weakest": True}]
            assert [s["version"] for s in chain["stages"]] == [moeswarm_version()] * 3
            assert all(0 < s["uptime_s"] < 3600 for s in chain["stages"])
            browser = _browser()
            try:
                browser.get(server.url + "/swarm")
                wait = WebDriverWait(browser, 60)
                wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#stages tbody tr")) == 3)
                rows = {tuple(td.text for td in r.find_elements(By.TAG_NAME, "td")): r.get_attribute("class")
                        for r in browser.find_elements(By.CSS_SELECTOR, "#stages tbody tr")}
                by_address = {cells[0]: (cells, cls) for cells, cls in rows.items()}
                assert set(by_address) == {first, first2, second}
                for address, layers in ((first, "0-2"), (first2, "0-2"), (second, "3-5")):
                    cells, cls = by_address[address]
                    in_use = address in (used, second)
                    assert cells[1] == layers and cells[2] == moeswarm_version() and float(cells[4]) > 0, cells
                    assert cells[3].endswith(" s") or " min" in cells[3], cells  # uptime
                    assert (cells[5], cls) == (("in use", "in-route") if in_use else ("", ""))
                assert browser.find_element(By.ID, "route").text == \
                    f"layers 0-2 at {used}, layers 3-5 at {second}"
                assert float(browser.find_element(By.ID, "route-cost").text) >= 20.0  # 2 stages, 10 ms weight each
                spans = [([td.text for td in r.find_elements(By.TAG_NAME, "td")], r.get_attribute("class"))
                         for r in browser.find_elements(By.CSS_SELECTOR, "#spans tbody tr")]
                assert spans == [(["0-2", "2", ""], ""), (["3-5", "1", "weakest"], "weakest")]
                assert browser.find_element(By.ID, "chain").is_displayed()

                # a stage of every layer announced: the gateway's watch (every 10 s) moves to it, live
                stages.append(spawn_stage(model, "0-5", extra_args=["--announce-swarm", peer]))
                whole = announced(lines_until(stages[-1], "announced on the swarm as "))
                WebDriverWait(browser, 60).until(
                    lambda b: b.find_element(By.ID, "route").text == f"layers 0-5 at {whole}")
                assert browser.find_element(By.ID, "reroutes").text == "1"
                in_use = [r.find_elements(By.TAG_NAME, "td")[0].text
                          for r in browser.find_elements(By.CSS_SELECTOR, "#stages tbody tr.in-route")]
                assert in_use == [whole]
            finally:
                browser.quit()
    finally:
        stop(stages)
        meeting.close()
