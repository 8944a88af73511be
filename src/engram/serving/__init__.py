"""Serving: a trained run loaded with its tables on any tier (loader) and batched incremental
generation with KV cache, n-gram history and conv state (generate)."""
