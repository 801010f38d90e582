"""A generation's next step runs while its current tokens stream (and no step further), and a cancellation or a
client that goes away never leaves a token in the history that was neither streamed nor journaled."""

from __future__ import annotations

import asyncio
from pathlib import Path

from inference_engine.config import ServerConfig
from inference_engine.domain import CreateParams, DoneEvent, GenerateParams, TokenEvent
from inference_engine.journal import open_journal
from inference_engine.metrics import Metrics
from inference_engine.model_dir_info import ModelDirInfo
from inference_engine.runtime import Runtime

PROMPT = (5, 17, 42, 9, 63)


def _runtime(verifier, model_dir: Path, backend: str, **overrides) -> Runtime:
    config = ServerConfig(**{"proposer": "none", "backend": backend, "decode_burst_tokens": 1, **overrides})
    return Runtime(verifier, config, Metrics(), model_dir_info=ModelDirInfo.read(model_dir))


def test_the_next_step_runs_while_the_consumer_streams_and_no_step_further(verifiers, verifier_pool, backend):
    runtime = _runtime(verifiers["qwen3"], verifier_pool.model_dir(backend, "qwen3"), backend)

    async def run() -> tuple[list[int], list[int], DoneEvent]:
        session_id, _ = await runtime.create_session(CreateParams(initial_token_ids=PROMPT, no_default_eos=True))
        history_after_pause, tokens, done = [], [], None
        async for event in runtime.generate(session_id, GenerateParams(max_tokens=6)):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                await asyncio.sleep(0.2)  # a slow client: the engine has all the time it needs meanwhile
                history_after_pause.append(runtime.session_info(session_id).history_length - len(PROMPT))
            elif isinstance(event, DoneEvent):
                done = event
        assert done is not None
        return history_after_pause, tokens, done

    try:
        history_after_pause, tokens, done = asyncio.run(run())
    finally:
        runtime.shutdown()
    # While the client holds token k, the step of token k + 1 runs (one step per token: the prompt fits one
    # forward), and no step after it: the history is one step ahead of the stream at most.
    assert history_after_pause == [2, 3, 4, 5, 6, 6]
    assert len(tokens) == done.stats.generated_token_count == 6


def test_a_cancelled_generation_streams_every_token_its_history_gained(verifiers, verifier_pool, backend):
    runtime = _runtime(verifiers["qwen3"], verifier_pool.model_dir(backend, "qwen3"), backend)

    async def run() -> tuple[list[int], DoneEvent, list[int]]:
        session_id, _ = await runtime.create_session(CreateParams(initial_token_ids=PROMPT, no_default_eos=True))
        cancel = asyncio.Event()
        tokens, done = [], None
        async for event in runtime.generate(session_id, GenerateParams(max_tokens=200), cancel):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                if len(tokens) == 3:
                    cancel.set()  # the 4th step is queued (or already in a forward) by now
            elif isinstance(event, DoneEvent):
                done = event
        assert done is not None
        history = runtime.session_info(session_id, history_tail_tokens=1000).history_tail
        return tokens, done, list(history)

    try:
        tokens, done, history = asyncio.run(run())
    finally:
        runtime.shutdown()
    assert done.stats.stop_reason.value == "cancelled"
    assert 3 <= len(tokens) <= 4 and done.stats.generated_token_count == len(tokens)
    assert history == [*PROMPT, *tokens], "the history holds exactly the prompt and the streamed tokens"


def test_a_client_that_goes_away_mid_stream_leaves_every_history_token_journaled(
    verifiers, verifier_pool, backend, tmp_path
):
    runtime = _runtime(verifiers["qwen3"], verifier_pool.model_dir(backend, "qwen3"), backend)
    opened = open_journal(tmp_path, runtime.journal_identity(), sync="normal", recovery="refuse")
    runtime.attach_journal(opened.journal)

    async def run() -> tuple[str, list[int], list[int]]:
        session_id, _ = await runtime.create_session(CreateParams(initial_token_ids=PROMPT, no_default_eos=True))
        events = runtime.generate(session_id, GenerateParams(max_tokens=200))
        streamed: list[int] = []
        async for event in events:
            if isinstance(event, TokenEvent):
                streamed.append(event.token_id)
                if len(streamed) == 6:
                    break  # the client goes away with a step under way (queued or chained by the worker)
        await events.aclose()
        history = runtime.session_info(session_id, history_tail_tokens=1000).history_tail
        return session_id, streamed, list(history)

    try:
        session_id, streamed, history = asyncio.run(run())
    finally:
        runtime.shutdown()
        opened.journal.close()
    journaled = {
        r.header.session_id: r.tokens
        for r in open_journal(tmp_path, runtime.journal_identity(), sync="normal", recovery="refuse").records
    }
    assert history[: len(PROMPT) + len(streamed)] == [*PROMPT, *streamed]
    assert len(history) <= len(PROMPT) + len(streamed) + 1, "at most the step under way ran past the stream"
    assert journaled[session_id] == history, "the journal holds exactly the history"
