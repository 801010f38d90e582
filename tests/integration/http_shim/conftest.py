"""Live daemons with the HTTP shim on loopback ephemeral ports, serving the bundled kakeya-tiny model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.server import RunningServer, start_server


@pytest.fixture(scope="session")
def tiny_verifier() -> TorchVerifier:
    return TorchVerifier.load(BUNDLED_MODEL_DIR, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The bundled model's tokenizer as a client would load it, independently of the shim's own code."""
    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def shim(tiny_verifier: TorchVerifier) -> Iterator[RunningServer]:
    """One daemon (gRPC + HTTP shim) shared by a test module."""
    server = start_server(tiny_verifier, http_port=0)
    yield server
    server.stop()


@pytest.fixture
def serve_shim(tiny_verifier: TorchVerifier) -> Iterator[Callable[..., RunningServer]]:
    """Start daemons with the shim and `ServerConfig` overrides (a verifier of another model may be given)."""
    started: list[RunningServer] = []

    def factory(verifier: TorchVerifier | None = None, **overrides: Any) -> RunningServer:
        server = start_server(verifier or tiny_verifier, http_port=0, **overrides)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
