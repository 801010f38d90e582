"""Shared pieces of the scripts in `scripts/`: the results file format."""
