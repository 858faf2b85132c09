"""Telemetry analytics with Spark: the ``commitlog`` PySpark data source and the aggregation jobs (docs/analytics.md)."""
