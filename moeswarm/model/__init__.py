"""Models: load a backbone without routed experts, load expert slices, the "swarm" experts backend."""
