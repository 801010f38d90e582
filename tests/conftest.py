"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier  # noqa: E402
from tests.support.checkpoints import ARCHITECTURES, save_checkpoint  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved tiny random checkpoint per architecture."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: save_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def verifiers(checkpoints: dict[str, Path]) -> dict[str, TorchVerifier]:
    """The tiny checkpoints loaded through the torch backend's real loading path (fp32, cpu)."""
    return {arch: TorchVerifier.load(path, device="cpu", dtype="float32") for arch, path in checkpoints.items()}


@pytest.fixture
def serve(verifiers: dict[str, TorchVerifier]) -> Iterator[Callable[..., RunningServer]]:
    """Start daemons on loopback: `serve(arch="qwen3", **config)`; all are stopped after the test."""
    started: list[RunningServer] = []

    def factory(arch: str = "qwen3", **overrides: Any) -> RunningServer:
        server = start_server(verifiers[arch], **overrides)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
