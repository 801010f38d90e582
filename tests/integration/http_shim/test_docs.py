"""The shim's documents state what the code does: the deprecation dates, every accepted field, the links."""

from __future__ import annotations

import re
from pathlib import Path

from inference_engine.transport.http_server import DEPRECATION_HEADERS
from inference_engine.transport.openai_schema import ChatCompletionRequest, CompletionRequest, StreamOptions

ROOT = Path(__file__).resolve().parents[3]
SHIM_DOC = (ROOT / "docs" / "http-shim.md").read_text()
MIGRATION_DOC = (ROOT / "docs" / "migration-from-openai.md").read_text()


def test_the_documented_deprecation_headers_are_the_ones_sent():
    for name, value in DEPRECATION_HEADERS:
        assert value.decode() in SHIM_DOC, name
        assert f"{name.decode().capitalize()}: {value.decode()}" in MIGRATION_DOC, name


def test_every_request_field_the_shim_knows_is_documented():
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    fields |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    missing = sorted(name for name in fields if f"`{name}`" not in SHIM_DOC)
    assert not missing


def test_the_readme_and_the_documents_link_each_other():
    readme = (ROOT / "README.md").read_text()
    assert "docs/http-shim.md" in readme and "docs/migration-from-openai.md" in readme
    assert "(migration-from-openai.md)" in SHIM_DOC and "(http-shim.md)" in MIGRATION_DOC
    assert re.search(r"from_openai_messages\(messages, tokenizer\)", MIGRATION_DOC)
