"""Retained messages: the latest message per topic, found by exact topic or wildcard filter.

``tree`` is the in-memory topic tree (which topics exist), ``store`` the RocksDB
column family that holds the messages and the dispatcher-facing update API.
Imports ``lightqueue.topics`` for the MQTT rules; never ``store`` or ``gateway``.
"""

from retain.store import CHECKPOINT_KEY, RETAIN_FAMILY, Retained, RetainedStatistics, RetainedStore
from retain.tree import TopicTree, TopicTreeStatistics

__all__ = [
    "CHECKPOINT_KEY",
    "RETAIN_FAMILY",
    "Retained",
    "RetainedStatistics",
    "RetainedStore",
    "TopicTree",
    "TopicTreeStatistics",
]
