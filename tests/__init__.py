"""The test suite, a package mirroring the product packages (tests/gateway/mqtt/ tests gateway/mqtt/, ...)."""
