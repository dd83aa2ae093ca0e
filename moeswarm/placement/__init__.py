"""Placement: which holders serve which experts, as data (pure functions, then a choice per call)."""
