"""Weights from files other than a Hugging Face directory: GGUF reading, mapping, expert slices."""
