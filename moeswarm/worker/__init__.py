"""Expert workers: hold a slice of the routed experts and serve DISPATCH requests over TCP."""
