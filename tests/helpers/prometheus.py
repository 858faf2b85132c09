"""One figure of a node's Prometheus exposition (its admin port's /metrics), read over HTTP."""

import re
import urllib.request

from tests.helpers.processes import WAIT_S


def metric(port: int, sample: str) -> float:
    """The value of ``sample`` (a metric name with its labels, as exposed), failing with the text if absent."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


def scraped(port: int, sample: str) -> float | None:
    """``sample``'s value on the endpoint at ``port`` now, or None (absent, or the endpoint did not answer)."""
    try:
        return metric(port, sample)
    except (AssertionError, OSError):
        return None
