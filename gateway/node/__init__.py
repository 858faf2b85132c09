"""The trio gateway node: connections, the poller, timers, listeners, and the node itself."""
