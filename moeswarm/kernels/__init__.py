"""The C kernels that compute from GGUF blocks (qkernels.c and its qk_*.c parts, through qkernels.py), their
speed choices measured per host, and the modules built on them: quantized experts, Linear/Embedding, row ops."""
