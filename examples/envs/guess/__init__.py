"""Guess the number: a multi-turn OpenEnv environment with a sparse, delayed reward."""
