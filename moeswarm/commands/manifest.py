"""`moeswarm manifest`: the sha256 of every piece of a GGUF model, for workers that fetch a slice of it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeswarm.commands._setup import add_quiet, quiet_progress
from moeswarm.errors import MoeSwarmError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="GGUF model file (or slice file) that seeders will serve")
    parser.add_argument("-o", "--out", required=True, help="manifest to write (MODEL.manifest.json)")
    parser.add_argument("--chunk-mb", type=float, default=4.0,
                        help="most bytes one hashed piece holds, in MiB (at most 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    out = Path(args.out)
    if not out.parent.is_dir() or out.is_dir():
        raise MoeSwarmError(f"cannot write {out}: give -o a file name in an existing directory")
    from moeswarm.slices.manifest import build_manifest, write_manifest

    manifest = build_manifest(args.model, int(args.chunk_mb * (1 << 20)))
    digest = write_manifest(manifest, out)
    report = {"out": str(out), "sha256": digest, "fingerprint": manifest["fingerprint"],
              "file_size": manifest["file_size"], "tensors": len(manifest["tensors"])}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {out}: {report['tensors']} tensors of {manifest['file']} ({report['file_size'] / 1e6:.1f} MB), "
              f"model {report['fingerprint']}; manifest sha256 {digest} (publish it: fetchers pin it with "
              f"--manifest-sha256)")
    return 0
