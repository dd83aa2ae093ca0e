"""A running `moeswarm serve --swarm INVITE` follows the swarm live (issue 59, item 5): a member that joins
after the server started shows in GET /v1/swarm, the first member leaves, and the late joiner alone
answers the next request, every step checked bit for bit against the local eager run (--check-local)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from moeswarm.discovery.invite import parse_invite
from moeswarm.slices.manifest import load_manifest
from moeswarm.local.workers import stop
from moeswarm_bench.serve_process import ServeProcess
from swarm_processes import announced, bundled_copy, cli, join, lines_until

ALL = 32  # the bundled model's experts: each member holds every one
FOLLOW_S = 60.0


def _members(server: ServeProcess) -> list[str]:
    return [m["address"] for m in httpx.get(server.url + "/v1/swarm", timeout=10).json()["members"]]


def _complete(server: ServeProcess) -> None:
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "pymoe", "prompt": "def main(", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0


def _until(server: ServeProcess, condition, what: str) -> None:
    """Requests until `condition()` holds: joins and leaves seen apply from the next layer call on."""
    deadline = time.monotonic() + FOLLOW_S
    while time.monotonic() < deadline:
        _complete(server)
        if condition():
            return
        time.sleep(0.5)
    pytest.fail(f"{what} within {FOLLOW_S:g} s")


def _what_members_say(server: ServeProcess, address: str) -> None:
    """What the member's record says of it, in GET /v1/swarm and on the /swarm page (headless
    Chromium, where installed): its path, moeswarm version, uptime and tokens/s measured at start."""
    from moeswarm.discovery.announce import moeswarm_version

    member = httpx.get(server.url + "/v1/swarm", timeout=10).json()["members"][0]
    assert (member["address"], member["path"], member["version"]) == (address, "direct", moeswarm_version())
    assert member["uptime_s"] > 0 and member["tokens_per_s"] > 0  # its load comes with its first refresh
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from test_swarm_page import _browser

    browser = _browser()
    try:
        browser.get(server.url + "/swarm")
        cells = WebDriverWait(browser, 60).until(lambda b: [td.text for td in b.find_elements(
            By.CSS_SELECTOR, "#members tbody tr td")] or None)
        assert cells[0] == address and cells[1] == "direct" and cells[7] == moeswarm_version(), cells
        assert cells[8].endswith(" s") or " min" in cells[8], cells  # uptime
        assert float(cells[9]) > 0, cells  # tokens/s measured at start
    finally:
        browser.quit()


def test_a_running_serve_picks_up_a_late_joiner_and_drops_a_leaver_bit_identical(tmp_path):
    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model))
    processes = [inviter]
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        parse_invite(invite)
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        first = join(invite, tmp_path / "a", ALL, manifest, "--rebalance", "0")
        processes.append(first)
        first_address = announced(lines_until(first, "announced on the swarm as "))
        with ServeProcess(model, [], "--swarm", invite, "--check-local", "--model-name", "pymoe") as server:
            server.wait_ready()
            assert _members(server) == [first_address]
            _what_members_say(server, first_address)
            late = join(invite, tmp_path / "b", ALL, manifest, "--rebalance", "0")
            processes.append(late)
            late_address = announced(lines_until(late, "announced on the swarm as "))
            _until(server, lambda: late_address in _members(server), "the late joiner not among the serve's members")
            first.terminate()  # a clean exit: its record is withdrawn
            first.wait(timeout=30)
            _until(server, lambda: _members(server) == [late_address],
                   "the member that left still among the serve's members")
            _complete(server)  # the late joiner alone answers
            metrics = server.metrics()
            assert metrics["moeswarm_check_local_logits_total"] > 0
            assert metrics["moeswarm_check_local_mismatched_logits_total"] == 0
    finally:
        stop(processes)
