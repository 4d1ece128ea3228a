"""Chaos tests: real Kiln processes and servers, faults injected for real (see conftest.py)."""
