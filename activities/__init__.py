"""Thin Temporal adapters: unpack one input record → call ``kiln.*`` → return one small result."""
