"""ggml's one-row matrix products through ctypes on the libraries llama-cpp-python ships (a measurement
of the reference, never a path moeswarm runs): `bench products --against ggml`.

Only ggml's public C API is called (ggml.h, ggml-backend.h, ggml-alloc.h, ggml-cpu.h of the
llama.cpp that llama-cpp-python vendors): a context of weight tensors is placed in a buffer of one
buffer type (the CPU's plain buffer, or an extra one of its CPU device: AMX, CPU_REPACK), each
weight where that type supports its product as llama.cpp decides it (`ggml_backend_dev_supports_op`
on the product with the weight in a buffer of that type), the rest in plain buffers as llama.cpp
does; one graph holds the products y_i [1, rows_i] = x [1, K_i] W_i^T, and the CPU backend computes
it on one thread. No struct is read or written: tensors are handles, and their bytes go in and out
through `ggml_backend_tensor_set` / `_get` (which repack them for the extra types).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

_P, _SIZE, _I64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
GGML_TYPE_F32 = 0
PLAIN = "CPU"  # the CPU's plain buffer type (ggml_backend_cpu_buffer_type's name)
USAGE_WEIGHTS = 1  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", _SIZE), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


def library_dir() -> str:
    """Where llama-cpp-python keeps its ggml libraries (ImportError without llama-cpp-python)."""
    import llama_cpp

    return os.path.join(os.path.dirname(llama_cpp.__file__), "lib")


class Ggml:
    """The few entry points of libggml-base and libggml-cpu this measurement calls, declared."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory or library_dir()
        self.base = ctypes.CDLL(os.path.join(directory, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(os.path.join(directory, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        declared = {
            "ggml_init": ([_InitParams], _P), "ggml_free": ([_P], None), "ggml_tensor_overhead": ([], _SIZE),
            "ggml_graph_overhead_custom": ([_SIZE, ctypes.c_bool], _SIZE),
            "ggml_new_tensor_2d": ([_P, ctypes.c_int, _I64, _I64], _P), "ggml_mul_mat": ([_P, _P, _P], _P),
            "ggml_new_graph_custom": ([_P, _SIZE, ctypes.c_bool], _P), "ggml_build_forward_expand": ([_P, _P], None),
            "ggml_nbytes": ([_P], _SIZE), "ggml_backend_alloc_ctx_tensors_from_buft": ([_P, _P], _P),
            "ggml_backend_buffer_get_base": ([_P], _P), "ggml_backend_buffer_get_size": ([_P], _SIZE),
            "ggml_backend_buffer_free": ([_P], None), "ggml_backend_buffer_set_usage": ([_P, ctypes.c_int], None),
            "ggml_backend_tensor_set": ([_P, _P, _SIZE, _SIZE], None),
            "ggml_backend_tensor_get": ([_P, _P, _SIZE, _SIZE], None), "ggml_backend_cpu_buffer_type": ([], _P),
            "ggml_backend_buft_name": ([_P], ctypes.c_char_p), "ggml_backend_dev_supports_op": ([_P, _P], ctypes.c_bool),
            "ggml_backend_graph_compute": ([_P, _P], ctypes.c_int), "ggml_backend_free": ([_P], None),
            "ggml_backend_reg_dev_get": ([_P, _SIZE], _P), "ggml_backend_reg_get_proc_address": ([_P, ctypes.c_char_p], _P),
        }
        for name, (args, result) in declared.items():
            function = getattr(self.base, name)
            function.argtypes, function.restype = args, result
        self.cpu.ggml_backend_cpu_reg.restype = _P
        self.cpu.ggml_backend_cpu_init.restype = _P
        self.cpu.ggml_backend_cpu_set_n_threads.argtypes = [_P, ctypes.c_int]
        self.reg = self.cpu.ggml_backend_cpu_reg()
        self.device = self.base.ggml_backend_reg_dev_get(self.reg, 0)

    def buffer_types(self) -> dict[str, int]:
        """{name: buffer type} of the CPU: the plain one first, then its extra ones in llama.cpp's order."""
        found = {PLAIN: self.base.ggml_backend_cpu_buffer_type()}
        address = self.base.ggml_backend_reg_get_proc_address(self.reg, b"ggml_backend_dev_get_extra_bufts")
        if address:
            extras = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(address)(self.device)
            i = 0
            while extras and extras[i]:
                found[self.base.ggml_backend_buft_name(extras[i]).decode()] = extras[i]
                i += 1
        return found


@dataclass
class Placed:
    """A weight in ggml: its tensor, its buffer and the buffer type that holds it."""

    tensor: int
    buffer: int
    buffer_type: str


class OneRowProducts:
    """Matrices [(GGUF type, [rows, row bytes] blocks, K)] in ggml, each weight in `buffer_type` where that
    type supports its product (else plain), and one graph of their one-row products with x_K [1, K]."""

    def __init__(self, ggml: Ggml, matrices: list[tuple[int, np.ndarray, int]], buffer_type: str,
                 inputs: dict[int, np.ndarray]) -> None:
        self.ggml, base = ggml, ggml.base
        types = ggml.buffer_types()
        wanted, plain = types[buffer_type], types[PLAIN]
        self.contexts: list[int] = []
        self.weights: list[Placed] = []
        overhead = base.ggml_tensor_overhead()
        graph_size = 2 * len(matrices) + 16
        compute = self._context(overhead * (3 * len(matrices) + len(inputs) + 8) + base.ggml_graph_overhead_custom(graph_size, False))
        self.inputs = {K: base.ggml_new_tensor_2d(compute, GGML_TYPE_F32, K, 1) for K in inputs}
        self.outputs = []
        for qtype, blocks, K in matrices:
            placed = self._place(qtype, blocks.shape[0], K, wanted, plain, buffer_type, compute)
            self.weights.append(placed)
            self.outputs.append(base.ggml_mul_mat(compute, placed.tensor, self.inputs[K]))
        self.graph = base.ggml_new_graph_custom(compute, graph_size, False)
        for y in self.outputs:
            base.ggml_build_forward_expand(self.graph, y)
        self.compute_buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(compute, plain)
        for K, x in inputs.items():
            base.ggml_backend_tensor_set(self.inputs[K], x.ctypes.data, 0, x.nbytes)
        for placed, (_, blocks, _) in zip(self.weights, matrices):  # the extra types repack here
            data = np.ascontiguousarray(blocks)
            base.ggml_backend_tensor_set(placed.tensor, data.ctypes.data, 0, data.nbytes)
        self.backend = ggml.cpu.ggml_backend_cpu_init()
        ggml.cpu.ggml_backend_cpu_set_n_threads(self.backend, 1)
        self.shapes = [blocks.shape[0] for _, blocks, _ in matrices]

    def _context(self, size: int) -> int:
        ctx = self.ggml.base.ggml_init(_InitParams(size, None, True))
        if not ctx:
            raise RuntimeError("ggml_init failed")
        self.contexts.append(ctx)
        return ctx

    def _place(self, qtype: int, rows: int, K: int, wanted: int, plain: int, name: str, compute: int) -> Placed:
        """A weight tensor in a buffer of `wanted` if the CPU device supports its product there, else plain."""
        base = self.ggml.base
        for buffer_type, label in ((wanted, name), (plain, PLAIN)):
            ctx = self._context(2 * base.ggml_tensor_overhead())
            tensor = base.ggml_new_tensor_2d(ctx, qtype, K, rows)
            buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buffer_type)
            if not buffer:
                raise RuntimeError(f"ggml could not allocate a {label} buffer")
            base.ggml_backend_buffer_set_usage(buffer, USAGE_WEIGHTS)
            product = base.ggml_mul_mat(compute, tensor, self.inputs[K])
            if label == PLAIN or base.ggml_backend_dev_supports_op(self.ggml.device, product):
                return Placed(tensor, buffer, label)
            base.ggml_backend_buffer_free(buffer)  # its context is freed with the others
        raise AssertionError("unreachable")

    def weight_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of every weight's buffer: what a cold pass evicts first."""
        base = self.ggml.base
        return [(base.ggml_backend_buffer_get_base(p.buffer), base.ggml_backend_buffer_get_size(p.buffer))
                for p in self.weights]

    def run(self) -> None:
        if self.ggml.base.ggml_backend_graph_compute(self.backend, self.graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")

    def results(self) -> list[np.ndarray]:
        """Each product's y [rows] float32, after `run`."""
        out = []
        for y, rows in zip(self.outputs, self.shapes):
            values = np.empty(rows, dtype=np.float32)
            self.ggml.base.ggml_backend_tensor_get(y, values.ctypes.data, 0, values.nbytes)
            out.append(values)
        return out
