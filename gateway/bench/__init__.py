"""``lightgate bench`` and ``lightgate simulate``: the benchmarks, the load generator and the device simulators."""
