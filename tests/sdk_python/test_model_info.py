"""The Python SDK's model facts and limits: `model_info()`, default EOS ids, max_tokens checked against the server's
limit, idempotent close, a short `SessionInfo` repr."""

from __future__ import annotations

import asyncio

import kakeya
import pytest

from tests.support.checkpoints import copy_with_eos
from tests.support.server import RunningServer, start_server


def test_model_info_reports_the_servers_facts_and_limits(serve):
    server: RunningServer = serve("qwen3", max_generate_tokens=64, kv_strategy="sink_window", sink=2, window=32)
    with kakeya.Client(server.address) as client:
        info = client.model_info()
        assert info.vocab_size == 128 and info.eos_token_ids == () and info.chat_template is None
        assert info.backend == "torch" and info.trained_context_tokens == 4096
        assert info.default_kv_strategy is kakeya.KvStrategy.SINK_WINDOW
        assert (info.default_sink_tokens, info.default_window_tokens) == (2, 32)
        assert info.limits.max_generate_tokens == 64
        assert (info.limits.max_batch_size, info.limits.prefill_chunk_tokens) == (16, 512)
        assert client.model_info() is info, "asked once per client"


@pytest.mark.parametrize("max_tokens", [-1, 0, 65, 1 << 40])
def test_max_tokens_outside_the_servers_limit_is_refused_with_that_range(serve, max_tokens):
    server: RunningServer = serve("qwen3", max_generate_tokens=64)
    with kakeya.Client(server.address) as client, client.create_session(initial_tokens=[1, 2]) as session:
        with pytest.raises(kakeya.InvalidArgument, match=r"max_tokens must be in 1\.\.64 \(the server's limit\)"):
            session.generate(max_tokens)
        with pytest.raises(kakeya.InvalidArgument, match=r"1\.\.64"), session.converse() as conversation:
            conversation.generate(max_tokens)
        assert len(list(session.generate(64))) == 64


def test_async_max_tokens_is_checked_against_the_servers_limit(serve):
    server: RunningServer = serve("qwen3", max_generate_tokens=8)

    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[1, 2])
            with pytest.raises(kakeya.InvalidArgument, match=r"1\.\.8"):
                session.generate(-1)
            with pytest.raises(kakeya.InvalidArgument, match=r"1\.\.8"):
                session.generate(9)
            assert len([t async for t in session.generate(8)]) == 8
            await session.close()

    asyncio.run(main())


def test_a_second_close_returns_the_same_length_without_an_error(client):
    session = client.create_session(initial_tokens=[1, 2, 3])
    assert session.close() == 3
    assert session.close() == 3
    with pytest.raises(kakeya.SessionNotFound):
        session.info()


def test_a_second_async_close_returns_the_same_length(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[1, 2])
            assert await session.close() == 2
            assert await session.close() == 2

    asyncio.run(main())


def test_eos_ids_default_to_the_models_and_an_empty_list_opts_out(verifier_pool, tmp_path):
    verifier = verifier_pool.get("torch", "qwen3")
    source = verifier_pool.model_dir("torch", "qwen3")
    prompt = [5, 17, 42, 9]
    probe = start_server(verifier, model_dir=source)
    try:
        with kakeya.Client(probe.address) as client, client.create_session(initial_tokens=prompt) as session:
            stream = list(session.generate(8))
    finally:
        probe.stop()
    eos = stream[3]
    assert eos not in stream[:3], "the prompt must reach the EOS id only at the fourth token"
    server = start_server(verifier, model_dir=copy_with_eos(source, tmp_path / "eos", [eos]))
    try:
        with kakeya.Client(server.address) as client:
            assert client.model_info().eos_token_ids == (eos,)
            with client.create_session(initial_tokens=prompt) as default:
                assert list(default.generate(8)) == stream[:4]
                assert default.last_generation is not None
                assert default.last_generation.stop_reason is kakeya.StopReason.EOS
            with client.create_session(initial_tokens=prompt, eos_token_ids=[]) as opted_out:
                assert list(opted_out.generate(8)) == stream
    finally:
        server.stop()


def test_session_info_repr_counts_the_history_tail_instead_of_printing_it(client):
    with client.create_session(initial_tokens=list(range(1, 101))) as session:
        info = session.info(history_tail_tokens=100)
    assert len(info.history_tail) == 100
    text = repr(info)
    assert "history_tail=<100 tokens>" in text
    assert "history_length=100" in text
    assert len(text) < 400
