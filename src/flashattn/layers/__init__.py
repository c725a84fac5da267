"""flash_attn 2.x's `flash_attn.layers` modules that code importing flash_attn uses (rotary)."""
