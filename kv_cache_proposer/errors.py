"""Errors raised by the engine. The daemon maps them to wire status codes."""

from __future__ import annotations

from typing import Literal

InvariantKind = Literal["inv1", "inv2"]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory is missing, incomplete or of an unsupported kind."""


class InvariantViolation(EngineError):
    """A cache invariant broke: the session's cache can no longer be trusted.

    `inv1`: the token bookkeeping differs from the K/V length held by some layer.
    `inv2`: the next global position decreased.
    """

    def __init__(self, kind: InvariantKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: InvariantKind = kind
