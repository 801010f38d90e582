"""The documents that describe the daemon stay true: the quickstart runs, every metric is documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.metrics import Metrics
from inference_engine.model_source import choose_weights
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.server import generate, start_server

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def test_the_quickstart_python_chat_answers_from_the_default_model(capsys, monkeypatch, smollm2_dir):
    weights, _ = choose_weights("auto", smollm2_dir, backend="torch", on_cpu=True)
    assert weights == "int4", "the default model is served as a user's daemon serves it"
    verifier = TorchVerifier.load(smollm2_dir, device="cpu", dtype="float32", weights=weights)
    server = start_server(verifier, model=str(smollm2_dir), model_dir=smollm2_dir)
    try:
        (block,) = _python_blocks((DOCS / "quickstart.md").read_text())
        assert "127.0.0.1:50051" in block
        monkeypatch.chdir(ROOT)
        monkeypatch.delenv("KAKEYA_MODEL")  # the example's prepare-model names the default model, as a user's does
        exec(compile(block.replace("127.0.0.1:50051", server.address), "quickstart.md", "exec"), {})
        printed = capsys.readouterr().out.splitlines()
        assert "Paris" in printed[0]
        assert "Rome" in printed[1]
        assert len(server.runtime.store) == 0, "the example closes its session"
    finally:
        server.stop()


def test_the_quickstart_grpcurl_session_stops_at_the_models_eos(smollm2_dir):
    text = (DOCS / "quickstart.md").read_text()
    calls = dict(
        (method, json.loads(body))
        for body, method in re.findall(r"grpcurl -plaintext -d '(\{.*?\})' \S+ kakeya\.v1\.RuntimeService/(\w+)", text)
    )
    assert set(calls) == {"CreateSession", "Generate"}
    verifier = TorchVerifier.load(smollm2_dir, device="cpu", dtype="float32")
    server = start_server(verifier, model=str(smollm2_dir), model_dir=smollm2_dir)
    try:
        session_id = server.stub.CreateSession(pb.CreateSessionRequest(**calls["CreateSession"])).session_id
        result = generate(server.stub, session_id, max_tokens=calls["Generate"]["max_tokens"])
        assert result.done is not None and result.done.stop_reason == pb.STOP_REASON_EOS
        assert result.tokens[-1] in server.runtime.default_eos_token_ids
        assert len(result.tokens) < calls["Generate"]["max_tokens"]
    finally:
        server.stop()


def test_every_exported_metric_is_described_in_the_operator_guide():
    guide = (DOCS / "operator-guide.md").read_text()
    names = set()
    for metric in Metrics().registry.collect():
        suffix = "_total" if metric.type == "counter" else ""
        names.add(metric.name + suffix)
    missing = sorted(name for name in names if f"`{name}" not in guide and f" {name}" not in guide)
    assert not missing


def _anchor(heading: str) -> str:
    """The fragment a Markdown renderer gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_document_and_section_linked_from_the_readme_exists():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        path, _, fragment = link.partition("#")
        assert (ROOT / path).is_file(), link
        if fragment:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.MULTILINE)
            assert fragment in {_anchor(h) for h in headings}, link
