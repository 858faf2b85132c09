"""The ``lightgate`` command, configuration, logging, workers, reload, and the composition roots."""
