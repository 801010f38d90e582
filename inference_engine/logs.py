"""Structured logging (text or JSON lines) with a per-request id."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import re
import sys
import time
from typing import TextIO

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname:<7} {record.name} [{request_id.get()}] {record.getMessage()}"
        if fields:
            line += " " + fields
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": request_id.get(),
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class JsonLinesStream(io.TextIOBase):
    """Stands in for `sys.stderr` under `--log-format json`: whatever libraries print there (progress bars,
    warnings, stray newlines) becomes one JSON log line per non-blank line, so the stream stays parseable."""

    def __init__(self, target: TextIO, logger_name: str = "stderr") -> None:
        self._target = target
        self._logger_name = logger_name
        self._pending = ""

    @property
    def target(self) -> TextIO:
        """The stream the JSON lines go to."""
        return self._target

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        # A progress bar redraws with carriage returns: each redraw is a line of its own.
        *lines, self._pending = re.split(r"[\r\n]", self._pending)
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:
        return self._target.fileno()

    def isatty(self) -> bool:
        return False  # progress bars then print plain lines instead of terminal animations

    def _emit(self, line: str) -> None:
        text = line.strip()
        if not text:
            return
        payload = {
            "ts": round(time.time(), 6),
            "level": "info",
            "logger": self._logger_name,
            "request_id": request_id.get(),
            "msg": text,
        }
        self._target.write(json.dumps(payload) + "\n")
        self._target.flush()


def configure_logging(fmt: str, level: str) -> None:
    """Send every log record to stderr as text or JSON lines. Under JSON, library output on stderr (the weights
    progress bar, Python warnings) is wrapped into JSON lines too."""
    stream: TextIO = sys.stderr
    if isinstance(stream, JsonLinesStream):
        stream = stream.target
    if fmt == "json":
        sys.stderr = JsonLinesStream(stream)
        logging.captureWarnings(True)
    else:
        sys.stderr = stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn (the HTTP shim) announces its start and stop at info level, which the daemon's own lines already do
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, root.level))
