"""A model's structure: its experts modules, the meta skeleton, the "swarm" experts backend, the shared-expert overlap."""
