"""What the sync and asyncio conversations share: command ids, the requests sent, the unfinished generation, the
checks on every reply and how a conversation fails. `Conversation` and `AsyncConversation` add reading and locking."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kakeya._generated import runtime_pb2 as pb
from kakeya._stream import Tally, TokensSoFar
from kakeya.errors import DeadlineExceeded, InvalidArgument, KakeyaError, ProtocolError

if TYPE_CHECKING:
    from kakeya._core import SessionCore

SessionT = TypeVar("SessionT", bound="SessionCore[Any, Any, Any]")
ConversationT = TypeVar("ConversationT", bound="ConversationCore[Any]")


@dataclass(eq=False)
class ConverseGeneration:
    """State of one generate command of a conversation."""

    command_id: int
    tally: Tally = field(default_factory=Tally)
    cancel_sent: bool = False
    finished: bool = False


class Outbox(Protocol):
    """The queue a conversation's request stream is read from; None ends the stream."""

    def put_nowait(self, item: pb.ConverseRequest | None, /) -> None: ...


class ConversationCore(Generic[SessionT]):
    """The state of one `Converse` stream and everything about it that does not wait."""

    def __init__(self, session: SessionT, outbox: Outbox, inter_token_timeout_s: float | None) -> None:
        self.session = session
        self._outbox = outbox
        self._call: Any = None  # the Converse call, once the stream is open
        self._token_timeout_s = inter_token_timeout_s
        self._reply_timeout_s: float | None = session.client.timeout_s
        self._ids = itertools.count(1)
        self._generation: ConverseGeneration | None = None
        self._failure: KakeyaError | None = None
        self._closed = False
        self.history_length = 0
        """History length as of the latest bind or append."""

    def request_cancel(self, generation: ConverseGeneration) -> None:
        """Send a cancel command for `generation` (once; not after the conversation has failed)."""
        if generation.cancel_sent or generation.finished or self._failure is not None:
            return
        generation.cancel_sent = True
        self._outbox.put_nowait(pb.ConverseRequest(command_id=next(self._ids), cancel=pb.CancelCommand()))

    def _stopping(self, generation: ConverseGeneration) -> bool:
        """Cancel `generation` unless it or the conversation has ended; whether its last events are still to read."""
        if generation.finished or self._failure is not None or self._closed:
            return False
        self.request_cancel(generation)
        return True

    def _cancel_unfinished(self) -> ConverseGeneration | None:
        """Cancel the unfinished generation, if any, and return it (its last events are still to read)."""
        generation = self._generation
        if generation is not None:
            self.request_cancel(generation)
        return generation

    def _send(self, **command: Any) -> int:
        """Send one command; returns its id."""
        if self._failure is not None:
            raise self._ended()
        if self._closed:
            raise InvalidArgument("the conversation is closed")
        if self._call is None:
            raise InvalidArgument("the conversation is not open")
        command_id = next(self._ids)
        self._outbox.put_nowait(pb.ConverseRequest(command_id=command_id, **command))
        return command_id

    def _begin(self, fields: dict[str, object]) -> ConverseGeneration:
        """Send a generate command with `fields`; its generation becomes the unfinished one."""
        generation = ConverseGeneration(self._send(generate=pb.GenerateCommand(**fields)))  # type: ignore[arg-type]
        self._generation = generation
        self.session.last_generation = None
        return generation

    def _feed(self, generation: ConverseGeneration, reply: Any) -> int | None:
        """Record one event of `generation`; returns its token, or None (after the final event it has ended)."""
        token = generation.tally.feed(reply.WhichOneof("event"), reply)
        if token is None and generation.tally.stats is not None:
            generation.finished = True
            self._generation = None
            self.session.last_generation = generation.tally.stats
        return token

    def _checked(self, reply: Any, command_id: int) -> Any:
        """`reply`, which must answer command `command_id`."""
        if reply.command_id != command_id:
            raise ProtocolError(f"expected an event for command {command_id}, got {reply}")
        return reply

    @staticmethod
    def _expect(reply: Any, expected: str) -> Any:
        if reply.WhichOneof("event") != expected:
            raise ProtocolError(f"expected a {expected!r} event, got {reply}")
        return reply

    def _ended(self) -> KakeyaError:
        """The error that ended the conversation, restated for a later command."""
        assert self._failure is not None
        return type(self._failure)(f"the conversation has ended: {self._failure.message}", status=self._failure.status)

    def _fail(self, error: KakeyaError) -> KakeyaError:
        """Record why the conversation ended and stop its call; returns `error`."""
        self._failure = error
        self._stop_call()
        return error

    def _stalled(self, timeout_s: float | None, error: type[DeadlineExceeded]) -> KakeyaError:
        return self._fail(error(f"no event within {timeout_s} s; the conversation was cancelled"))

    def _cut_off(self) -> KakeyaError:
        return self._fail(ProtocolError("the server ended the Converse stream"))

    def _stop_call(self) -> None:
        """End the request stream and cancel the call (a no-op on a call that has ended)."""
        self._outbox.put_nowait(None)
        self._call.cancel()


class ConverseStreamCore(TokensSoFar, Generic[ConversationT]):
    """The token stream of one generate command, less the reading."""

    def __init__(self, conversation: ConversationT, generation: ConverseGeneration) -> None:
        self.conversation = conversation
        self._generation = generation
        self._tally = generation.tally

    def __del__(self) -> None:
        if hasattr(self, "_generation") and not self._generation.finished:
            with contextlib.suppress(Exception):  # at shutdown the channel or the event loop is already gone
                self.conversation.request_cancel(self._generation)
