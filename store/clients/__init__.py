"""Back-end clients of a store node: producers and consumer groups."""
