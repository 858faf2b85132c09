"""The CommitLog engine: records, segments, the log, the records kept in memory, its trio face."""
