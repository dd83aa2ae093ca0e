#!/usr/bin/env python
"""Put the HF checkpoint's chat template into GGUF files (`tokenizer.chat_template`), so that
`moeswarm serve --model FILE.gguf` has a chat template with no --chat-template.

Each file is copied by gguf-py's own `gguf_new_metadata` (every key and every tensor's bytes as
they are, the template added or replaced), then checked: the same keys but the template, and
every tensor's type, shape and bytes equal; only then does the copy replace the file.

    python scripts/gguf_chat_template.py            # models/pymoe/gguf/*.gguf from models/pymoe/hf
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

import gguf
import numpy
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = gguf.Keys.Tokenizer.CHAT_TEMPLATE


def with_template(path: pathlib.Path, template: str) -> None:
    reader = gguf.GGUFReader(path, "r")
    copy = path.with_suffix(".tmp")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(copy, arch=bytes(arch.parts[arch.data[0]]).decode(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {KEY: MetadataDetails(gguf.GGUFValueType.STRING, template)}, [])
    written = gguf.GGUFReader(copy, "r")
    assert bytes(written.fields[KEY].parts[-1]).decode() == template
    assert set(written.fields) - {KEY} == set(reader.fields) - {KEY}
    assert len(written.tensors) == len(reader.tensors)
    for old, new in zip(reader.tensors, written.tensors):
        assert (old.name, old.tensor_type, list(old.shape)) == (new.name, new.tensor_type, list(new.shape))
        assert numpy.array_equal(numpy.asarray(old.data).view(numpy.uint8), numpy.asarray(new.data).view(numpy.uint8))
    del reader, written
    copy.replace(path)
    print(f"{path}: tokenizer.chat_template set ({len(template)} characters), tensors unchanged")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=str(ROOT / "models/pymoe/hf"), help="the checkpoint whose tokenizer_config.json has it")
    ap.add_argument("files", nargs="*", help="GGUF files (default: models/pymoe/gguf/*.gguf)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    template = json.loads((pathlib.Path(args.hf) / "tokenizer_config.json").read_text()).get("chat_template")
    if not template:
        sys.exit(f"{args.hf}/tokenizer_config.json has no chat_template")
    for name in args.files or sorted(str(p) for p in (ROOT / "models/pymoe/gguf").glob("*.gguf")):
        with_template(pathlib.Path(name), template)


if __name__ == "__main__":
    main()
