"""The engine: requests become sequences, a scheduler plans each step, a runner runs it over the swarm; `generate`'s front door."""
