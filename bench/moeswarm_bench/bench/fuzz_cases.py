"""Cases for the worker fuzzer: random bytes, mutated valid frames, adversarial DISPATCHes.

Each case is the bytes to send and whether they form exactly one well-framed frame (then the
fuzzer sends them on a greeted connection, follows them with a PING and checks the reply against
a local computation) or may break the framing (then they go on a fresh connection that is
half-closed after them, and only crashes, hangs and a clean close are checked).

Legend: T = tokens, k = top-k, d = hidden size.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from moeswarm.wire.codecs import CODECS, DTYPES
from moeswarm.wire.frames import HEADER, HEADER_SIZE, MAGIC, VERSION, Opcode, parse_header

CODEC_NAMES = sorted(CODECS)
SPECIAL_FLOATS = [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, 0.0, -0.0, 65504.0, 1e5]
SPECIAL_INTS = [0, 1, -1, 2, 255, 256, 32767, 32768, 65535, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
MAX_CASE_BYTES = 4 << 20  # what one case may send, so a run stays quick


@dataclass(frozen=True)
class Case:
    kind: str
    data: bytes
    framed: bool  # exactly one complete frame with a well-formed header
    greet: bool = True  # send HELLO first (framed cases always go on a greeted connection)


@dataclass(frozen=True)
class Shape:
    """What the worker serves: the fuzzer aims its values around it."""

    hidden: int
    num_experts: int
    layers: tuple[int, ...]
    held: tuple[int, ...]
    max_tokens: int
    max_top_k: int


def frame_bytes(opcode: int, request_id: int, meta: Any, payload: bytes = b"", meta_bytes: bytes | None = None) -> bytes:
    packed = msgpack.packb(meta, use_bin_type=True) if meta_bytes is None else meta_bytes
    return HEADER.pack(MAGIC, VERSION, opcode, 0, request_id, len(packed), len(payload)) + packed + payload


def is_framed(data: bytes) -> bool:
    """Whether `data` is exactly one frame whose header passes the default checks."""
    try:
        header = parse_header(data[:HEADER_SIZE])
    except Exception:
        return False
    return len(data) == HEADER_SIZE + header.body_len


class CaseMaker:
    """Draws cases from a seeded generator; the same seed gives the same cases."""

    def __init__(self, shape: Shape, seed: int):
        self.shape = shape
        self.rng = random.Random(seed)
        self.torch_gen = torch.Generator().manual_seed(seed)
        self.request_id = 1000

    def next(self) -> Case:
        self.request_id += 1
        roll = self.rng.random()
        if roll < 0.10:
            return self.random_bytes()
        if roll < 0.35:
            return self.mutated()
        if roll < 0.50:
            return self.odd_metadata()
        return self.adversarial_dispatch()

    # -- the valid frame all mutations start from ------------------------------------------------

    def valid_dispatch(self, tokens: int | None = None, mode: str = "exact") -> tuple[dict, bytes]:
        s, rng = self.shape, self.rng
        tokens = tokens or rng.choice([1, 1, 2, 3, 5, 8, 17])
        k = rng.randint(1, min(8, s.num_experts))
        ids = np.full((tokens, k), -1, dtype=np.int64)
        for t in range(tokens):
            chosen = rng.sample(range(s.num_experts), k)
            mine = [e for e in chosen if e in s.held] or [rng.choice(s.held)]
            ids[t, : len(mine)] = mine
        hidden = torch.randn(tokens, s.hidden, generator=self.torch_gen)
        weights = torch.rand(tokens, k, generator=self.torch_gen)
        u8 = np.where(ids < 0, 255, ids).astype(np.uint8)
        meta = {"layer": rng.choice(s.layers), "mode": mode, "combine": "f32",
                "tensors": [["x", "f32", "f32", [tokens, s.hidden]], ["ids", "u8", "u8", [tokens, k]],
                            ["w", "f32", "f32", [tokens, k]]]}
        payload = hidden.numpy().tobytes() + u8.tobytes() + weights.numpy().tobytes()
        return meta, payload

    # -- kinds ----------------------------------------------------------------------------------------

    def random_bytes(self) -> Case:
        rng = self.rng
        size = rng.choice([1, 5, 23, 24, 25, 100, rng.randint(0, 4096)])
        data = rng.randbytes(size)
        if rng.random() < 0.5:  # a valid start, then noise: reaches the later checks
            data = HEADER.pack(MAGIC, VERSION, rng.randint(0, 9), 0, self.request_id,
                               rng.choice([0, 1, 10, 100, 2**20, 2**20 + 1, 2**32 - 1]),
                               rng.choice([0, 1, 100, 2**16, 2**30, 2**30 + 1, 2**32 - 1])) + data
        return Case("random-bytes", data, is_framed(data), greet=rng.random() < 0.5)

    def mutated(self) -> Case:
        rng = self.rng
        meta, payload = self.valid_dispatch()
        data = bytearray(frame_bytes(Opcode.DISPATCH, self.request_id, meta, payload))
        for _ in range(rng.randint(1, 4)):
            how = rng.randrange(7)
            if how == 0 and data:  # flip bits
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
            elif how == 1 and data:  # overwrite a byte
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif how == 2:  # truncate
                del data[rng.randrange(len(data) + 1):]
            elif how == 3:  # append noise
                data += rng.randbytes(rng.randint(1, 64))
            elif how == 4 and len(data) > HEADER_SIZE:  # a byte in the metadata, where msgpack lives
                meta_len = int.from_bytes(data[16:20], "little")
                if meta_len:
                    data[HEADER_SIZE + rng.randrange(min(meta_len, len(data) - HEADER_SIZE))] = rng.randrange(256)
            elif how == 5 and len(data) >= HEADER_SIZE:  # a header field
                offset, width = rng.choice([(4, 1), (5, 1), (6, 2), (8, 8), (16, 4), (20, 4)])
                data[offset:offset + width] = rng.randrange(256 ** width).to_bytes(width, "little")
            elif how == 6 and len(data) > HEADER_SIZE + 8:  # splice: drop a run of bytes
                i = rng.randrange(HEADER_SIZE, len(data) - 4)
                del data[i:i + rng.randint(1, 8)]
        data = bytes(data)
        framed = is_framed(data)
        if not framed and rng.random() < 0.5 and len(data) >= HEADER_SIZE:  # fix the lengths: framed again
            try:
                header = parse_header(data[:HEADER_SIZE])
            except Exception:
                header = None
            if header is not None and header.meta_len <= len(data) - HEADER_SIZE:
                body = data[HEADER_SIZE:]
                data = HEADER.pack(MAGIC, VERSION, header.opcode, 0, header.request_id, header.meta_len,
                                   len(body) - header.meta_len) + body
                framed = is_framed(data)
        return Case("mutated", data, framed)

    def odd_metadata(self) -> Case:
        """A valid DISPATCH with one metadata field (or the whole map) replaced by an odd value."""
        rng = self.rng
        meta, payload = self.valid_dispatch()
        target = rng.choice(["layer", "mode", "combine", "tensors", "desc", "desc-item", "extra", "whole", "drop"])
        if target == "whole":
            meta = self.odd_value(depth=2)
        elif target == "drop":
            meta.pop(rng.choice(list(meta)))
        elif target == "extra":
            meta[rng.choice(["x", "role", "experts", "ü" * 3, "\x1b[2J"])] = self.odd_value()
        elif target == "desc":
            meta["tensors"][rng.randrange(3)] = self.odd_value()
        elif target == "desc-item":
            meta["tensors"][rng.randrange(3)][rng.randrange(4)] = self.odd_value()
        else:
            meta[target] = self.odd_value()
        opcode = rng.choice([Opcode.DISPATCH] * 6 + [Opcode.HELLO, Opcode.PING, Opcode.RESULT, Opcode.ERROR, 0, 200])
        if rng.random() < 0.1:  # metadata that is not msgpack at all
            return Case("odd-metadata", frame_bytes(opcode, self.request_id, None, payload,
                                                    meta_bytes=self.rng.randbytes(rng.randint(1, 40))), True)
        return Case("odd-metadata", frame_bytes(opcode, self.request_id, meta, payload), True)

    def odd_value(self, depth: int = 1) -> Any:
        rng = self.rng
        kind = rng.randrange(10 if depth > 0 else 7)
        if kind == 0:
            return rng.choice(SPECIAL_INTS)
        if kind == 1:
            return rng.choice(SPECIAL_FLOATS)
        if kind == 2:
            return rng.choice(["", "exact", "partial", "f32", "u8", "x", "\x00", "\x1b[31mok", "é" * 100, "a" * 5000])
        if kind == 3:
            return rng.choice([None, True, False])
        if kind == 4:
            return rng.randbytes(rng.randint(0, 32))
        if kind == 5:
            return rng.choice(CODEC_NAMES + list(DTYPES))
        if kind == 6:
            return rng.choice([[], {}, [[]], [None] * 4])
        if kind in (7, 8):
            return [self.odd_value(depth - 1) for _ in range(rng.randint(0, 5))]
        return {str(self.odd_value(0))[:20]: self.odd_value(depth - 1) for _ in range(rng.randint(0, 4))}

    def adversarial_dispatch(self) -> Case:
        """Well-formed framing and msgpack; a valid DISPATCH with one to three knobs twisted:
        sizes (zero, at and over the limits, huge), special values, ids, dtypes, codecs, shapes."""
        s, rng = self.shape, self.rng
        knobs = {"tokens": rng.choice([1, 2, 4, 9, rng.randint(1, 64)]), "k": rng.choice([1, 2, 4, 8]),
                 "width": s.hidden, "mode": rng.choice(["exact", "partial"]), "combine": "f32",
                 "x_codec": "f32", "x_dtype": "f32", "ids_codec": "u8", "ids_dtype": None,
                 "w_codec": "f32", "w_dtype": "f32", "layer": rng.choice(s.layers), "shape": None, "length": None}
        twists = {
            "tokens": lambda: rng.choice([0, s.max_tokens, s.max_tokens + 1, 2**31 - 1, 2**31]),
            "k": lambda: rng.choice([0, s.max_top_k, s.max_top_k + 1, 100_000]),
            "width": lambda: rng.choice([0, 1, s.hidden - 1, s.hidden + 1, 2**20]),
            "mode": lambda: rng.choice(["fancy", "", "EXACT"]),
            "combine": lambda: rng.choice(["bf16", "f16", "int8-b32", "fp8-b128", "u8", "i32", "i64", "zip"]),
            "x_codec": lambda: rng.choice(["f16", "bf16", "int8-b64", "fp8-b32", "u8", "i32", "q3"]),
            "x_dtype": lambda: rng.choice(["bf16", "f16", "i64", "u8"]),
            "ids_codec": lambda: rng.choice(["i16", "i32", "i64", "f32", "bf16"]),
            "ids_dtype": lambda: rng.choice(list(DTYPES)),
            "w_codec": lambda: rng.choice(["f16", "bf16", "int8-b32", "u8"]),
            "w_dtype": lambda: rng.choice(["bf16", "f16", "i32"]),
            "layer": lambda: rng.choice([99, -1, 2**40]),
            "shape": lambda: rng.randrange(4),
            "length": lambda: rng.choice([-3, -1, 1, 3]),
        }
        for knob in rng.sample(sorted(twists), rng.randint(0, 3)):
            knobs[knob] = twists[knob]()
        tokens, k, width = knobs["tokens"], knobs["k"], knobs["width"]
        shape_x, shape_ids = [tokens, width], [tokens, k]
        shape_w = list(shape_ids)
        if knobs["shape"] == 0:  # ranks and shapes that disagree
            shape_x = [tokens * width]
        elif knobs["shape"] == 1:
            shape_ids = [tokens, k, 1]
        elif knobs["shape"] == 2:
            shape_w = [tokens + 1, k]
        elif knobs["shape"] == 3:
            shape_x = [tokens, width, 1, 1, 1]
        ids_codec = knobs["ids_codec"]
        meta = {"layer": knobs["layer"], "mode": knobs["mode"], "combine": knobs["combine"],
                "tensors": [["x", knobs["x_codec"], knobs["x_dtype"], shape_x],
                            ["ids", ids_codec, knobs["ids_dtype"] or ids_codec, shape_ids],
                            ["w", knobs["w_codec"], knobs["w_dtype"], shape_w]]}
        payload = b"".join([
            self._tensor_bytes(knobs["x_codec"], shape_x, self._hidden_values),
            self._tensor_bytes(ids_codec, shape_ids, self._id_values),
            self._tensor_bytes(knobs["w_codec"], shape_w, self._weight_values),
        ])
        if knobs["length"] is not None and payload:  # a length that does not add up
            cut = knobs["length"]
            payload = payload[:cut] if cut < 0 else payload + b"\0" * cut
        return Case("adversarial", frame_bytes(Opcode.DISPATCH, self.request_id, meta, payload), True)

    def _tensor_bytes(self, codec_name: str, shape: list[int], values) -> bytes:
        codec = CODECS.get(codec_name)
        numel = math.prod(shape)
        if codec is None or numel == 0:
            return self.rng.randbytes(self.rng.choice([0, 4, 16]))
        try:
            size = codec.nbytes(tuple(shape))
        except Exception:
            return b""
        if size > MAX_CASE_BYTES // 3:  # declared huge: send what fits, the worker must refuse it by its header
            return self.rng.randbytes(min(64, size))
        tensor = values(shape)
        try:
            return bytes(codec.encode(tensor))
        except Exception:  # e.g. a blockwise codec refuses NaN: the right length of noise instead
            return self.rng.randbytes(size)

    def _hidden_values(self, shape: list[int]) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.torch_gen)
        return self._sprinkle(x)

    def _weight_values(self, shape: list[int]) -> torch.Tensor:
        return self._sprinkle(torch.rand(*shape, generator=self.torch_gen))

    def _sprinkle(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng.random() < 0.4 and x.numel():
            flat = x.view(-1)
            for _ in range(self.rng.randint(1, 4)):
                flat[self.rng.randrange(flat.numel())] = self.rng.choice(SPECIAL_FLOATS)
        return x

    def _id_values(self, shape: list[int]) -> torch.Tensor:
        s, rng = self.shape, self.rng
        tokens, k = (shape + [1, 1])[:2] if len(shape) >= 2 else (shape[0], 1)
        ids = torch.full((tokens, k), -1, dtype=torch.int64)
        for t in range(tokens):
            picks = rng.sample(s.held, min(k, len(s.held), rng.randint(1, max(1, k))))
            ids[t, : len(picks)] = torch.tensor(picks)
        twist = rng.randrange(8)
        if twist == 0 and k > 1:  # a duplicated id in a row
            ids[rng.randrange(tokens), 1] = ids[0, 0] if ids[0, 0] >= 0 else s.held[0]
            ids[rng.randrange(tokens), :2] = s.held[0]
        elif twist == 1:
            ids.view(-1)[rng.randrange(ids.numel())] = rng.choice([s.num_experts, 300, -2, -100, 2**15 - 1])
        elif twist == 2:
            ids.fill_(-1)
        elif twist == 3:  # experts this worker does not hold
            others = [e for e in range(s.num_experts) if e not in s.held] or [s.num_experts]
            ids.view(-1)[rng.randrange(ids.numel())] = rng.choice(others)
        return ids.reshape(shape)
