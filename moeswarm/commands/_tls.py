"""The `--swarm-key` flag, shared by the commands that listen or connect (moeswarm/transport/tls.py)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from moeswarm.transport.tls import client_context, server_context

ENV = "MOESWARM_SWARM_KEY"


def add_swarm_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm-key", default=os.environ.get(ENV), metavar="FILE",
                        help=f"swarm key or member file from `moeswarm keygen`: mutual TLS with the swarm's other "
                             f"members; FILE.revoked beside it lists revoked members, whose handshakes fail "
                             f"(default: ${ENV}; none: plain TCP)")


def client_tls(key_file: str | None):
    """The backbone's TLS context for `key_file`, or None for plain TCP."""
    if not key_file:
        return None
    return client_context(key_file)


def server_tls(key_file: str | None, host: str):
    """The worker's TLS context, or None; warns when plain TCP listens beyond loopback."""
    if key_file:
        return server_context(key_file)
    if not _loopback(host):
        print(f"moeswarm worker: warning: listening on {host} without --swarm-key: anyone who reaches this port can use "
              "its experts or pose as a backbone, and the hidden states cross the network in the clear "
              "(make a key with `moeswarm keygen -o swarm.key`)", file=sys.stderr, flush=True)
    return None


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
