"""A worker node: the worker server, its announcements on the swarm's DHT and its relay attachment, run together."""
