"""The GGUF format: a file's header and bounds, its metadata as a transformers config, tensor names, the
tokenizer, dequantization to float32, slice files. No C kernels here (moeswarm/kernels/ computes from the blocks)."""
