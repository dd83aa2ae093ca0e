"""The C side of the wire cannot drift: wire/frames.h's #defines equal wire/frames.py's values, every
frame-speaking C file includes the header, and a library whose reported layout disagrees with its
ctypes mirrors is refused at load."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from moeswarm import native
from moeswarm.errors import MoeSwarmError
from moeswarm.transport import token_call
from moeswarm.kernels import qk_mirrors, qkernels
from moeswarm.wire import frames
from moeswarm.wire.codecs import CODECS, INTEGER_CODECS
from moeswarm.wire.messages import U8_IDS

PACKAGE = Path(frames.__file__).resolve().parents[1]  # moeswarm/
DEFINE = re.compile(r"^#define (MSW_\w+) (.+?)(?:\s*/\*.*)?$", re.MULTILINE)  # a value, not a guard


def _defines() -> dict[str, object]:
    out = {}
    for name, value in DEFINE.findall((PACKAGE / "wire" / "frames.h").read_text()):
        out[name] = value.strip('"') if value.startswith('"') else eval(value, {})  # ints and (1 << 20)
    return out


def test_header_defines_equal_the_python_values():
    defines = _defines()
    assert defines.pop("MSW_MAGIC") == frames.MAGIC.decode()
    ids = {name: defines.pop(name) for name in list(defines) if name.startswith("MSW_ID_")}
    assert defines == frames.c_constants()
    assert ids == {**{f"MSW_ID_BYTES_{name.upper()}": CODECS[name].wire_dtype.itemsize for name in INTEGER_CODECS},
                   "MSW_ID_NONE_U8": 255}
    assert U8_IDS[255] == -1 and U8_IDS[254] == 254


def test_python_header_layout_matches_the_offsets():
    at = frames.c_constants()
    packed = frames.HEADER.pack(frames.MAGIC, frames.VERSION, 3, 0x0102, 0x1122334455667788, 0xAABBCCDD, 0x01020304)
    assert packed[at["MSW_AT_OPCODE"]] == 3 and packed[at["MSW_AT_VERSION"]] == frames.VERSION
    assert packed[at["MSW_AT_REQUEST_ID"]:][:8] == (0x1122334455667788).to_bytes(8, "little")
    assert packed[at["MSW_AT_META_LEN"]:][:4] == (0xAABBCCDD).to_bytes(4, "little")
    assert packed[at["MSW_AT_PAYLOAD_LEN"]:][:4] == (0x01020304).to_bytes(4, "little")
    assert int.from_bytes(packed[:4], "little") == at["MSW_MAGIC_U32"]


def test_every_frame_speaking_c_file_includes_the_header():
    for path in PACKAGE.rglob("*.c"):
        text = path.read_text()
        speaks = re.search(r'"MSWM"|\bMSW_\w+|\bHEADER_SIZE\b', text) is not None
        if speaks:
            assert '#include "frames.h"' in text, path
        assert '"MSWM"' not in text and "HEADER_SIZE 24" not in text, f"{path} restates the frame header"
    for name in ("qk_express.c", "qk_hold.c", "qkernels.c"):
        assert '#include "frames.h"' in (PACKAGE / "kernels" / name).read_text()
    assert '#include "frames.h"' in (PACKAGE / "transport" / "token_call.c").read_text()


needs_kernels = pytest.mark.skipif(not qkernels.available(), reason="the C kernels are not built")
needs_token_call = pytest.mark.skipif(not token_call.available(), reason="the C token call is not built")


@needs_kernels
def test_kernels_report_their_layout_and_it_is_python_s():
    report = native.reported(qkernels._library(), "qk_layout")
    assert report["QkLane"] == ctypes.sizeof(qkernels.ExpressLane)
    assert report["QkLane.hidden_at"] == qkernels.ExpressLane.hidden_at.offset == 32
    assert report["QkHoldOut.unsent_len"] == qkernels.HoldOut.unsent_len.offset
    assert {key: report[key] for key in frames.c_constants()} == frames.c_constants()


@needs_token_call
def test_token_call_reports_its_constants():
    report = native.reported(token_call._library(), "tc_layout")
    assert report["TC_BAD_ID"] == token_call.BAD_ID and report["TC_MISMATCH"] == token_call.MISMATCH
    assert report["MSW_OP_RESULT"] == frames.Opcode.RESULT


def _swapped(fields: list, one: str, other: str) -> list:
    names = [name for name, _ in fields]
    i, j = names.index(one), names.index(other)
    fields = list(fields)
    fields[i], fields[j] = fields[j], fields[i]
    return fields


class _SwappedLane(ctypes.Structure):
    """ExpressLane with `hidden_at` and `ids_at` in each other's place: same size, two offsets off."""

    _fields_ = _swapped(qkernels.ExpressLane._fields_, "hidden_at", "ids_at")


@needs_kernels
def test_a_mirror_that_disagrees_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(qk_mirrors, "ExpressLane", _SwappedLane)
    refused = r"^refusing moeswarm/_qkernels: QkLane\.hidden_at is 32 in C and 40 in Python"
    with pytest.raises(MoeSwarmError, match=refused):
        qkernels._library.__wrapped__()


class _SwappedMatmul(ctypes.Structure):
    """qk_matmul_call's Matmul with `rows` and `K` in each other's place: same size, two offsets off."""

    _fields_ = _swapped(qk_mirrors.Matmul._fields_, "rows", "K")


@needs_kernels
def test_a_call_struct_that_disagrees_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(qk_mirrors, "Matmul", _SwappedMatmul)
    refused = r"^refusing moeswarm/_qkernels: QkMatmul\.rows is 16 in C and 24 in Python"
    with pytest.raises(MoeSwarmError, match=refused):
        qkernels._library.__wrapped__()


@needs_kernels
def test_every_call_struct_is_in_the_kernels_layout_report():
    report = native.reported(qkernels._library(), "qk_layout")
    for c_name, mirror in qk_mirrors.mirrors().items():
        assert report[c_name] == ctypes.sizeof(mirror)
        assert {f"{c_name}.{name}": report[f"{c_name}.{name}"] for name, _ in mirror._fields_} == {
            f"{c_name}.{name}": getattr(mirror, name).offset for name, _ in mirror._fields_}


class _SwappedTake(ctypes.Structure):
    """tc_take's Take with `doze` and `spin` in each other's place: same size, two offsets off."""

    _fields_ = _swapped(token_call.Take._fields_, "doze", "spin")


@needs_token_call
def test_a_token_call_struct_that_disagrees_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(token_call, "Take", _SwappedTake)
    refused = r"^refusing moeswarm/_token_call: TcTake\.doze is 112 in C and 120 in Python"
    with pytest.raises(MoeSwarmError, match=refused):
        token_call._library.__wrapped__()


@needs_token_call
def test_a_library_reporting_other_constants_is_refused(monkeypatch):
    real = native.reported

    def reported(lib, function):
        return {**real(lib, function), "MSW_VERSION": frames.VERSION + 1}

    monkeypatch.setattr(native, "reported", reported)
    with pytest.raises(MoeSwarmError, match=r"refusing moeswarm/_token_call: MSW_VERSION is 3 in C and 2 in Python"):
        token_call._library.__wrapped__()


def test_check_layout_names_missing_and_extra_entries():
    class Mirror(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int64), ("b", ctypes.c_int64)]

    good = {"S": 16, "S.a": 0, "S.b": 8, "K": 1}
    native.check_layout("_x", good, {"S": Mirror}, {"K": 1})
    with pytest.raises(MoeSwarmError, match=r"S\.c is 16 in C and missing from Python's mirror"):
        native.check_layout("_x", {**good, "S": 24, "S.c": 16}, {"S": Mirror}, {"K": 1})
    with pytest.raises(MoeSwarmError, match=r"S\.b is 8 in Python and not reported by the library"):
        native.check_layout("_x", {key: v for key, v in good.items() if key != "S.b"}, {"S": Mirror}, {"K": 1})
