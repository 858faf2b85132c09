"""POP consumption: members of a group take messages one by one with an invisible time, acknowledge each, and the
store revives what was not acknowledged in time, then dead-letters it (``state``, ``applier``, ``handles``, ``pops``,
``revive``)."""
