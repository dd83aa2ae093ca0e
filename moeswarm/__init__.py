"""moeswarm: Mixture-of-Experts models across a swarm of machines.

A backbone (attention, routers, shared experts, KV cache) runs the model; routed experts live
in worker processes reached over TCP. The hook is transformers' experts interface.
"""

__version__ = "0.1.0"
