"""Test support: real servers started as subprocesses on loopback and stopped by PID."""
