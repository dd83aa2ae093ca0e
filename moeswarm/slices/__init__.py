"""Slices: a model file's manifest, the seeder that serves its byte ranges, and fetch-slice that takes only some experts."""
