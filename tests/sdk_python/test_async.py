"""The asyncio client against a real daemon: sessions, streams, conversations, concurrency, errors."""

from __future__ import annotations

import asyncio
import time

import grpc
import kakeya
import pytest
from kakeya import StopReason

from tests.sdk_python.conftest import reference_tokens
from tests.support.checkpoints import VOCAB_SIZE


async def _busy_slot(client: kakeya.AsyncClient) -> kakeya.AsyncTokenStream:
    blocker = await client.create_session(initial_tokens=[1, 2, 3], label="blocker")
    stream = blocker.generate(8000)
    await anext(stream)
    return stream


async def _wait_idle(session: kakeya.AsyncSession) -> kakeya.SessionInfo:
    deadline = time.monotonic() + 60
    while (info := await session.info()).generating and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return info


def test_an_async_session_round_trip(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            await client.wait_until_ready(10)
            async with await client.create_session(initial_tokens=[1, 2, 3], label="async") as session:
                assert await session.append([4, 5]) == 5
                stream = session.generate(8)
                tokens = [token async for token in stream]
                assert tokens == reference_tokens(server, [1, 2, 3, 4, 5], 8) == stream.tokens
                assert stream.stats == session.last_generation and stream.stats.stop_reason is StopReason.MAX_TOKENS
                info = await session.info(history_tail_tokens=8)
                assert info.history_length == 13 and info.history_tail == tuple(tokens) and info.label == "async"
                attached = client.session(session.id)
                assert repr(attached) == f"AsyncSession({session.id!r})"
                assert (await attached.info()).history_length == 13
            with pytest.raises(kakeya.SessionNotFound):
                await session.info()
            closed = await client.create_session(initial_tokens=[1])
            assert await closed.close() == 1

    asyncio.run(main())


def test_one_async_client_drives_concurrent_sessions(serve):
    server = serve("qwen3", max_concurrent=2)
    histories = [[i, i + 1, i + 2] for i in (3, 30, 60, 90)]
    expected = [reference_tokens(server, history, 12) for history in histories]

    async def turn(client: kakeya.AsyncClient, history: list[int]) -> list[int]:
        async with await client.create_session(initial_tokens=history[:1]) as session:
            await session.append(history[1:])
            return [token async for token in session.generate(12)]

    async def main() -> list[list[int]]:
        async with kakeya.AsyncClient(server.address) as client:
            return list(await asyncio.gather(*(turn(client, history) for history in histories)))

    assert asyncio.run(main()) == expected


def test_leaving_an_async_stream_early_cancels_the_generation(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[1, 2, 3])
            async with session.generate(5000) as stream:
                async for _ in stream:
                    break
            assert session.last_generation.stop_reason is StopReason.CANCELLED
            assert not session.last_generation.server_reported
            info = await _wait_idle(session)
            assert info.history_length < 3 + 5000
            received = 0
            async for _ in session.generate(5000):
                received += 1
                if received == 2:
                    break  # no `async with`: dropping the stream cancels it
            assert session.last_generation.generated_token_count == 2
            assert (await _wait_idle(session)).history_length < info.history_length + 5000
            assert len([t async for t in session.generate(3)]) == 3

    asyncio.run(main())
    assert 'kakeya_generate_requests_total{outcome="cancelled"} 2.0' in server.metrics_text()


def test_async_inter_token_timeout_deadline_and_cancel_from_another_task(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            blocker = await _busy_slot(client)
            session = await client.create_session(initial_tokens=[4, 5])
            with pytest.raises(kakeya.InterTokenTimeout):
                [t async for t in session.generate(4, inter_token_timeout_s=0.3)]
            with pytest.raises(kakeya.DeadlineExceeded):
                [t async for t in session.generate(4, timeout_s=0.3)]
            stream = session.generate(4)
            asyncio.get_running_loop().call_later(0.3, stream.cancel)
            with pytest.raises(kakeya.Cancelled):
                await anext(stream)
            await blocker.aclose()
            assert (await _wait_idle(session)).history_length == 2

    asyncio.run(main())


def test_cancelling_the_reading_task_cancels_the_generation(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            blocker = await _busy_slot(client)
            session = await client.create_session(initial_tokens=[4, 5])
            stream = session.generate(4)
            reader = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.2)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert stream.stats.stop_reason is StopReason.CANCELLED
            await blocker.aclose()
            assert (await _wait_idle(session)).history_length == 2

    asyncio.run(main())


def test_async_errors_are_typed(server, free_port):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            ghost = client.session("ghost")
            with pytest.raises(kakeya.SessionNotFound):
                await ghost.append([1])
            with pytest.raises(kakeya.SessionNotFound):
                [t async for t in ghost.generate(2)]
            session = await client.create_session(initial_tokens=[1])
            with pytest.raises(kakeya.InvalidArgument) as error:
                await session.append([VOCAB_SIZE])
            assert error.value.status == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(kakeya.InvalidArgument) as local:
                session.generate(0, top_k=-2)
            assert local.value.status is None
            with pytest.raises(kakeya.SessionNotFound):
                async with ghost.converse():
                    pass
        async with kakeya.AsyncClient(f"127.0.0.1:{free_port}", retry=kakeya.RetryPolicy(max_attempts=1)) as dead:
            with pytest.raises(kakeya.Unavailable):
                await dead.create_session()
            with pytest.raises(kakeya.Unavailable):
                await dead.wait_until_ready(0.2)

    asyncio.run(main())


def test_an_async_conversation(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[1, 2, 3])
            async with session.converse() as conversation:
                assert conversation.history_length == 3
                assert await conversation.append([4, 5]) == 5
                stream = await conversation.generate(6)
                tokens = [token async for token in stream]
                assert tokens == reference_tokens(server, [1, 2, 3, 4, 5], 6)
                assert stream.stats.server_reported and stream.stats.generated_token_count == 6
                long = await conversation.generate(5000)
                async for _ in long:
                    break
                assert await conversation.append([9]) == 11 + len(long.tokens) + 1
                assert long.stats.stop_reason is StopReason.CANCELLED
                other = await conversation.generate(5000)
                await anext(other)
                stats = await other.cancel()
                assert stats.generated_token_count == len(other.tokens)
                assert await conversation.cancel() is None
                async with await conversation.generate(5000) as held:
                    await anext(held)
                await conversation.append([1])
                expected = 3 + 2 + 6 + len(long.tokens) + 1 + len(other.tokens) + len(held.tokens) + 1
            assert (await session.info()).history_length == expected
            with pytest.raises(kakeya.InvalidArgument):
                await conversation.append([1])

    asyncio.run(main())


def test_a_stalled_async_conversation_raises_inter_token_timeout(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            blocker = await _busy_slot(client)
            session = await client.create_session(initial_tokens=[4, 5])
            conversation = await session.converse(inter_token_timeout_s=0.3).open()
            with pytest.raises(kakeya.InterTokenTimeout):
                [t async for t in await conversation.generate(4)]
            with pytest.raises(kakeya.InterTokenTimeout):
                await conversation.append([1])
            await conversation.close()
            await blocker.aclose()

    asyncio.run(main())


def test_closing_an_async_conversation_cancels_its_unfinished_generation(server):
    async def main() -> None:
        async with kakeya.AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[1, 2, 3])
            conversation = await session.converse().open()
            stream = await conversation.generate(5000)
            await anext(stream)
            started = time.monotonic()
            await conversation.close()
            assert time.monotonic() - started < 30  # not the rest of a 5,000-token generation
            info = await _wait_idle(session)
            assert not info.generating and 3 < info.history_length < 3 + 5000
            assert session.last_generation is None or session.last_generation.stop_reason is StopReason.CANCELLED

    asyncio.run(main())
