"""Forward machinery: packed (ragged) forwards, latent attention, sequence caches, the stepper, the cache journal."""
