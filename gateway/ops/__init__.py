"""What operators read from a node: the admin HTTP API, metrics, the dashboard."""
