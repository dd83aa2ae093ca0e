"""Where a model's weights come from (a Hugging Face directory or a GGUF file), and loading, tokenizer and summary over them."""
