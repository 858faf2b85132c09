"""The store: the CommitLog engine (``log``), the store node and its one interface (``api``), the RPC, back-end clients."""
