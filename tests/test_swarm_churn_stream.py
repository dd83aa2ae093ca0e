"""A swarm of five joiners serving a stream through the official `openai` client, one killed mid-stream.

One `moeswarm invite`, five `moeswarm join INVITE` with memory for 13 of the bundled model's 32
experts each (every expert held about twice) and nothing else typed; `moeswarm serve --swarm
INVITE --check-local`; a streamed completion; after its first tokens a joiner is killed (SIGKILL:
no withdrawal). The stream goes on to its last token through the other holders (failover), every
step's logits torch.equal to the local eager model's (the server's check-local counters), and the
swarm's coverage comes back: every expert held by a live member, the dead one gone from the DHT.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai

from moeswarm.discovery.invite import parse_invite
from moeswarm.local.workers import stop
from moeswarm.slices.manifest import load_manifest
from moeswarm_bench.serve_process import ServeProcess
from swarm_processes import announced, bundled_copy, cli, join, lines_until, share_of, status

JOINERS = 5
EXPERTS_EACH = 13  # 5 x 13 = 65 slots for 32 experts
TOKENS = 48
SETTLE_S = 90.0


def test_five_joiners_serve_a_stream_through_a_kill_bit_identical(tmp_path):
    model = bundled_copy(tmp_path)
    inviter = cli("invite", "--model", str(model))
    joiners = []
    try:
        invite = inviter.stdout.readline().rstrip("\n")
        parse_invite(invite)
        manifest = load_manifest(Path(f"{model}.manifest.json"))
        chosen = []
        for number in range(JOINERS):  # each starts once the one before has chosen (its choice is on the DHT)
            joiner = join(invite, tmp_path / f"j{number}", EXPERTS_EACH, manifest, "--rebalance", "2",
                          "--announce-ttl", "6")
            joiners.append(joiner)
            chosen.append(lines_until(joiner, "share: experts "))
        addresses = [announced(lines_until(joiner, "announced on the swarm as ")) for joiner in joiners]
        assert set().union(*(share_of(lines) for lines in chosen)) == set(range(32))  # every expert, nothing typed

        with ServeProcess(model, [], "--swarm", invite, "--check-local", "--model-name", "pymoe") as server:
            server.wait_ready()
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
            stream = client.completions.create(model="pymoe", prompt="def main(", max_tokens=TOKENS, temperature=0,
                                               stream=True)
            pieces, finish, killed = [], None, None
            for chunk in stream:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                if killed is None and len(pieces) == 4:  # mid-stream: a member dies without a word
                    killed = addresses[1]
                    joiners[1].send_signal(signal.SIGKILL)
                    joiners[1].wait()
            assert killed is not None and finish == "length" and "".join(pieces)
            metrics = server.metrics()
            assert metrics["moeswarm_check_local_logits_total"] >= TOKENS
            assert metrics["moeswarm_check_local_mismatched_logits_total"] == 0

        deadline, view = time.monotonic() + SETTLE_S, None
        while time.monotonic() < deadline:  # its record lapses; every expert still has a live holder
            view = status(invite, tmp_path / "status")
            if killed not in [m["address"] for m in view["members"]] and all(r["fewest"] >= 1 for r in view["layers"]):
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"coverage not back {SETTLE_S:g} s after the kill: {view}")
        assert len(view["members"]) == JOINERS - 1
    finally:
        stop(joiners + [inviter])
