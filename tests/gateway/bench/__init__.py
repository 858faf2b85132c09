"""Tests of gateway/bench/ (a package, so that equal module basenames in different folders do not clash)."""
