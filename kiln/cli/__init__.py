"""The ``kiln`` command line (typer + rich). Talks to the REST API; never imports temporalio."""
