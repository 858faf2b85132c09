"""The channel's packet handlers, one module per packet family (Mosquitto's ``handle_*.c``, EMQX's ``process_*``).

Each handler is a function of the channel (its first parameter, ``channel``, is the
``Channel`` whose protocol state, ``channel.conn``, it reads and moves, seen through
``view.ChannelView``) and one packet or node event; it returns the actions the node
executes, in order. The channel keeps the state, the transition table, the timers and
the closing (public methods such as ``close`` and ``settle``; its private names are its own), and
dispatches each packet (and each node event answering one) to its family's
handler through one table (``gateway/mqtt/channel.py``). Checks are named steps
citing their clause; a check that fails raises ``RemoteProtocolError`` or
returns the refusal (``error_packet`` turns errors into packets in one place).

- ``connect``: CONNECT (AUTH is never let through: enhanced authentication is not offered), the will, the
  answer to opening the session (CONNACK or refusal);
- ``publish``: inbound PUBLISH at QoS 0/1/2, topic aliases, the store's answers, PUBREL;
- ``acks``: PUBACK, PUBREC and PUBCOMP of outbound messages (the session's window);
- ``subscribe``: SUBSCRIBE and UNSUBSCRIBE, shared subscriptions, retained messages on subscribe;
- ``ping``: PINGREQ and DISCONNECT, the client saying it is alive or leaving.
"""
