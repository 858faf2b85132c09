"""The ``mqtt`` PySpark data sink: a DataFrame's rows become MQTT messages, appended through the store's producer.

    alerts.write.format("mqtt").option("store", "store-host:7883").mode("append").save()
    alerts.writeStream.format("mqtt").option("store", "store-host:7883").option("checkpointLocation", cp).start()

Each row is one message: a ``topic`` (string) and a ``payload`` (binary or
string, UTF-8), and optionally ``qos`` (0-2) and ``retain`` (boolean) columns;
without them the ``qos`` and ``retain`` options apply. The messages are
appended to the CommitLog by store/clients/producer.py exactly like a device's
PUBLISH, so the subscribers of any gateway node receive them (alerts computed
from aggregates, commands to devices). Each Spark task connects its own
producer, sends its rows in batches and returns once the store acknowledged
every one of them (durably: on disk); a task that fails (a topic the ACL
denies, a message over the size limit, the store gone) fails the write.
Guarantee: at least once per row: a task Spark retries, or a micro-batch a
stream re-runs after a crash, sends its rows again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, BooleanType, IntegralType, StringType, StructType

from store.rpc.wire import parse_addresses

__all__ = ["FORMAT", "MqttSink", "SinkOptions"]

FORMAT = "mqtt"
"""The short name for ``df.write.format(...)`` and ``df.writeStream.format(...)``."""

OPTIONS = {
    "store": "HOST:PORT of the store node (its store.listen)",
    "storeuser": "the user name, when the store has a password file",
    "storepassword": "the password of storeUser",
    "qos": "the QoS of rows without a qos column: 0, 1 (default) or 2",
    "retain": "the RETAIN flag of rows without a retain column: true or false (default)",
}
"""Every option the sink accepts (lower case), with its meaning; unknown ones are refused."""

COLUMNS = {"topic": (StringType,), "payload": (BinaryType, StringType), "qos": (IntegralType,),
           "retain": (BooleanType,)}
"""The columns a row may have, and their Spark types; ``topic`` and ``payload`` are required."""

SETTLE_EVERY = 10_000
"""Messages sent before the task waits for their acknowledgements: bounds what a task holds in memory."""


@dataclass(frozen=True, slots=True)
class SinkOptions:
    """The sink's options, parsed on the driver (picklable: the writers carry them to the executors)."""

    store: str
    user: str | None = None
    password: str | None = None
    qos: int = 1
    retain: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        """Raises: ValueError: an unknown option or a bad value, naming the option."""
        low = {k.lower(): v for k, v in options.items() if k.lower() not in ("path", "checkpointlocation")}
        unknown = sorted(set(low) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown mqtt sink option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}")
        if not low.get("store"):
            raise ValueError("the mqtt sink needs the store option (HOST:PORT of the store node)")
        try:
            parse_addresses(low["store"])
        except ValueError as exc:
            raise ValueError(f"option store: {exc}") from None
        if low.get("qos", "1") not in ("0", "1", "2"):
            raise ValueError(f"option qos: 0, 1 or 2, not {low['qos']!r}")
        if low.get("retain", "false").lower() not in ("true", "false"):
            raise ValueError(f"option retain: true or false, not {low['retain']!r}")
        return cls(low["store"], low.get("storeuser"), low.get("storepassword"), int(low.get("qos", "1")),
                   low.get("retain", "false").lower() == "true")


def check_schema(schema: StructType) -> None:
    """Refuse a DataFrame whose columns are not the sink's (a misspelled column would be lost silently).

    Raises:
        ValueError: a missing ``topic`` or ``payload``, an unknown column, or a column of another type.
    """
    names = [f.name for f in schema.fields]
    missing = [c for c in ("topic", "payload") if c not in names]
    if missing:
        raise ValueError(f"the mqtt sink needs the column(s) {', '.join(missing)} (has {', '.join(names)})")
    for f in schema.fields:
        types = COLUMNS.get(f.name)
        if types is None:
            raise ValueError(f"column {f.name} is not one of the mqtt sink's ({', '.join(COLUMNS)})")
        if not isinstance(f.dataType, types):
            raise ValueError(f"column {f.name} is {f.dataType.simpleString()}, not "
                             f"{' or '.join(t.typeName() for t in types)}")


def send_rows(opts: SinkOptions, rows: Iterator[Any]) -> int:
    """Send each row as a message and wait until the store has appended every one; returns how many.

    Raises:
        ValueError: a row with a null topic, payload, qos or retain, or a QoS out of range.
        The producer's errors: TopicError (not a topic name), AccessDenied, RecordTooLarge, StoreUnavailable.
    """
    from store.clients.blocking import BlockingProducer

    sent = 0
    with BlockingProducer.connect(opts.store, username=opts.user, password=opts.password) as producer:
        pending: list[Any] = []

        def settle() -> None:
            producer.flush()
            for future in pending:
                future.result()
            pending.clear()

        for row in rows:
            fields = row.asDict()
            topic, payload = fields["topic"], fields["payload"]
            qos, retain = fields.get("qos", opts.qos), fields.get("retain", opts.retain)
            if topic is None or payload is None or qos is None or retain is None:
                raise ValueError(f"a row to send has a null topic, payload, qos or retain: {fields!r}")
            body = payload.encode() if isinstance(payload, str) else bytes(payload)
            pending.append(producer.send(topic, body, qos=qos, retain=retain))  # waits while the producer is full
            sent += 1
            if len(pending) >= SETTLE_EVERY:
                settle()
        settle()
    return sent


@dataclass
class Sent(WriterCommitMessage):
    """What one task sent."""

    messages: int


class MqttWriter(DataSourceWriter, DataSourceStreamWriter):
    """A batch write, or a stream's micro-batch: every row is a message, acknowledged by the store before the
    task ends (a micro-batch re-run after a crash sends its rows again)."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[Any]) -> Sent:
        return Sent(send_rows(self.opts, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int | None = None) -> None:
        """Nothing to do: each task's messages were appended before it returned."""


class MqttSink(DataSource):
    """``df.write.format("mqtt")`` and ``df.writeStream.format("mqtt")``: rows to MQTT messages."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.parsed = SinkOptions.parse(options)

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return self._writer(schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return self._writer(schema, overwrite)

    def _writer(self, schema: StructType, overwrite: bool) -> MqttWriter:
        if overwrite:
            raise ValueError("the mqtt sink only appends messages: use mode('append') (or outputMode('append'))")
        check_schema(schema)
        return MqttWriter(self.parsed)
