"""The wire as C sees it (moeswarm/wire/frames.h) against wire/frames.py, and the load-time check
that refuses a C library whose structs or constants differ from Python's mirrors (moeswarm/native.py)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from moeswarm import native
from moeswarm.errors import MoeSwarmError
from moeswarm.wire import frames
from moeswarm.wire.codecs import INTEGER_CODECS, get_codec

HEADER = Path(frames.__file__).with_name("frames.h")


def _defines() -> dict[str, str]:
    return dict(re.findall(r"^#define (MSW_\w+) (.+?)(?:\s*/\*.*)?$", HEADER.read_text(), re.MULTILINE))


def test_the_c_header_states_what_frames_py_packs():
    defines = _defines()
    for name, value in frames.c_constants().items():
        assert eval(defines[name], {}) == value, name  # plain integer expressions only
    assert defines["MSW_MAGIC"] == '"' + frames.MAGIC.decode() + '"'
    for codec in INTEGER_CODECS:  # the expert ids' byte widths as DISPATCH carries them
        assert int(defines[f"MSW_ID_BYTES_{codec.upper()}"]) == get_codec(codec).nbytes((1,)), codec
    # a header packed by Python has its fields where the C header says
    packed = frames.HEADER.pack(frames.MAGIC, frames.VERSION, 2, 0, 0x0102030405060708, 77, 99)
    assert packed[frames.c_constants()["MSW_AT_OPCODE"]] == 2
    at = frames.c_constants()["MSW_AT_REQUEST_ID"]
    assert int.from_bytes(packed[at : at + 8], "little") == 0x0102030405060708


def test_every_frame_speaking_c_file_includes_the_one_header():
    root = Path(frames.__file__).parents[1]
    speakers = [path for path in root.rglob("*.c") if re.search(r"\bMSW_|MSWM|frame", path.read_text())]
    assert speakers
    for path in speakers:
        text = path.read_text()
        assert '#include "frames.h"' in text or '#include "native.h"' in text, path.name
        assert '"MSWM"' not in text, f"{path.name} restates the magic"


@pytest.mark.parametrize("module, library, function", [("moeswarm.weights.qkernels", "_qkernels", "qk_layout"),
                                                       ("moeswarm.transport.token_call", "_token_call", "tc_layout")])
def test_the_built_libraries_report_what_python_mirrors(module, library, function):
    import importlib

    lib = importlib.import_module(module)._library()
    if lib is None:
        pytest.skip(f"moeswarm/{library} is not built here")
    report = native.reported(lib, function)
    assert {key: report[key] for key in frames.c_constants()} == frames.c_constants()


def test_a_library_that_disagrees_is_refused_naming_the_field():
    from moeswarm.weights import qkernels

    lib = qkernels._library()
    if lib is None:
        pytest.skip("moeswarm/_qkernels is not built here")
    report = native.reported(lib, "qk_layout")
    mirrors = {"QkLane": qkernels.ExpressLane, "QkHoldLane": qkernels.HoldLane, "QkHoldOut": qkernels.HoldOut}
    native.check_layout("_qkernels", report, mirrors, frames.c_constants())  # as built: accepted

    first, second = qkernels.HoldOut._fields_[0], qkernels.HoldOut._fields_[1]
    swapped = type("HoldOut", (ctypes.Structure,), {"_fields_": [second, first, *qkernels.HoldOut._fields_[2:]]})
    with pytest.raises(MoeSwarmError, match=rf"refusing moeswarm/_qkernels: QkHoldOut\.{first[0]} is \d+ in C and \d+ in Python"):
        native.check_layout("_qkernels", report, mirrors | {"QkHoldOut": swapped}, frames.c_constants())
    with pytest.raises(MoeSwarmError, match="MSW_VERSION is 2 in C and 3 in Python"):
        native.check_layout("_qkernels", report, mirrors, frames.c_constants() | {"MSW_VERSION": 3})
