"""What one client may cost the server before its request reaches the handlers.

- `BodyGuard`, ASGI middleware inside the app (so every ASGI host gets it): it reads the request body
  before the app sees it, at most `max_body_bytes` (413: a declared Content-Length over the limit is
  refused before a byte is parsed, a chunked body is counted as it arrives), within `body_timeout_s`
  of the headers (408), and logs a client that hangs up mid-body as one line. A refused body is read
  and dropped (up to `DRAIN_LIMIT` bytes, within the same timeout), never kept, so the client, still
  sending, gets to read its answer instead of a reset connection.
- `guarded_protocol(header_timeout_s)`, uvicorn's h11 protocol with a header timeout: a request's headers
  must arrive within `header_timeout_s` of its first byte (or of the connection opening), else the
  connection is closed (with a 408 when part of a request came). Idle keep-alive connections close after
  uvicorn's `timeout_keep_alive`. h11 also frames a stream to an HTTP/1.0 client by closing the
  connection (1.0 has no chunked encoding; uvicorn's httptools protocol would send it chunked), and a
  malformed request is answered in OpenAI's error body.
- `uvicorn_config(app, config)`: the uvicorn settings `specmoe serve` runs with.

Every refusal is an OpenAI error body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time

from specmoe.serve.protocol import OpenAIError

log = logging.getLogger("specmoe.serve")

DRAIN_LIMIT = 64 * 2**20  # bytes of a refused body read and dropped before the connection is just closed


def error_bytes(e: OpenAIError) -> bytes:
    return json.dumps(e.body()).encode()


async def send_error(send, e: OpenAIError, *, close: bool) -> None:
    body = error_bytes(e)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in e.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Disconnected(Exception):
    pass


class BodyGuard:
    """ASGI middleware: the request body, bounded in size and time, read before the app runs (see the
    module's docstring). `on_reject(status)` counts each refusal (the server's metrics)."""

    def __init__(self, app, *, max_body_bytes: int, body_timeout_s: float, on_reject=None):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.on_reject = on_reject or (lambda status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        deadline = time.monotonic() + self.body_timeout_s
        declared = headers.get(b"content-length")
        try:
            declared = None if declared is None else int(declared)
        except ValueError:
            return await self._refuse(send, OpenAIError(400, f"bad Content-Length header {declared[:40]!r}"),
                                      close=True)
        limit = self.max_body_bytes
        if declared is not None and declared > limit:
            if headers.get(b"expect", b"").lower() == b"100-continue":  # the client waits: it sends nothing more
                return await self._refuse(send, self._too_large(declared), close=True)
            return await self._drain_and_refuse(scope, receive, send, 0, deadline, self._too_large(declared))
        chunks, size = [], 0
        try:
            while True:
                msg = await self._receive(receive, deadline)
                if msg["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    chunks.clear()
                    return await self._drain_and_refuse(scope, receive, send, size, deadline,
                                                        self._too_large(None, size))
                if chunk:
                    chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
        except _Disconnected:
            self._log_disconnect(scope, size, declared)
            return
        except asyncio.TimeoutError:
            return await self._refuse(send, self._timeout(size, declared), close=True)
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _receive(self, receive, deadline: float):
        left = deadline - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(receive(), left)

    async def _drain_and_refuse(self, scope, receive, send, size: int, deadline: float, e: OpenAIError):
        """Read the rest of a refused body and drop it (at most DRAIN_LIMIT bytes, until the deadline), then
        answer `e`; the connection closes unless the whole body was read."""
        done = False
        try:
            while size <= DRAIN_LIMIT:
                msg = await self._receive(receive, deadline)
                if msg["type"] == "http.disconnect":
                    self._log_disconnect(scope, size, None)
                    return
                size += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    done = True
                    break
        except asyncio.TimeoutError:
            pass
        await self._refuse(send, e, close=not done)

    async def _refuse(self, send, e: OpenAIError, *, close: bool):
        self.on_reject(e.status)
        await send_error(send, e, close=close)

    def _too_large(self, declared: int | None, seen: int | None = None) -> OpenAIError:
        what = f"is {declared} bytes" if declared is not None else f"ran past {seen} bytes"
        return OpenAIError(413, f"the request body {what}; this server accepts at most {self.max_body_bytes} "
                                "(max_body_bytes, `specmoe serve --max-body-size`)", code="request_too_large")

    def _timeout(self, size: int, declared: int | None) -> OpenAIError:
        of = f" of {declared}" if declared is not None else ""
        return OpenAIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s of its headers "
                                f"({size}{of} bytes came; `specmoe serve --body-timeout`)", type="timeout_error",
                           code="request_timeout")

    @staticmethod
    def _log_disconnect(scope, size: int, declared: int | None) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "a client"
        of = f" of {declared}" if declared is not None else ""
        log.warning("%s disconnected while sending %s %s (%d%s body bytes came)", who, scope.get("method"),
                    scope.get("path"), size, of)


def guarded_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol class with a header timeout (see the module's docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # its headers are in: the body guard takes over
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # part of a request came: say why the connection closes
                body = error_bytes(OpenAIError(
                    408, f"the request's headers did not arrive within {header_timeout_s:g} s "
                         "(`specmoe serve --header-timeout`)", type="timeout_error", code="request_timeout"))
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = error_bytes(OpenAIError(400, f"{msg} (a malformed request, or headers over "
                                                f"{self.conn._max_incomplete_event_size} bytes)"))
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
                pass
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, config, *, log_level: str = "info", **kw):
    """The uvicorn.Config `specmoe serve` runs `app` with: the guarded h11 protocol, the keep-alive timeout,
    and the `specmoe` loggers printed like uvicorn's own."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG
    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["loggers"]["specmoe"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return uvicorn.Config(app, **{"host": config.host, "port": config.port, "log_level": log_level,
                                  "http": guarded_protocol(config.header_timeout_s),
                                  "timeout_keep_alive": config.keep_alive_timeout_s, "log_config": log_config, **kw})
