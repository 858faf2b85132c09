"""The trio gateway node: connections, their transports, the poller, timers, listeners, and the node itself."""
