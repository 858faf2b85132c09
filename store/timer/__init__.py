"""Delayed delivery at any second: a TimerLog and a TimerWheel over the CommitLog (docs/storage.md, "Delayed delivery")."""
