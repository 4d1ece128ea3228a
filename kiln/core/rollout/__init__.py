"""Rollout collection: prompts, seeded episodes, seed groups, and the artifact bundle they form."""
