"""Topic events: "queue Q has messages up to offset N", routed to the gateway nodes with sessions on Q.

``router`` decides which nodes get which events (sans-IO, reference-counted
registrations, metrics); ``channel`` holds each node's pending events, merged
per queue, for its consumer task (trio). The store node wires them: dispatcher
listener -> ``NotifyRouter.route`` -> ``EventMailbox.post`` per node.
Imports ``lightqueue.topics``; never ``store`` or ``gateway``.
"""

from notify.channel import EventMailbox, EventMailboxStatistics
from notify.router import NotifyRouter, NotifyRouterStatistics

__all__ = ["EventMailbox", "EventMailboxStatistics", "NotifyRouter", "NotifyRouterStatistics"]
