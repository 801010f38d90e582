"""Session K/V kept under `--state-dir` beside the journal, so a restarted daemon reads a session's K/V back instead
of prefilling its whole history again.

When a generation ends, before its Done is sent, the K/V of the positions its session committed since the last write
are written as one chunk file (`kv/<session>/<first position>.npz`: the positions' token ids and every layer's keys
and values, as float32, or as the bit patterns of their bfloat16 values where the session holds them so), to a
temporary name then renamed, so a killed process leaves whole chunks only; a generation
that ends without Done (cancelled, failed) writes when its session parks. After a restart a session's first
generation reads its chunks back in order, as far as their token ids agree with the journaled history, and prefills
only what follows. A session whose chunks are missing, damaged or from another model prefills as before: the chunks
are a cache of the journal, never a source of tokens.

Only sessions whose state is the verifier's resident K/V and nothing else are kept: the `full` strategy, no KV
compressor, a draft session that keeps no per-position features (the `none`, `ngram` and `draft_model` proposers),
and not a single-shot session (an HTTP shim request), which ends with its request.

The files together stay within `max_bytes` (`--state-kv-max-bytes`): a write that would pass it first removes the
files of the sessions written least recently (their next write starts again from their first position, and until
then a restart prefills them), and a session that alone would pass it writes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterable
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np

from inference_engine.sessions import Session
from kv_cache_proposer.cache.session import KVSessionCache
from kv_cache_proposer.sequence import shared_prefix
from kv_cache_proposer.verifier import Verifier

log = logging.getLogger(__name__)

KV_DIR = "kv"
_IDENTITY = "identity.json"
_CHUNK = re.compile(r"^(\d{12})\.npz$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_FILE_OVERHEAD = 1024  # more than the bytes of a chunk file's zip and array headers


class DurableKV:
    """The K/V files of this daemon's sessions under `root` (`<state-dir>/kv`)."""

    def __init__(self, root: Path, verifier: Verifier[Any], identity: dict[str, Any], *, max_bytes: int = 0) -> None:
        self.root = root
        self.verifier = verifier
        self.max_bytes = max_bytes  # 0: no bound
        self._saved: dict[str, int] = {}  # positions on disk per session, all of them this session's
        self._restored: set[str] = set()  # sessions brought back from the journal whose chunks are not read yet
        # Bytes on disk per session, the least recently written first; the engine thread writes and the event loop
        # forgets, so both go through the lock.
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._adopt(identity)

    # -- which sessions ------------------------------------------------------------------------------------------
    @staticmethod
    def keeps(session: Session) -> bool:
        """Whether `session`'s state is its verifier cache's resident K/V alone (what the files hold)."""
        cache = session.seq.cache
        return (
            isinstance(cache, KVSessionCache)
            and cache.strategy.name == "full"
            and session.compressor.label == "none"
            and not session.seq.draft_session.feature_layers
            and not session.single_shot
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of every session's files."""
        with self._lock:
            return sum(self._bytes.values())

    def awaits(self, session_id: str) -> bool:
        """Whether the session came back from the journal and has not read its files back yet."""
        return session_id in self._restored

    def restored(self, session_ids: Iterable[str]) -> None:
        """These sessions came back from the journal: their first generation reads their chunks (`load`)."""
        self._restored.update(session_ids)

    def sweep(self, live: Iterable[str]) -> None:
        """Remove the files of sessions the journal no longer holds (ended while the files were being written)."""
        keep = {_dir_name(session_id): session_id for session_id in live}
        found = []
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_dir():
                found.append((entry.stat().st_mtime, keep[entry.name]))
        for _, session_id in sorted(found):  # the least recently written first
            self._measure(session_id)
        self._fit(0, keeping=None)

    # -- the engine thread ---------------------------------------------------------------------------------------
    def save(self, session: Session) -> int:
        """Write the K/V of the positions `session` committed since its last save; returns how many. Runs on the
        engine thread between steps, while the session holds its turn."""
        if session.closed or not self.keeps(session):
            return 0
        seq, cache = session.seq, session.seq.cache
        assert isinstance(cache, KVSessionCache)
        start, end = self._saved.get(session.session_id, 0), seq.committed
        if end <= start:
            return 0
        if not self._room_for(session.session_id, (end - start) * _position_bytes(cache, start) + _FILE_OVERHEAD):
            return 0
        positions = np.arange(start, end, dtype=np.int64)
        ops = cache.ops
        keys, values = [], []
        for layer in range(cache.num_layers):
            k, v = cache.positions_kv(layer, positions)  # [1, H, n, D] x2
            keys.append(ops.to_host(k)[0])
            values.append(ops.to_host(v)[0])
        directory = self.root / _dir_name(session.session_id)
        scratch = directory / f".{start:012d}.partial"
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            with open(scratch, "wb") as out:
                tokens = np.asarray(seq.tokens[start:end], dtype=np.int64)
                np.savez(out, tokens=tokens, keys=_compact(np.stack(keys)), values=_compact(np.stack(values)))
            os.replace(scratch, directory / f"{start:012d}.npz")
            written = (directory / f"{start:012d}.npz").stat().st_size
        except OSError as exc:  # a full disk, or the session closed meanwhile: a restart prefills these positions
            log.warning("K/V file not written", extra={"session_id": session.session_id, "error": str(exc)})
            scratch.unlink(missing_ok=True)
            return 0
        if session.closed:  # it ended while this was written, and its files were removed meanwhile
            self.forget(session.session_id)
            return 0
        self._saved[session.session_id] = end
        with self._lock:
            self._bytes[session.session_id] = self._bytes.pop(session.session_id, 0) + written  # now the latest
        return end - start

    def load(self, session: Session) -> int:
        """Before the first generation of a session restored from the journal: read back the K/V of as many of its
        positions as its chunks hold and agree with its history, leaving at least its last token pending; returns
        how many positions it now holds. Runs on the engine thread."""
        session_id = session.session_id
        if session_id not in self._restored:
            return 0
        self._restored.discard(session_id)
        seq = session.seq
        if seq.committed or not self.keeps(session):
            self.forget(session_id)
            return 0
        usable = len(seq.tokens) - 1
        directory = self.root / _dir_name(session_id)
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        loaded = whole = 0  # positions read back; the end of the chunks read back whole
        for start, path in _chunks(directory):
            if start != loaded or loaded >= usable:
                break
            try:
                with np.load(path, allow_pickle=False) as chunk:
                    tokens, keys, values = chunk["tokens"], _expanded(chunk["keys"]), _expanded(chunk["values"])
            except (OSError, ValueError, KeyError) as exc:
                log.warning("a K/V file cannot be read", extra={"session_id": session_id, "error": str(exc)})
                break
            agree = shared_prefix(tokens, seq.tokens[start:usable])
            if agree == 0 or keys.shape != values.shape or keys.shape[2] != len(tokens):
                break
            parts.append((keys[:, :, :agree], values[:, :, :agree]))
            loaded += agree
            if agree < len(tokens):
                break
            whole = loaded
        # Chunks past the last whole one go; the next save writes those positions again from the cache.
        self._discard_from(session_id, whole)
        if not loaded:
            return 0
        cache = seq.cache
        assert isinstance(cache, KVSessionCache)
        state = []
        for layer in range(cache.num_layers):
            k = np.concatenate([keys[layer] for keys, _ in parts], axis=1)[None]  # [1, H, n, D]
            v = np.concatenate([values[layer] for _, values in parts], axis=1)[None]
            state.append((self.verifier.kv_from_host(k), self.verifier.kv_from_host(v)))
        cache.load_resident(state, np.arange(loaded, dtype=np.int64))
        seq.committed = loaded
        return loaded

    def forget(self, session_id: str) -> None:
        """The session ended: remove its files."""
        self._saved.pop(session_id, None)
        self._restored.discard(session_id)
        with self._lock:
            self._bytes.pop(session_id, None)
        shutil.rmtree(self.root / _dir_name(session_id), ignore_errors=True)

    # -- internals -----------------------------------------------------------------------------------------------
    def _discard_from(self, session_id: str, keep_until: int) -> None:
        """Remove the chunks that start at or after `keep_until`; the ones before it stay this session's."""
        directory = self.root / _dir_name(session_id)
        for start, path in _chunks(directory):
            if start >= keep_until:
                path.unlink(missing_ok=True)
        for stray in directory.glob(".*.partial") if directory.is_dir() else ():
            stray.unlink(missing_ok=True)
        self._saved[session_id] = keep_until
        self._measure(session_id)

    def _room_for(self, session_id: str, incoming: int) -> bool:
        """Make room under `max_bytes` for `incoming` more bytes of this session's files, removing other sessions'
        files, the least recently written first; False (and this session's files removed) when it alone would pass
        the bound."""
        if not self.max_bytes:
            return True
        with self._lock:
            own = self._bytes.get(session_id, 0)
        if own + incoming > self.max_bytes:
            log.info(
                "K/V files not written: the session alone would pass --state-kv-max-bytes; a restart prefills it",
                extra={"session_id": session_id, "bytes": own + incoming, "max_bytes": self.max_bytes},
            )
            self.forget(session_id)
            return False
        self._fit(incoming, keeping=session_id)
        return True

    def _fit(self, incoming: int, *, keeping: str | None) -> None:
        """Remove whole sessions' files, the least recently written first (never `keeping`'s), until `incoming`
        more bytes fit under `max_bytes`."""
        if not self.max_bytes:
            return
        while True:
            with self._lock:
                if sum(self._bytes.values()) + incoming <= self.max_bytes:
                    return
                oldest = next((sid for sid in self._bytes if sid != keeping), None)
            if oldest is None:
                return
            log.info(
                "K/V files removed to stay within --state-kv-max-bytes; the session writes them again when it "
                "next generates, and a restart before that prefills it",
                extra={"session_id": oldest, "max_bytes": self.max_bytes},
            )
            self.forget(oldest)

    def _measure(self, session_id: str) -> None:
        """Count the bytes of the session's files as they are on disk."""
        size = sum(path.stat().st_size for _, path in _chunks(self.root / _dir_name(session_id)))
        with self._lock:
            if size:
                self._bytes[session_id] = size
            else:
                self._bytes.pop(session_id, None)

    def _adopt(self, identity: dict[str, Any]) -> None:
        """Keep the files written for this model, dtype and backend; remove any others."""
        path = self.root / _IDENTITY
        wanted = json.dumps(identity, sort_keys=True)
        try:
            found = path.read_text()
        except OSError:
            found = None
        if found == wanted:
            return
        if found is not None:
            log.warning(
                "K/V files of another model removed; those sessions prefill again", extra={"dir": str(self.root)}
            )
        for entry in self.root.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        scratch = path.with_suffix(".partial")
        scratch.write_text(wanted)
        os.replace(scratch, path)


def _position_bytes(cache: KVSessionCache[Any], position: int) -> int:
    """Bytes one position takes in a file, at most: its token id, and its keys and values in every layer in the
    dtype the cache holds them (float32 or bfloat16)."""
    keys, _ = cache.positions_kv(0, np.array([position], dtype=np.int64))  # [1, H, 1, D]
    return 8 + cache.num_layers * 2 * cache.ops.nbytes(keys)


def _compact(kv: np.ndarray) -> np.ndarray:
    """Float32 K/V `[L, H, n, D]` as the upper halves of their bit patterns (uint16) where the lower halves are all
    zero, as K/V held at bfloat16 give them (half the bytes, nothing lost); else as they are."""
    halves = kv.view("<u2").reshape(*kv.shape, 2)  # little-endian float32 bits: [lower, upper]
    return kv if halves[..., 0].any() else np.ascontiguousarray(halves[..., 1])


def _expanded(stored: np.ndarray) -> np.ndarray:
    """What `_compact` was given."""
    if stored.dtype == np.uint16:
        halves = np.zeros((*stored.shape, 2), dtype="<u2")
        halves[..., 1] = stored
        return halves.view("<f4").reshape(stored.shape)
    if stored.dtype != np.float32:
        raise ValueError(f"K/V stored as {stored.dtype}")
    return stored


def _dir_name(session_id: str) -> str:
    """A file name for a session id (ids a client chose may hold any character)."""
    if _SAFE_ID.match(session_id):
        return session_id
    return "h-" + sha256(session_id.encode()).hexdigest()[:40]


def _chunks(directory: Path) -> list[tuple[int, Path]]:
    """The chunk files of one session, by first position."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _CHUNK.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)
