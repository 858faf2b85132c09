"""Shared test settings. Fixtures specific to one area live in that area's test files."""

import os

from hypothesis import HealthCheck, settings

# Two shared cores: wall-clock deadlines would make property tests flaky, not stricter.
settings.register_profile(
    "lightgate",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("lightgate")
