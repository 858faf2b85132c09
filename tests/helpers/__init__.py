"""What several test modules share: processes, clients, strategies, scripts run by path.

No test module imports another (tests/test_layout.py).
"""
