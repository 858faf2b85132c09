"""Light queues: MQTT topic rules (``topics``), the active-filter trie (``filters``), the
target-queues codec (``targets``) and the RocksDB index of queues into the CommitLog
(``keys``, ``queues``).

Never imports ``store`` or ``gateway``: what it needs from the CommitLog is the
``queues.LogReader`` protocol. Nothing is re-exported here, so importing
``lightqueue.topics`` (the gateway, ``retain/``) does not load RocksDB.
"""
