"""Helpers shared by the pymoe training, conversion and evaluation scripts."""
