"""Taskbank: a tiny dataset-backed OpenEnv environment with a Task API."""
