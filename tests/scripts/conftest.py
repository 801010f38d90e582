"""Fixtures shared by the script tests."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from inference_engine.config import BUNDLED_MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The bundled model's tokenizer (it has a chat template)."""
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR, local_files_only=True)
