"""The C kernels that compute from GGUF blocks (moeswarm/kernels/qkernels.c), through ctypes: the names
callers use, gathered from the files that hold one concept each.

- qk_library.py: the library loaded, its layout checked, its functions declared; its settings
  (`available`, `isa`, `use_isa`, `tuning`, `tune`, `rest`, `supported`)
- qk_mirrors.py: the ctypes mirrors of its structs (checked at load against its layout report)
- qk_matmul.py: products from GGUF blocks (`matmul`, `matmul_heads`, `dequantize`, `row_bytes`)
- qk_rows.py: row operations (`rms_norm`, `rope`, `rope_table`, `attend_one`, `silu_glu`, `oss_glu`,
  `add_rows`, `peak`)
- qk_experts.py: experts in one call (`expert`, `ExpertsPlan`, `experts`, `dispatch_sums`, `dispatch_rows`)
- qk_lanes.py: a DISPATCH answered whole (`express_lane`, `express_answer`, `hold`)

Every function takes float32 torch tensors and returns new ones; the bits of each output value
depend only on its weight row and its input row (see the C file): never on the thread count.
"""

from __future__ import annotations

from moeswarm.kernels.qk_experts import (ACTIVATIONS, Blocks, ExpertsPlan, dispatch_rows, dispatch_sums, expert,
                                         experts)
from moeswarm.kernels.qk_lanes import express_answer, express_lane, hold
from moeswarm.kernels.qk_library import (INT8_TYPES, ISAS, _library, available, isa, rest, supported, tune, tuning,
                                         use_isa)
from moeswarm.kernels.qk_matmul import address, dequantize, matmul, matmul_heads, row_bytes
from moeswarm.kernels.qk_mirrors import HOLD_ANSWER, ExpressLane, HoldLane, HoldOut
from moeswarm.kernels.qk_rows import add_rows, attend_one, oss_glu, peak, rms_norm, rope, rope_table, silu_glu

__all__ = ["ACTIVATIONS", "HOLD_ANSWER", "INT8_TYPES", "ISAS", "Blocks", "ExpertsPlan", "ExpressLane", "HoldLane",
           "HoldOut", "_library", "add_rows", "address", "attend_one", "available", "dequantize", "dispatch_rows",
           "dispatch_sums", "expert", "experts", "express_answer", "express_lane", "hold", "isa", "matmul",
           "matmul_heads", "oss_glu", "peak", "rest", "rms_norm", "rope", "rope_table", "row_bytes", "silu_glu",
           "supported", "tune", "tuning", "use_isa"]
