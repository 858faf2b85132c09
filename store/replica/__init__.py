"""Replication of a store group's log: the leader's side (what followers hold, the confirm offset, the
acknowledgement gate) and the follower's fetch loop (docs/storage.md, "Replication")."""
