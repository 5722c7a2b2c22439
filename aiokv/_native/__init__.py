"""Optional native helpers (the batched memcpy kernel, chained block hashing)."""
