"""moeswarm: Mixture-of-Experts models across a swarm of machines.

A backbone (attention, routers, shared experts, KV cache) runs the model; routed experts live
in worker processes reached over TCP. The hook is transformers' experts interface.
"""

import os

# Float matrix products whose bits do not depend on the thread count: MKL's strict conditional
# numerical reproducibility (torch's float32 matmuls on x86 are MKL's sgemm). Without it, the
# same product split over 1 or 2 threads gave other bits for 30 of 195 shapes (rows 1-39), so a
# stage, a worker or a local reference on another machine's thread count computed another model
# on a model directory. MKL reads it at its first call: this runs before any moeswarm module
# imports torch, and before a process that imports moeswarm first makes any product. Same speed
# measured (2048 x 2048, 1-64 rows). An explicit MKL_CBWR in the environment wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
