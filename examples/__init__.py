"""Example OpenEnv environments built with the real ``openenv`` package."""
