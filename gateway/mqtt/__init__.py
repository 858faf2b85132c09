"""The sans-IO MQTT 3.1.1 / 5.0 protocol: codec, packets, state table, channel, packet handlers, session."""
