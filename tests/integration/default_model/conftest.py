"""One float32 SmolLM2 verifier, its tokenizer and one server (gRPC and HTTP shim) for the default model's tests,
and the reference chat they compare with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kakeya.tokenization import load_tokenizer

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.integration.default_model.chat import (
    FRANCE,
    ITALY,
    Chat,
    start_chat,
    text,
)
from tests.support.server import RunningServer, start_server


@pytest.fixture(scope="package")
def verifier(smollm2_dir: Path) -> TorchVerifier:
    return TorchVerifier.load(smollm2_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="package")
def tokenizer(smollm2_dir: Path) -> Any:
    """The model's tokenizer as a client loads it, with the model's own chat template."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="package")
def server(verifier: TorchVerifier, smollm2_dir: Path) -> Iterator[RunningServer]:
    """One daemon (gRPC and HTTP shim) for the package: batching on, `dlm_restore` recomputing every layer, the
    default proposer (ngram)."""
    running = start_server(
        verifier,
        model_dir=smollm2_dir,
        model=str(smollm2_dir),
        restore_plan="recompute",
        max_concurrent=4,
        max_batch_size=4,
        http_port=0,
    )
    yield running
    running.stop()


@pytest.fixture(scope="package")
def reference_chat(server: RunningServer, tokenizer: Any) -> Chat:
    """France then Italy on a `full` session: the answers every other way of serving must match."""
    chat = start_chat(server, tokenizer, [FRANCE, ITALY])
    assert "Paris" in text(tokenizer, chat.turns[0].tokens)
    assert "Rome" in text(tokenizer, chat.turns[1].tokens)
    return chat
