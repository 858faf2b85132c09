"""An MQTT 5 client over a trio socket with the project's own codec, and the node settings it is run against."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from gateway.app.config import OPTIONS
from gateway.app.embedded import serve_gateway
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_5

DEFAULTS = {o.key: o.default for o in OPTIONS}
"""Every setting at its default: an in-process node's settings (``serve_gateway``) start from these."""


@asynccontextmanager
async def embedded_node(data: Path) -> AsyncIterator[int]:
    """The embedded node in this process on a free port, no admin port, no ``$SYS``; yields the port."""
    settings = {**DEFAULTS, "node.data": str(data), "node.port": 0, "admin.port": 0, "mqtt.sys_interval_s": 0}
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(serve_gateway, settings)
        yield port
        nursery.cancel_scope.cancel()


class RawClient:
    """An MQTT 5 (or ``level``) client over a trio socket, using the project's own codec."""

    def __init__(self, stream: trio.SocketStream, level: int = MQTT_5) -> None:
        self.stream = stream
        self.level = level
        self.decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)

    async def send(self, packet) -> None:
        await self.stream.send_all(encode(packet, self.level))

    async def receive(self):
        while (packet := self.decoder.next_packet()) is NEED_DATA:
            data = await self.stream.receive_some(65536)
            assert data, "the server closed the connection"
            self.decoder.feed(data)
        return packet
