"""The counter environment: count up to a seeded target without overshooting."""
