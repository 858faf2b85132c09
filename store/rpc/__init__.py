"""The store RPC: the wire format, the server, the ``RemoteStore`` client, who may connect."""
