"""Shared test support: tiny real-architecture checkpoints, a loopback server harness, client helpers."""
