"""Discovery on hivemind's DHT: workers announce themselves (signed, with a swarm key), backbones follow joins and leaves."""
