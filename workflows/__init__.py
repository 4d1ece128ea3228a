"""Deterministic orchestration only: no I/O, no torch, no httpx. Activities run the work."""
