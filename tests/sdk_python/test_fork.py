"""`Session.fork()` in the sync and asyncio clients against a real daemon."""

from __future__ import annotations

import asyncio

import kakeya
import pytest

from tests.sdk_python.conftest import reference_tokens


def test_a_fork_branches_the_history_and_both_continue_independently(server, client):
    with client.create_session(initial_tokens=list(range(10, 30)), label="root") as parent:
        first = list(parent.generate(5))
        history = list(range(10, 30)) + first
        with parent.fork() as branch, parent.fork(prefix_tokens=12, label="short") as short:
            assert branch.id not in (parent.id, short.id)
            info = branch.info(history_tail_tokens=len(history))
            assert info.history_tail == tuple(history) and info.label == "root" and info.pending_token_count == 1
            assert short.info().history_length == 12 and short.info().label == "short"
            branch.append([7, 8])
            tokens = list(branch.generate(6))
            assert branch.last_generation is not None and branch.last_generation.prefill_token_count == 3
            assert tokens == reference_tokens(server, [*history, 7, 8], 6)
            assert list(short.generate(4)) == reference_tokens(server, list(range(10, 22)), 4)
        assert parent.info().history_length == len(history), "the parent is untouched by its forks"
        assert list(parent.generate(4)) == reference_tokens(server, history, 4)


@pytest.mark.parametrize(("kwargs", "message"), [({"prefix_tokens": -1}, "prefix_tokens"), ({"label": 3}, "label")])
def test_fork_arguments_are_checked_before_the_call(client, kwargs, message):
    with client.create_session(initial_tokens=[1, 2]) as parent, pytest.raises(kakeya.InvalidArgument, match=message):
        parent.fork(**kwargs)


def test_a_fork_beyond_the_history_is_an_invalid_argument_from_the_server(client):
    with client.create_session(initial_tokens=[1, 2]) as parent, pytest.raises(kakeya.InvalidArgument):
        parent.fork(prefix_tokens=3)


def test_an_async_fork_branches_the_history(server):
    async def main() -> None:
        async with (
            kakeya.AsyncClient(server.address) as client,
            await client.create_session(initial_tokens=[5, 6, 7, 8]) as parent,
        ):
            tokens = [t async for t in parent.generate(4)]
            async with await parent.fork(prefix_tokens=6, label="b") as branch:
                assert isinstance(branch, kakeya.AsyncSession)
                info = await branch.info(history_tail_tokens=6)
                assert info.history_tail == (5, 6, 7, 8, *tokens[:2]) and info.label == "b"
                branched = [t async for t in branch.generate(3)]
                assert branched == reference_tokens(server, [5, 6, 7, 8, *tokens[:2]], 3)
            with pytest.raises(kakeya.SessionNotFound):
                await client.session("gone").fork()

    asyncio.run(main())
