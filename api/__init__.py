"""FastAPI REST facade over Temporal: ``create_app(settings)``."""
