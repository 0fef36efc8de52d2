"""KV cache layout and the hand-off between prefill and decode."""
