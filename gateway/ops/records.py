"""What the admin API answers about a node: plain records that orjson writes as JSON objects."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClientInfo", "DeadLetter", "DeadLetters", "DelayedInfo", "DelayedList", "NodeInfo", "QueueInfo", "Redriven",
           "SessionInfo", "SubscriptionLag"]



@dataclass(frozen=True, slots=True)
class ClientInfo:
    """One connected client."""

    client_id: str
    username: str | None
    peer: str  # address:port
    protocol: str  # "3.1.1" or "5.0"
    keep_alive_s: int
    expiry_s: int  # Session Expiry Interval; > 0: the session outlives the connection
    subscriptions: int
    inflight: int  # outbound QoS 1/2 messages not acknowledged yet


@dataclass(frozen=True, slots=True)
class SubscriptionLag:
    """One subscription of a session and how far behind its queue it is."""

    filter: str
    queue: str
    qos: int
    group: str | None  # the share name of a shared subscription (its group owns the offset)
    offset: int  # committed: everything below is acknowledged
    max_offset: int  # the queue's next offset
    lag: int  # messages in the queue not acknowledged yet (max_offset - offset)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session this node knows: connected, or persistent and waiting for its client."""

    client_id: str
    connected: bool
    expiry_s: int
    inflight: int
    lag: int  # the sum of its subscriptions' lags
    subscriptions: tuple[SubscriptionLag, ...]


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A light queue read by this node's sessions or shared groups."""

    queue: str
    max_offset: int
    consumers: int  # sessions and shared groups holding an offset on it
    min_offset: int  # the lowest committed offset among them
    lag: int  # max_offset - min_offset: what the slowest consumer has still to acknowledge


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node of the deployment (gateway/ops/nodes.py) and what its process uses."""

    name: str
    role: str  # "embedded" (gateway and store in one process), "gateway" or "store"
    pid: int
    cpu_percent: float | None  # CPU share since the previous look (100: one core), None when unknown
    cpu_s: float  # CPU seconds since the process started
    rss_bytes: int  # resident memory
    uptime_s: float  # since the process started
    clients: int | None  # MQTT clients connected to it (None for the store node)
    here: bool  # the node whose admin API answered


@dataclass(frozen=True, slots=True)
class DelayedInfo:
    """A pending delayed message (store/timer/): what ``GET /api/v1/delayed`` lists and ``DELETE`` cancels by."""

    id: str  # its id, as its publisher got it
    topic: str  # the real topic it goes to when due
    client_id: str  # its publisher ("$http": an HTTP publish)
    due_ms: int  # when it is due, ms since the epoch
    qos: int
    retain: bool
    bytes: int  # the payload's length


@dataclass(frozen=True, slots=True)
class DelayedList:
    """One page of pending delayed messages; ``cursor`` asks for the next (None: this was the last)."""

    messages: tuple[DelayedInfo, ...]
    cursor: str | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message of a POP group's dead-letter topic: where it came from (its ``dlq-*`` user properties,
    store/pop/pops.py) and the message itself."""

    offset: int  # in the dead-letter topic's queue
    origin_topic: str
    origin_client: str
    attempts: int
    queue: str  # the group's queue (filter) it was popped from
    queue_offset: int
    qos: int
    payload: str
    encoding: str  # utf-8, or base64 when the payload is not text
    store_ms: int  # when it was dead-lettered


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """A page of a POP group's dead letters (``GET /api/v1/dlq/{group}``)."""

    group: str
    letters: list[DeadLetter]
    next_offset: int  # where the next page starts
    redriven_below: int  # the letters below this offset were re-driven already


@dataclass(frozen=True, slots=True)
class Redriven:
    """What ``POST /api/v1/dlq/{group}`` re-drove: messages appended back to their topics."""

    group: str
    redriven: int
    redriven_below: int
