"""`moeswarm fetch-slice`: fetch some experts' bytes from a seeder into a slice file (slices/fetch.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeswarm.commands._setup import add_quiet, quiet_progress
from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.commands._types import expert_list, layer_range, seconds
from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("peer", help="the seeder, HOST:PORT (`moeswarm seed`)")
    parser.add_argument("--manifest", required=True,
                        help="the model owner's manifest (`moeswarm manifest`): what every fetched byte is checked against")
    parser.add_argument("--manifest-sha256", default=None, metavar="HEX",
                        help="the manifest's sha256 as its owner published it: refuse any other manifest")
    parser.add_argument("--experts", required=True, type=expert_list, help="experts to fetch, e.g. 0-31 or 0-3,9")
    parser.add_argument("--layers", type=layer_range("layers"), default=None, help="inclusive MoE layer range A-B (default: all)")
    parser.add_argument("--with-backbone", action="store_true", help="also fetch every non-expert tensor")
    parser.add_argument("-o", "--out", required=True, help="slice file to write (PART.gguf)")
    parser.add_argument("--retries", type=int, default=3, help="reconnections after a broken connection")
    parser.add_argument("--timeout", type=seconds, default=30.0,
                        help="seconds to connect, and for each piece beyond its length at 64 KiB/s: a seeder slower "
                             "than that is left and retried (default 30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_swarm_key(parser)
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    out = Path(args.out)
    if not out.parent.is_dir() or out.is_dir():
        raise MoeSwarmError(f"cannot write {out}: give -o a file name in an existing directory")
    if args.retries < 0:
        raise MoeSwarmError(f"--retries must be 0 or more, got {args.retries}")
    from moeswarm.slices.fetch import fetch_slice
    from moeswarm.slices.manifest import load_manifest

    manifest = load_manifest(args.manifest, args.manifest_sha256)
    report = fetch_slice(args.peer, manifest, args.experts, out, args.layers, args.with_backbone,
                         client_tls(args.swarm_key), args.retries, args.timeout)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {report['out']}: experts {format_ids(report['experts'])} of MoE layers {format_ids(report['layers'])}, "
              f"model {report['fingerprint']}; fetched {report['fetched_bytes'] / 1e6:.1f} MB in {report['fetch_s']:.2f} s "
              f"({report['mb_per_s']} MB/s), {report['resumed_bytes'] / 1e6:.1f} MB resumed, "
              f"{report['pieces']} pieces checked against the manifest")
    return 0
