"""A client of the admin HTTP API (gateway/ops/admin.py) for the tests of a node or a cluster."""

import http.client
import json

from tests.helpers.mqtt_fixtures import WAIT_S, Node


class Admin:
    """An HTTP/1.1 client of the admin endpoint on one kept-alive connection (http.client: a real socket)."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.port = port
        self.token = token
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, object]:
        """(status, headers, JSON body or raw bytes) of one request."""
        sent = dict(headers or {})
        if self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        self.conn.request(method, path, body=body, headers=sent)
        response = self.conn.getresponse()
        data = response.read()
        if response.getheader("content-type", "").startswith("application/json"):
            return response.status, response.headers, json.loads(data)
        return response.status, response.headers, data

    def get(self, path: str) -> object:
        status, _, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def close(self) -> None:
        self.conn.close()


def admin_port(node: Node) -> int:
    return node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
