"""Log readers' connections (``$reader/<name>``): ``ReadLog`` only, answered from the replica's own log.

The Spark live tail (spark_analytics/live.py) reads the CommitLog's raw bytes and frames them itself. A follower
replica serves it from its copy of the log (store/rpc/front.py, refusing phase), up to its published offset: flushed,
and confirmed no further than its leader confirmed (store/replica/follower.py). Below every replica's published offset
the logs are byte for byte the same, so a reader gets the same bytes whichever replica answers, and analytics need not
load the leader; a leader serves readers too (store/rpc/server.py), as the fallback when no follower answers.

A reader presents the store token (a raw log read passes no topic ACL, store/rpc/access.py), takes no lease and is
attached to nothing. It sends ``ReadLog`` (and ``Heartbeat``, ignored); anything else closes the connection with
one line. Its ``Welcome.epoch`` says whether the replica leads (the epoch) or not (0).

Resource handling: the caller owns and closes the stream; a reader silent for ``IDLE_S`` is closed (a dead peer
holds no connection for ever).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import trio

from store.api import LogSpan
from store.local import offset_in_log
from store.rpc import wire as rpc
from store.rpc.errors import error_frame

__all__ = ["IDLE_S", "ReadSpan", "next_message", "serve_reader"]

LOGGER = logging.getLogger(__name__)

IDLE_S = 600.0
"""A reader that sends nothing for this long is closed: a Spark task reads without pause and opens a new
connection per task, so only a dead or stuck peer waits that long."""

RECEIVE_BYTES = 256 * 1024
"""One receive of a peer that sends a request at a time (the server's ``RECEIVE_BYTES``)."""

ReadSpan = Callable[[int, int], LogSpan]
"""``read_span(offset, max_bytes)``: ``StoreNode.read_log`` or ``store.node.log_span`` over a follower's log
(blocking: called in a worker thread)."""


async def next_message(stream: trio.abc.ReceiveStream, decoder: rpc.FrameDecoder) -> Any:
    """The peer's next message, receiving as needed; None once the peer closed the connection (a peer that sends
    one request at a time and waits for its answer: a log reader, a replica fetching the log).

    Raises:
        rpc.RpcProtocolError: the bytes break the wire format.
    """
    while (message := decoder.next_message()) is rpc.NEED_DATA:
        if decoder.eof:
            return None
        decoder.receive_data(await stream.receive_some(RECEIVE_BYTES))
    return message


async def serve_reader(stream: trio.abc.Stream, decoder: rpc.FrameDecoder, name: str, peer: str,
                       read_span: ReadSpan, *, epoch: int = 0, store_id: str = "") -> None:
    """Welcome the reader ``name`` (``epoch``: the one this replica leads, 0 if it follows) and answer its
    ``ReadLog`` requests, one at a time, until it goes, breaks the protocol or stays silent ``IDLE_S``."""
    role = "leader" if epoch else "follower"
    LOGGER.info("log reader connected", extra={"ctx": {"reader": name, "peer": peer, "role": role}})
    reads = 0
    try:
        await stream.send_all(rpc.encode(rpc.Welcome(rpc.PROTOCOL_VERSION, rpc.READER_PREFIX + name, 0.0, IDLE_S,
                                                     store_id, epoch)))
        while True:
            with trio.move_on_after(IDLE_S) as idle:
                message = await next_message(stream, decoder)
            if idle.cancelled_caught:
                LOGGER.info("log reader closed: silent for %.0f s", IDLE_S, extra={"ctx": {"reader": name}})
                return
            if message is None:
                return
            if type(message) is rpc.Heartbeat:
                continue
            if type(message) is not rpc.ReadLog:
                why = f"{type(message).__name__} is not for a log reader connection"
                LOGGER.warning("log reader connection closed: %s", why, extra={"ctx": {"reader": name}})
                await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.DENIED, why)))
                return
            try:
                answer: rpc.LogBytes | rpc.Error = rpc.LogBytes(message.id, await trio.to_thread.run_sync(
                    read_span, offset_in_log(message.start), message.max_bytes))
            except Exception as exc:  # the read's failure (expired, beyond the published end), answered
                answer = error_frame(message.id, exc)
                if answer.kind is rpc.ErrorKind.INTERNAL:
                    LOGGER.error("log read failed: %r", exc, exc_info=exc, extra={"ctx": {"reader": name}})
            reads += 1
            await stream.send_all(rpc.encode(answer))
    except rpc.RpcProtocolError as exc:
        LOGGER.warning("log reader connection closed: %s", exc, extra={"ctx": {"reader": name}})
        with trio.move_on_after(1.0), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.PROTOCOL, str(exc))))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        LOGGER.info("log reader disconnected", extra={"ctx": {"reader": name, "peer": peer, "role": role,
                                                              "reads": reads}})
