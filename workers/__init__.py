"""Worker processes: ``python -m workers control|gpu|all``."""
