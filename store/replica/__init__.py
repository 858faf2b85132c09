"""Replication of a store group's log: the leader's side (what followers hold, the confirm offset, the
acknowledgement gate), the follower's fetch loop, and the role loop that moves a replica between them
(docs/storage.md, "Replication")."""
