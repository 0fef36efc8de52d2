"""The reference engine: a Llama-family decoder in PyTorch with a paged KV cache."""
