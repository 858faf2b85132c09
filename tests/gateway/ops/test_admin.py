"""The admin HTTP endpoint of `lightgate serve` (gateway/ops/admin.py), over real sockets against a node subprocess:
health and readiness, HTTP errors, each admin action taking effect on paho clients, HTTP publish, and auth."""

import base64
import contextlib
import json
import os
import re
import socket
import uuid

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.auth.passwords import PasswordFile
from gateway.ops.admin import AdminApi
from store.log.commitlog import CommitLogConfig
from store.log.record import HEADER_SIZE
from tests.helpers.admin import Admin, admin_port
from tests.helpers.prometheus import metric
from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connected, check_nothing_before_sentinel, properties, running_node, wait_until,
)

TOKEN = "s3cret-admin-token"
PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw"}
ACL = """\
default deny

user alice
allow both alice/#

user bob
allow subscribe #
"""


@pytest.fixture(scope="module")
def node_without_sys(tmp_path_factory):
    with running_node(tmp_path_factory.mktemp("admin") / "data", "--mqtt-connect-timeout-s", "2",
                      "--mqtt-sys-interval-s", "0") as node:
        yield node
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


@pytest.fixture
def admin(node_without_sys):
    client = Admin(admin_port(node_without_sys))
    yield client
    client.close()


def run_id() -> str:
    return uuid.uuid4().hex[:6]


def test_health_readiness_and_keep_alive(admin):
    assert admin.get("/healthz") == {"status": "ok"}
    assert admin.get("/readyz") == {"status": "ready"}
    sock = admin.conn.sock
    for _ in range(3):
        admin.get("/healthz")
    assert admin.conn.sock is sock  # one connection served every request


def test_http_errors_are_json_with_the_right_status(admin):
    status, _, body = admin.request("GET", "/api/v1/nothing-here")
    assert status == 404 and "no such resource" in body["error"]
    status, headers, body = admin.request("PUT", "/api/v1/clients")
    assert status == 405 and headers["allow"] == "GET" and "PUT" in body["error"]
    status, headers, body = admin.request("POST", "/healthz")
    assert status == 405
    status, _, body = admin.request("GET", "/api/v1/clients/no-such-client")
    assert status == 404
    status, _, body = admin.request("POST", "/api/v1/publish", b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    status, _, body = admin.request("POST", "/api/v1/publish", {"topic": "a/+/b", "payload": "x"})
    assert status == 400 and "topic" in body["error"]
    status, _, body = admin.request("POST", "/api/v1/publish", {"topic": "a", "payload": "x", "qos": 3})
    assert status == 400 and "qos" in body["error"]
    status, _, body = admin.request("GET", "/api/v1/retained?filter=a/%23/b")
    assert status == 400 and "filter" in body["error"]


def test_a_body_over_the_limit_gets_413_and_the_connection_closes(node_without_sys):
    # The node runs with the default mqtt.max_packet_size (1 MiB + 1 KiB): bodies up to twice that are read.
    with socket.create_connection(("127.0.0.1", admin_port(node_without_sys)), timeout=WAIT_S) as raw:
        raw.sendall(b"POST /api/v1/publish HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"exceeds" in answer


def test_a_chunked_body_over_the_limit_gets_413(node_without_sys):
    with socket.create_connection(("127.0.0.1", admin_port(node_without_sys)), timeout=WAIT_S) as raw:
        raw.sendall(b"POST /api/v1/publish HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1_000_000
        answer = b""
        try:
            for _ in range(4):
                raw.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the node answered and closed while we were still sending
        while part := raw.recv(65536):
            answer += part
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_malformed_http_gets_400(node_without_sys):
    with socket.create_connection(("127.0.0.1", admin_port(node_without_sys)), timeout=WAIT_S) as raw:
        raw.sendall(b"this is not HTTP\r\n\r\n")
        answer = raw.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400 ")


def test_disconnect_a_client_with_administrative_action(node_without_sys, admin):
    run = run_id()
    with connected(node_without_sys.port) as watcher:
        watcher.subscribe(f"will{run}/#", 1)
        victim = Client(node_without_sys.port, f"victim-{run}", protocol=mqtt.MQTTv5,
                        will=(f"will{run}/gone", b"bye", 1))
        victim.paho.reconnect_delay_set(60, 60)  # paho reconnects by itself; not within this test
        victim.connect()
        clients = {c["client_id"]: c for c in admin.get("/api/v1/clients")}
        assert clients[f"victim-{run}"]["protocol"] == "5.0"
        assert admin.get(f"/api/v1/clients/victim-{run}")["peer"].startswith("127.0.0.1:")
        status, _, body = admin.request("DELETE", f"/api/v1/clients/victim-{run}")
        assert status == 200 and body == {"disconnected": f"victim-{run}"}
        reason = victim.disconnects.get(timeout=WAIT_S)
        assert int(getattr(reason, "value", reason)) == 0x98  # MQTT 5 DISCONNECT: Administrative action
        victim.paho.loop_stop()
        (will,) = watcher.receive(1)  # a close the client did not ask for publishes its will
        assert (will.topic, will.payload) == (f"will{run}/gone", b"bye")
        assert f"victim-{run}" not in {c["client_id"] for c in admin.get("/api/v1/clients")}
        status, _, _ = admin.request("DELETE", f"/api/v1/clients/victim-{run}")
        assert status == 404


def test_the_client_list_is_searched_sorted_and_paged_by_the_node(node_without_sys, admin):
    run = run_id()
    ids = [f"list-{run}-{i}" for i in range(5)]
    with contextlib.ExitStack() as stack:
        for keep_alive, client_id in zip((30, 10, 50, 20, 40), ids):
            stack.enter_context(connected(node_without_sys.port, client_id=client_id, keepalive=keep_alive))
        status, headers, body = admin.request("GET", f"/api/v1/clients?search=LIST-{run}&sort=keep_alive_s&order=desc"
                                                     "&offset=1&limit=3")
        assert status == 200 and headers["x-total-count"] == "5"
        assert [(c["client_id"], c["keep_alive_s"]) for c in body] == [(ids[4], 40), (ids[0], 30), (ids[3], 20)]
        status, headers, body = admin.request("GET", f"/api/v1/clients?search=list-{run}&offset=4")
        assert headers["x-total-count"] == "5" and [c["client_id"] for c in body] == [ids[4]]
        for query, named in (("sort=password", "'sort'"), ("order=up", "'order'"), ("limit=0", "'limit'"),
                             ("limit=1001", "'limit'"), ("offset=-1", "'offset'")):
            status, _, body = admin.request("GET", f"/api/v1/clients?{query}")
            assert status == 400 and named in body["error"], query


def test_sessions_and_queues_show_lag_and_delete_session_ends_it(node_without_sys, admin):
    run = run_id()
    client_id = f"sess-{run}"
    expiry = properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)
    sub = Client(node_without_sys.port, client_id, protocol=mqtt.MQTTv5, clean=False)
    sub.connect(properties=expiry)
    sub.subscribe(f"lag{run}/#", 1)
    sub.disconnect()
    with connected(node_without_sys.port) as pub:
        for i in range(3):
            pub.publish(f"lag{run}/x", str(i).encode(), 1)

    def offline_session():
        return next((s for s in admin.get("/api/v1/sessions") if s["client_id"] == client_id), None)

    wait_until(lambda: (offline_session() or {}).get("lag") == 3, what="the offline session's lag of 3")
    session = offline_session()
    assert not session["connected"] and session["expiry_s"] == 3600
    (subscription,) = session["subscriptions"]
    assert subscription["filter"] == f"lag{run}/#" and subscription["max_offset"] - subscription["offset"] == 3
    assert admin.get(f"/api/v1/sessions/{client_id}")["lag"] == 3
    queue = next(q for q in admin.get("/api/v1/queues") if q["queue"] == f"lag{run}/#")
    assert queue["lag"] == 3 and queue["consumers"] == 1
    overview = admin.get("/api/v1/overview")
    assert client_id in {s["client_id"] for s in overview["top_sessions"]}
    assert overview["sessions"]["offline"] >= 1

    status, _, body = admin.request("DELETE", f"/api/v1/sessions/{client_id}")
    assert status == 200 and body == {"deleted": client_id}
    status, _, _ = admin.request("GET", f"/api/v1/sessions/{client_id}")
    assert status == 404
    status, _, _ = admin.request("DELETE", f"/api/v1/sessions/{client_id}")
    assert status == 404
    again = Client(node_without_sys.port, client_id, protocol=mqtt.MQTTv5, clean=False)
    flags = again.connect(properties=expiry)
    assert not flags.session_present  # the session is gone: nothing of it resumes
    again.subscribe(f"lag{run}/#", 1)
    check_nothing_before_sentinel(again, again, f"lag{run}/x")  # none of the deleted session's three comes first
    again.disconnect()


def test_delete_session_of_a_connected_client_disconnects_it(node_without_sys, admin):
    run = run_id()
    client = Client(node_without_sys.port, f"live-{run}")
    client.paho.reconnect_delay_set(60, 60)  # paho reconnects by itself; not within this test
    client.connect()
    try:
        client.subscribe(f"live{run}/#", 1)
        assert admin.get(f"/api/v1/sessions/live-{run}")["connected"]
        status, _, _ = admin.request("DELETE", f"/api/v1/sessions/live-{run}")
        assert status == 200
        client.disconnects.get(timeout=WAIT_S)
    finally:
        client.paho.loop_stop()
    status, _, _ = admin.request("GET", f"/api/v1/sessions/live-{run}")
    assert status == 404


def test_retained_messages_are_listed_and_deleted(node_without_sys, admin):
    run = run_id()
    with connected(node_without_sys.port) as pub:
        pub.publish(f"ret{run}/a", b"kept", 1, retain=True)
        pub.publish(f"ret{run}/b", b"\xff\x00", 1, retain=True)
    wait_until(lambda: len(admin.get(f"/api/v1/retained?filter=ret{run}/%23")) == 2, what="two retained messages")
    listed = {m["topic"]: m for m in admin.get(f"/api/v1/retained?filter=ret{run}/%23")}
    assert listed[f"ret{run}/a"]["payload"] == "kept" and listed[f"ret{run}/a"]["encoding"] == "utf-8"
    assert base64.b64decode(listed[f"ret{run}/b"]["payload"]) == b"\xff\x00"
    assert admin.get(f"/api/v1/retained/ret{run}/a")["payload"] == "kept"

    status, _, body = admin.request("DELETE", f"/api/v1/retained/ret{run}/a")
    assert status == 200 and body == {"deleted": f"ret{run}/a"}
    wait_until(lambda: [m["topic"] for m in admin.get(f"/api/v1/retained?filter=ret{run}/%23")] == [f"ret{run}/b"],
               what="the deleted retained message to go")
    with connected(node_without_sys.port) as late:
        late.subscribe(f"ret{run}/a", 1)
        check_nothing_before_sentinel(late, late, f"ret{run}/a")  # a new subscriber gets no retained message for it
    status, _, _ = admin.request("DELETE", f"/api/v1/retained/ret{run}/a")
    assert status == 404


def test_http_publish_reaches_a_paho_subscriber(node_without_sys, admin):
    run = run_id()
    with connected(node_without_sys.port, protocol=mqtt.MQTTv5) as sub:
        sub.subscribe(f"http{run}/#", 2)
        status, _, body = admin.request("POST", "/api/v1/publish", {"topic": f"http{run}/text", "payload": "héllo",
                                                                    "qos": 1})
        assert status == 200 and body == {"topic": f"http{run}/text", "qos": 1, "retain": False, "bytes": 6}
        admin.request("POST", "/api/v1/publish", {"topic": f"http{run}/bin", "qos": 2, "retain": True,
                                                  "payload": base64.b64encode(b"\x00\x01").decode(),
                                                  "encoding": "base64"})
        first, second = sub.receive(2)
        assert (first.topic, first.payload, first.qos) == (f"http{run}/text", "héllo".encode(), 1)
        assert (second.topic, second.payload, second.qos) == (f"http{run}/bin", b"\x00\x01", 2)
    with connected(node_without_sys.port) as late:
        late.subscribe(f"http{run}/bin", 1)
        (retained,) = late.receive(1)
        assert retained.retain and retained.payload == b"\x00\x01"


@pytest.mark.parametrize(("body", "field"), [
    ({"topic": "t", "payload": "x", "retained": True}, "retained"),  # a misspelt option: refused, not ignored
    ({"topic": "t", "payload": "x", "qos": "1"}, "$.qos"),
    ({"topic": "t", "payload": "x", "retain": "yes"}, "$.retain"),
    ({"topic": "t", "payload": 5}, "$.payload"),
    ({"topic": ["t"], "payload": "x"}, "$.topic"),
    ({"topic": "t", "encoding": "hex"}, "$.encoding"),
    ({"payload": "x"}, "topic"),
])
def test_a_publish_body_with_an_unknown_or_mistyped_field_is_a_400_naming_it(admin, body, field):
    status, _, answer = admin.request("POST", "/api/v1/publish", body)
    assert status == 400 and field in answer["error"], answer


def test_a_refused_publish_body_publishes_nothing(node_without_sys, admin):
    run = run_id()
    with connected(node_without_sys.port) as sub:
        sub.subscribe(f"strict{run}/#", 1)
        status, _, answer = admin.request("POST", "/api/v1/publish",
                                          {"topic": f"strict{run}/a", "payload": "kept?", "retained": True})
        assert status == 400 and "retained" in answer["error"]
        status, _, _ = admin.request("POST", "/api/v1/publish", {"topic": f"strict{run}/b", "payload": "sentinel"})
        assert status == 200
        (first,) = sub.receive(1)  # the sentinel, published after the refused body, comes first: it comes alone
        assert first.topic == f"strict{run}/b"


def test_http_publish_sends_mqtt5_properties_to_a_paho_v5_subscriber(node_without_sys, admin):
    # The PUBLISH properties of [MQTT-3.3.2] are forwarded unaltered to the subscriber [MQTT-3.3.2-4, -15, -16, -17,
    # -18, -20]; the expiry interval is the one received minus the time waited [MQTT-3.3.2-6].
    run = run_id()
    correlation = b"\x00req-17\xff"
    with connected(node_without_sys.port, protocol=mqtt.MQTTv5) as sub:
        sub.subscribe(f"props{run}/#", 1)
        status, _, body = admin.request("POST", "/api/v1/publish", {
            "topic": f"props{run}/cmd", "payload": '{"on": true}', "qos": 1, "properties": {
                "payload_format_indicator": 1, "message_expiry_interval": 3600, "content_type": "application/json",
                "response_topic": f"props{run}/reply", "correlation_data": base64.b64encode(correlation).decode(),
                "user_properties": [["trace", "t-1"], ["trace", "t-2"], ["from", "billing"]]}})
        assert status == 200, body
        (message,) = sub.receive(1)
    props = message.properties
    assert message.payload == b'{"on": true}'
    assert props.PayloadFormatIndicator == 1 and props.ContentType == "application/json"
    assert props.ResponseTopic == f"props{run}/reply" and props.CorrelationData == correlation
    assert props.UserProperty == [("trace", "t-1"), ("trace", "t-2"), ("from", "billing")]
    assert 3590 <= props.MessageExpiryInterval <= 3600


@pytest.mark.parametrize(("properties", "field"), [
    ({"correlation_data": "not base64!"}, "correlation_data"),
    ({"response_topic": "replies/+"}, "response_topic"),
    ({"message_expiry_interval": -1}, "$.properties.message_expiry_interval"),
    ({"payload_format_indicator": 2}, "$.properties.payload_format_indicator"),
    ({"user_properties": [["only a name"]]}, "$.properties.user_properties[0]"),
    ({"content_type": "a\u0000b"}, "U+0000"),
    ({"contentType": "text/plain"}, "contentType"),
])
def test_bad_mqtt5_properties_on_http_publish_are_a_400_naming_them(admin, properties, field):
    status, _, answer = admin.request("POST", "/api/v1/publish", {"topic": "t", "payload": "x",
                                                                  "properties": properties})
    assert status == 400 and field in answer["error"], answer


def test_a_payload_marked_utf8_must_be_utf8(admin):
    status, _, answer = admin.request("POST", "/api/v1/publish", {
        "topic": "t", "payload": base64.b64encode(b"\xff").decode(), "encoding": "base64",
        "properties": {"payload_format_indicator": 1}})
    assert status == 400 and "payload_format_indicator" in answer["error"]


def test_bulk_publish_answers_each_message_in_order_and_stores_each_topic_in_order(node_without_sys, admin):
    """One append for the bulk, the messages in runs of one topic: a subscriber to both topics receives each
    topic's messages in the order sent [MQTT-4.6.0-6] (the HTTP publisher is one publisher)."""
    run = run_id()
    with connected(node_without_sys.port, protocol=mqtt.MQTTv5) as sub:
        sub.subscribe(f"bulk{run}/#", 1)
        status, _, body = admin.request("POST", "/api/v1/publish/bulk", {"messages": [
            {"topic": f"bulk{run}/1", "payload": "one", "qos": 1},
            {"topic": f"bulk{run}/+", "payload": "a wildcard: refused alone"},
            {"topic": f"bulk{run}/3", "payload": base64.b64encode(b"\x03").decode(), "encoding": "base64",
             "properties": {"content_type": "application/octet-stream"}},
            {"topic": f"bulk{run}/1", "payload": "four", "qos": 1, "retain": True},
        ]})
        assert status == 200, body
        assert [r["status"] for r in body["results"]] == [200, 400, 200, 200]
        assert body["results"][0] == {"status": 200, "topic": f"bulk{run}/1", "qos": 1, "retain": False, "bytes": 3}
        assert "wildcard" in body["results"][1]["error"]
        received = sub.receive(3)
    assert [(m.topic, m.payload) for m in received] == [(f"bulk{run}/1", b"one"), (f"bulk{run}/1", b"four"),
                                                       (f"bulk{run}/3", b"\x03")]
    assert received[2].properties.ContentType == "application/octet-stream"


def test_a_bulk_publish_is_one_commitlog_write_of_batch_records_and_a_refused_message_fails_alone(
        node_without_sys, admin):
    """One write, each topic's run a batch record (docs/storage.md, "Batch records"): fewer bytes than the 200
    single records would take (a record header per topic, not per message)."""
    run = run_id()
    port = admin_port(node_without_sys)
    messages = [{"topic": f"bulkone{run}/{i % 7}", "payload": f"{i}", "qos": 1} for i in range(200)]
    before = metric(port, "lightgate_commitlog_writes_total")
    bytes_before = metric(port, "lightgate_commitlog_written_bytes_total")
    status, _, body = admin.request("POST", "/api/v1/publish/bulk", {"messages": messages})
    assert status == 200 and {r["status"] for r in body["results"]} == {200}
    writes = metric(port, "lightgate_commitlog_writes_total") - before
    assert 1 <= writes <= 3  # one for the bulk (not 200, each a flush under the sync policy); the node's own may land
    singles = sum(HEADER_SIZE + len("$http") + len(m["topic"]) + len(m["payload"]) for m in messages)
    assert metric(port, "lightgate_commitlog_written_bytes_total") - bytes_before < singles * 0.6
    status, _, body = admin.request("POST", "/api/v1/publish/bulk", {"messages": [
        {"topic": f"bulkone{run}/a", "payload": "fine"},
        {"topic": f"bulkone{run}/a", "payload": "x" * (CommitLogConfig().max_record_bytes + 1)},
        {"topic": f"bulkone{run}/b", "payload": "fine too"}]})
    assert [r["status"] for r in body["results"]] == [200, 413, 200]


def test_a_bulk_body_that_does_not_decode_whole_publishes_nothing(node_without_sys, admin):
    run = run_id()
    with connected(node_without_sys.port) as sub:
        sub.subscribe(f"bulkbad{run}/#", 1)
        status, _, answer = admin.request("POST", "/api/v1/publish/bulk", {"messages": [
            {"topic": f"bulkbad{run}/a", "payload": "x"}, {"topic": f"bulkbad{run}/b", "retained": True}]})
        assert status == 400 and "retained" in answer["error"] and "messages[1]" in answer["error"]
        status, _, answer = admin.request("POST", "/api/v1/publish/bulk", {"messages": [
            {"topic": f"bulkbad{run}/a", "payload": "x"},
            {"topic": f"bulkbad{run}/b", "payload": "%%", "encoding": "base64"}]})
        assert status == 400 and "messages[1].payload" in answer["error"]
        status, _, answer = admin.request("POST", "/api/v1/publish/bulk",
                                          {"messages": [{"topic": f"bulkbad{run}/a"}] * 1001})
        assert status == 400 and "$.messages" in answer["error"] and "1000" in answer["error"]
        status, _, answer = admin.request("POST", "/api/v1/publish/bulk", {"messages": []})
        assert status == 400 and "$.messages" in answer["error"]
        status, _, _ = admin.request("POST", "/api/v1/publish", {"topic": f"bulkbad{run}/sentinel"})
        assert status == 200
        (first,) = sub.receive(1)  # the sentinel comes first: nothing of the refused bodies was published
        assert first.topic == f"bulkbad{run}/sentinel"


def proc_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds as /proc/<pid>/stat says (fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_embedded_node_is_one_node_with_its_process_cpu_and_memory(node_without_sys, admin):
    pid = node_without_sys.proc.pid
    with connected(node_without_sys.port, client_id=f"nodes-{run_id()}"):
        before = proc_cpu_s(pid)
        (node,) = admin.get("/api/v1/nodes")
        after = proc_cpu_s(pid)
    assert (node["role"], node["pid"], node["here"]) == ("embedded", pid, True)  # gateway and store: one process
    assert node["clients"] >= 1 and node["cpu_percent"] is not None and node["cpu_percent"] >= 0
    # the process's own CPU time: /proc's tick-based figures and getrusage's finer ones differ by some ticks
    assert before * 0.9 - 0.05 <= node["cpu_s"] <= after * 1.1 + 0.05
    rss = proc_rss_bytes(pid)
    assert rss / 2 < node["rss_bytes"] < rss * 2  # the node's resident memory, not the peak of another process
    assert 0 < node["uptime_s"]


def _request_for(path: str, method: str) -> tuple[str, dict | None]:
    """A request to one documented operation: path parameters filled in, a (minimal) body for a POST."""
    concrete = re.sub(r"\{\w+\}", f"doc-{run_id()}", path)
    body = {"topic": f"doc{run_id()}/x"} if path == "/api/v1/publish" else None
    if path == "/api/v1/publish/bulk":
        body = {"messages": [{"topic": f"doc{run_id()}/x"}]}
    return concrete, body


def test_the_openapi_document_describes_exactly_the_routes_the_endpoint_answers(node_without_sys, admin):
    document = admin.get("/api/openapi.json")
    assert document["openapi"].startswith("3.")
    documented = {(path, method.upper()) for path, methods in document["paths"].items() for method in methods}
    assert documented == AdminApi(None, None).routes()  # the routing table: every route, and only those
    for path, method in sorted(documented):  # and the running endpoint answers each of them
        concrete, body = _request_for(path, method)
        status, _, answer = admin.request(method, concrete, body)
        assert status != 405, (method, concrete, answer)
        assert not (status == 404 and "no such resource" in answer["error"]), (method, concrete)
        if method == "GET" and status == 200:  # what the document says the answer is
            content = document["paths"][path]["get"]["responses"]["200"]["content"]
            assert list(content) == [_content_type(admin, concrete)], (path, content)
    status, _, _ = admin.request("GET", "/api/v1/undocumented")
    assert status == 404


def _content_type(admin: Admin, path: str) -> str:
    admin.conn.request("GET", path)
    response = admin.conn.getresponse()
    response.read()
    return response.getheader("content-type")


def test_the_openapi_schemas_are_the_structs_the_endpoint_validates(admin):
    document = admin.get("/api/openapi.json")
    schemas = document["components"]["schemas"]
    publish = document["paths"]["/api/v1/publish"]["post"]
    assert publish["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                                      "PublishBody"}
    body = schemas["PublishBody"]
    assert body["additionalProperties"] is False and body["required"] == ["topic"]  # forbid_unknown_fields
    assert body["properties"]["qos"]["enum"] == [0, 1, 2]
    assert set(schemas["PublishProperties"]["properties"]) == {
        "payload_format_indicator", "message_expiry_interval", "content_type", "response_topic", "correlation_data",
        "user_properties"}
    assert schemas["BulkPublishBody"]["properties"]["messages"]["maxItems"] == 1000
    assert {"bearer", "basic"} == {scheme["scheme"]
                                    for scheme in document["components"]["securitySchemes"].values()}
    for reference in re.findall(r'"\$ref": ?"#/components/schemas/(\w+)"', json.dumps(document)):
        assert reference in schemas  # every reference resolves


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secured")
    passwords = PasswordFile.load_or_empty(directory / "users.txt")
    for user, password in PASSWORDS.items():
        passwords.set_password(user, password)
    passwords.save()
    (directory / "acl.txt").write_text(ACL)
    with running_node(directory / "data", "--auth-password-file", str(passwords.path), "--auth-acl-file",
                      str(directory / "acl.txt"), "--auth-failure-delay-s", "0", "--admin-token", TOKEN) as node:
        yield node
    assert node.proc.returncode == 0


def test_the_admin_api_needs_its_token_and_probes_do_not(secured):
    port = admin_port(secured)
    anonymous = Admin(port)
    try:
        for path in ("/healthz", "/readyz", "/metrics", "/", "/api/openapi.json"):
            status, _, _ = anonymous.request("GET", path)
            assert status == 200, path
        for path in ("/api/v1/clients", "/api/v1/overview", "/api/v1/retained", "/api/v1/delayed"):
            status, headers, body = anonymous.request("GET", path)
            assert status == 401 and headers["www-authenticate"].startswith("Bearer"), path
        status, _, _ = anonymous.request("GET", "/api/v1/clients", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = anonymous.request("DELETE", "/api/v1/retained/alice/x")
        assert status == 401
        status, _, _ = anonymous.request("DELETE", "/api/v1/delayed/0-0")
        assert status == 401
    finally:
        anonymous.close()
    authorised = Admin(port, TOKEN)
    try:
        assert authorised.get("/api/v1/clients") == []
    finally:
        authorised.close()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_http_publish_authenticates_with_the_password_file_and_checks_the_acl(secured):
    run = run_id()
    publisher = Admin(admin_port(secured))
    watcher = Client(secured.port, protocol=mqtt.MQTTv5)
    watcher.paho.username_pw_set("bob", PASSWORDS["bob"])
    watcher.connect()
    try:
        watcher.subscribe("#", 1)
        message = {"topic": f"alice/{run}", "payload": "from http", "qos": 1}
        status, headers, _ = publisher.request("POST", "/api/v1/publish", message)
        assert status == 401 and headers["www-authenticate"].startswith("Basic")  # no anonymous access
        status, _, _ = publisher.request("POST", "/api/v1/publish", message, basic("alice", "wrong"))
        assert status == 401
        status, _, body = publisher.request("POST", "/api/v1/publish", {**message, "topic": f"bob/{run}"},
                                            basic("alice", PASSWORDS["alice"]))
        assert status == 403 and "ACL" in body["error"]
        status, _, _ = publisher.request("POST", "/api/v1/publish", message, basic("alice", PASSWORDS["alice"]))
        assert status == 200
        (received,) = watcher.receive(1)  # only the accepted publish was stored
        assert (received.topic, received.payload) == (f"alice/{run}", b"from http")
        status, _, body = publisher.request("POST", "/api/v1/publish/bulk", {"messages": [
            {**message, "payload": "bulk 1"}, {**message, "topic": f"bob/{run}"}, {**message, "payload": "bulk 3"}]},
            basic("alice", PASSWORDS["alice"]))
        assert status == 200 and [r["status"] for r in body["results"]] == [200, 403, 200]
        assert [m.payload for m in watcher.receive(2)] == [b"bulk 1", b"bulk 3"]
        status, _, _ = publisher.request("POST", "/api/v1/publish/bulk", {"messages": [message]})
        assert status == 401  # a bulk publish is authenticated as a whole
        status, _, _ = publisher.request("POST", "/api/v1/publish", {**message, "payload": "sentinel"},
                                         basic("alice", PASSWORDS["alice"]))
        assert status == 200 and [m.payload for m in watcher.receive(1)] == [b"sentinel"]  # nothing came before it
        overview = Admin(admin_port(secured), TOKEN)
        try:
            view = overview.get("/api/v1/overview")
        finally:
            overview.close()
        assert view["auth"]["failures"] >= 2 and view["auth"]["acl_denials"] >= 1
        recent = view["auth"]["recent"][0]
        assert recent["client_id"] is None and recent["reason"] in ("NOT_AUTHORIZED", "BAD_USER_NAME_OR_PASSWORD")
    finally:
        publisher.close()
        watcher.disconnect()
