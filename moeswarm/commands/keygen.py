"""`moeswarm keygen`: make a swarm key (give the same file to every worker and backbone of a swarm)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", required=True, help="file to write (it must not exist; written readable by you only)")


def run(args: argparse.Namespace) -> int:
    from moeswarm.transport.tls import write_swarm_key

    path = write_swarm_key(args.out)
    print(f"wrote swarm key {path}: pass --swarm-key {path} (or MOESWARM_SWARM_KEY={path}) to every worker, "
          "generate and serve of this swarm, and keep it secret")
    return 0
