"""The data path between the router and a card: framed pickles over a TCP connection per generation.

Ray places, watches and restarts the cards; the tokens they make travel on this link instead of Ray's
object stream, which costs about a millisecond per item and per call. The link is plain TCP rather than
gRPC: a gRPC call's first item took three times as long as a frame on a kept connection
(docs/benchmarks.md, session 30), and the link needs none of what gRPC adds (it is internal, one method,
the same code on both ends).

Each card listens on one port of its node (`LinkServer`, in the actor's event loop); the router keeps the
connections to a card incarnation that finished a generation cleanly and reuses them (`CardLink`). A
connection opens with the card's token (`HELLO`), then carries one generation at a time: a `REQUEST`
frame, the card's `ITEM` frames and an `END`, or a `FAILED` naming the card's error, after which both
ends close it. The router cancels a generation by closing its connection; the card watches for that and
stops the engine at the next token boundary. The messages are pickled engine objects (`GenerateRequest`
in, `TokenChunk` / `Finished` / `CardError` / `PrefixReport` out), so the link trusts its peer as Ray
does: each card draws a random token per incarnation, hands it to the router over Ray with its identity,
and unpickles nothing from a connection that did not present it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from .wire import KEEPALIVE_TIME_MS, MAX_MESSAGE_BYTES

# Frame kinds. Router to card: HELLO (the token, first on every connection), REQUEST (a pickled request).
# Card to router: ITEM (a pickled item), END (the generation is done; the connection takes another), FAILED
# (UTF-8 text naming what failed on the card; the card closes the connection).
HELLO, REQUEST, ITEM, END, FAILED = range(5)
_HEADER = struct.Struct("!IB")  # body length, kind
_KEEPALIVE_PROBES = 4  # unanswered probes, KEEPALIVE_TIME_MS / 4 apart, before a quiet peer is dropped
FAIL_LINGER_S = 2.0  # how long a card that sent FAILED waits for the router to close the connection
END_WAIT_S = 5.0  # how long a finished call's END may take before its connection is closed instead of kept
MAX_IDLE_CONNECTIONS = 4
HELLO_LIMIT = 1024  # bytes: a caller must show the token before the card reads more of what it sends  # kept per card: one generation runs at a time, a few may be ending

Items = Callable[[Any], AsyncIterator[object]]


def new_token() -> str:
    return secrets.token_urlsafe(24)


class LinkLost(Exception):
    """The card went away under the call (its process died, its node left): the card is down."""


class LinkFailed(Exception):
    """The card answered the call with an error of its own (a bug on the card, or a wrong token)."""


class _ProtocolError(Exception):
    """The peer sent something the link does not speak: a frame of the wrong kind or size."""


async def _read_frame(
    reader: asyncio.StreamReader, read: bytes = b"", limit: int = MAX_MESSAGE_BYTES
) -> tuple[int, bytes]:
    """The next frame's (kind, body), of which `read` was read already; IncompleteReadError at the end of
    the stream, _ProtocolError for a body over `limit` bytes (not read)."""
    length, kind = _HEADER.unpack(read + await reader.readexactly(_HEADER.size - len(read)))
    if length > limit:
        raise _ProtocolError(f"a frame of {length} bytes, over the link's {limit}")
    return kind, await reader.readexactly(length)


def _frame(kind: int, body: bytes = b"") -> bytes:
    if len(body) > MAX_MESSAGE_BYTES:
        raise _ProtocolError(f"a frame of {len(body)} bytes, over the link's {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body), kind) + body


def _tune(writer: asyncio.StreamWriter) -> None:
    """Every frame leaves at once (TCP_NODELAY: asyncio sets it only on sockets made for IPPROTO_TCP, and
    Nagle's wait behind delayed acknowledgements holds a token 20-40 ms on a warm connection), and TCP
    keepalive, so that a peer that vanished without a reset (a node powered off) is noticed on a quiet
    connection (a long prefill) within about twice KEEPALIVE_TIME_MS."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval_s = max(KEEPALIVE_TIME_MS // 1000 // _KEEPALIVE_PROBES, 1)
    for name, value in (
        ("TCP_KEEPIDLE", max(KEEPALIVE_TIME_MS // 1000, 1)),
        ("TCP_KEEPINTVL", interval_s),
        ("TCP_KEEPCNT", _KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LinkServer:
    """The card's end: serves `items(request)` for every request on an authenticated connection."""

    def __init__(self, host: str, token: str, items: Items) -> None:
        self.token = token
        self._token = token.encode()
        self._items = items
        # Bound now, so that the endpoint is known before the card reports it; served from `start`.
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host.strip("[]"), 0))
        self._socket.listen(64)
        self.endpoint = f"{_bracketed(host)}:{self._socket.getsockname()[1]}"
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._socket)

    async def stop(self) -> None:
        """Stop listening and close every connection (their generations stop)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        _tune(writer)
        try:
            kind, body = await _read_frame(reader, limit=HELLO_LIMIT)
            if kind != HELLO or not hmac.compare_digest(body, self._token):
                await _fail(reader, writer, "the card link's token is missing or wrong")
                return
            read = b""
            while True:
                kind, body = await _read_frame(reader, read)
                if kind != REQUEST:
                    raise _ProtocolError(f"a frame of kind {kind} where a request was due")
                outcome = await self._generation(body, reader, writer)
                if outcome is None:
                    return
                read = outcome
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router closed the connection
        except _ProtocolError as e:
            await _fail(reader, writer, f"link protocol: {e}")
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _generation(
        self, payload: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """Stream one request's items. When it ended cleanly, the bytes of the next frame already read
        (the connection takes another request); None when the router went away (the generation is
        stopped) or the card failed (reported)."""
        sending = asyncio.ensure_future(self._send(payload, writer))
        # Nothing is due from the router while the card sends: anything, the end of the stream included,
        # means the router is done with this generation, unless it is the next request sent after the END.
        router_done = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({sending, router_done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, router_done):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task  # the items' generator ran its `finally`: the engine stops
        if sending.cancelled() or isinstance(sending.exception(), ConnectionError):
            return None
        if (error := sending.exception()) is not None:
            # A bug on the card (or the router): the router answers INTERNAL naming it.
            await _fail(reader, writer, f"{type(error).__name__}: {error}")
            return None
        if router_done.cancelled():
            return b""
        return router_done.result() or None  # the next request's first byte, or the end of the stream

    async def _send(self, payload: bytes, writer: asyncio.StreamWriter) -> None:
        items: AsyncIterator[object] | None = None
        try:
            request = pickle.loads(payload)
            items = self._items(request)
            async for item in items:
                writer.write(_frame(ITEM, pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)))
                await writer.drain()
            writer.write(_frame(END))
            await writer.drain()
        finally:
            if items is not None:
                await items.aclose()  # type: ignore[attr-defined]


async def _fail(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: str) -> None:
    """Send FAILED and half-close, then wait (briefly) for the router to close: a socket closed with bytes
    of its peer unread sends a reset, which can discard the FAILED frame before the router reads it."""
    with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
        writer.write(_frame(FAILED, message.encode()))
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()
        await asyncio.wait_for(_discard(reader), FAIL_LINGER_S)


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


class LinkCall:
    """One generation's stream from a card; `cancel` ends it on both sides (the card stops the engine at
    the next token boundary)."""

    def __init__(self, link: CardLink, payload: bytes) -> None:
        self._link = link
        self._answered = False  # a frame came back: the card has the request
        self._done = False
        self._reused = False
        self._opened: asyncio.Future[_Connection] = asyncio.get_running_loop().create_future()
        self._opened.add_done_callback(_retrieved)
        try:
            self._request = _frame(REQUEST, payload)
        except _ProtocolError as e:  # `next` answers it as LinkFailed, as it does the card's errors
            self._opened.set_exception(e)
            return
        reused = link._take_idle()
        if reused is None:
            self._opened = self._open()
        else:  # on its way now, before the caller's next await (the router's reply to its client)
            reused.writer.write(self._request)
            self._reused = True
            self._opened.set_result(reused)

    def _open(self) -> asyncio.Future[_Connection]:
        opened = asyncio.ensure_future(self._send())
        opened.add_done_callback(_retrieved)
        return opened

    async def _send(self) -> _Connection:
        connection = await self._link._connect()
        try:
            connection.writer.write(self._request)
            await connection.writer.drain()
        except BaseException:
            connection.close()
            raise
        return connection

    async def next(self) -> object:
        """The next item; StopAsyncIteration at the end, LinkLost or LinkFailed on an error."""
        if self._done:
            raise StopAsyncIteration
        try:
            kind, body = await self._read()
        except (OSError, asyncio.IncompleteReadError) as e:
            self.cancel()
            raise LinkLost(f"the card's link at {self._link.endpoint} is gone: {_describe(e)}") from e
        except _ProtocolError as e:
            self.cancel()
            raise LinkFailed(f"link protocol: {e}") from e
        if kind == ITEM:
            return pickle.loads(body)
        if kind == END:
            self._done = True
            self._link._give_back(self._opened.result())
            raise StopAsyncIteration
        self.cancel()
        if kind == FAILED:
            raise LinkFailed(body.decode(errors="replace"))
        raise LinkFailed(f"link protocol: a frame of kind {kind} from the card")

    async def _read(self) -> tuple[int, bytes]:
        """The next frame. A reused connection found closed before the card answered on it (its card
        closed it while idle) is replaced by a new one, the request sent again."""
        try:
            connection = await self._opened
            frame = await _read_frame(connection.reader)
        except (OSError, asyncio.IncompleteReadError):
            if self._answered or not self._reused:
                raise
            self._close_connection()
            self._reused = False
            self._opened = self._open()
            connection = await self._opened
            frame = await _read_frame(connection.reader)
        self._answered = True
        return frame

    def end(self) -> None:
        """The caller has every item it wants (the final one came): the card's END is read in the
        background and the connection kept for the next call. Should another frame come instead, the
        connection closes, which stops the card's generation as `cancel` does."""
        if self._done:
            return
        if not self._answered:
            self.cancel()
            return
        self._done = True
        self._link._finish(self._opened.result())

    def cancel(self) -> None:
        """End the call: the connection closes (the card stops the generation) unless it ended cleanly."""
        if not self._done:
            self._done = True
            self._opened.cancel()
            self._close_connection()

    def _close_connection(self) -> None:
        if self._opened.done() and not self._opened.cancelled() and self._opened.exception() is None:
            self._opened.result().close()


class CardLink:
    """The router's end: connections to one card incarnation's `LinkServer`."""

    def __init__(self, endpoint: str, token: str) -> None:
        self.endpoint = endpoint
        host, _, port = endpoint.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._hello = _frame(HELLO, token.encode())
        self._idle: list[_Connection] = []
        self._ending: set[asyncio.Task[None]] = set()  # connections whose END is being read
        self._closed = False

    def generate(self, request: Any) -> LinkCall:
        """Start a generation on the card; the request is on its way once the caller next awaits."""
        return LinkCall(self, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))

    async def close(self) -> None:
        self._closed = True
        for task in list(self._ending):
            task.cancel()
        while self._idle:
            self._idle.pop().close()

    async def _connect(self) -> _Connection:
        if self._closed:
            raise ConnectionError("the card's link is closed")
        reader, writer = await asyncio.open_connection(self._host, self._port, limit=2**20)
        _tune(writer)
        writer.write(self._hello)
        return _Connection(reader, writer)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable():
                return connection
            connection.close()
        return None

    def _finish(self, connection: _Connection) -> None:
        """Read the END that follows a call's last item, then keep the connection; anything else, or
        nothing within END_WAIT_S, closes it."""

        async def read_end() -> None:
            kind = None
            try:
                kind, _ = await asyncio.wait_for(_read_frame(connection.reader), END_WAIT_S)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, _ProtocolError):
                pass
            finally:
                if kind != END:
                    connection.close()
            if kind == END:
                self._give_back(connection)

        task = asyncio.ensure_future(read_end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def _give_back(self, connection: _Connection) -> None:
        if self._closed or len(self._idle) >= MAX_IDLE_CONNECTIONS or not connection.usable():
            connection.close()
        else:
            self._idle.append(connection)


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.IncompleteReadError):
        return "the connection closed"
    return f"{type(error).__name__}: {error}"


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Marks an opening's failure seen: a call cancelled or never read does not log it."""
    if not task.cancelled():
        task.exception()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
