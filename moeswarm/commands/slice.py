"""`moeswarm slice`: cut a standalone GGUF slice file holding some experts of a GGUF model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeswarm.commands._setup import add_quiet, quiet_progress
from moeswarm.commands._types import expert_list, layer_range
from moeswarm.errors import ModelError, MoeSwarmError
from moeswarm.ids import format_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="GGUF model file (or a slice file holding the requested experts)")
    parser.add_argument("--experts", required=True, type=expert_list, help="experts to keep, ids and inclusive ranges, e.g. 0-31 or 0-3,9")
    parser.add_argument("--layers", type=layer_range("layers"), default=None, help="inclusive MoE layer range A-B (default: all)")
    parser.add_argument("--with-backbone", action="store_true",
                        help="also copy every non-expert tensor, so the file can run a backbone too")
    parser.add_argument("-o", "--out", required=True, help="slice file to write (PART.gguf)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from moeswarm.sources.source import is_gguf_path
    from moeswarm.gguf.gguf_slice import write_slice

    quiet_progress(args)
    if not is_gguf_path(args.model):
        raise ModelError(f"{args.model}: slice takes a .gguf model file")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise MoeSwarmError(f"cannot write {out}: there is no directory {out.parent} (create it, or choose another -o)")
    if out.is_dir():
        raise MoeSwarmError(f"cannot write {out}: it is a directory (give -o a file name, e.g. {out / 'part.gguf'})")
    report = write_slice(args.model, args.out, args.experts, args.layers, args.with_backbone)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {report['out']}: experts {format_ids(report['experts'])} of MoE layers "
              f"{format_ids(report['layers'])} ({report['expert_tensors']} expert tensors"
              f"{', ' + str(report['backbone_tensors']) + ' backbone tensors' if args.with_backbone else ''}, "
              f"{report['bytes'] / 1e6:.1f} MB), model {report['fingerprint']}")
    return 0
