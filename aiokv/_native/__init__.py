"""Optional native helpers (the batched memcpy kernel)."""
