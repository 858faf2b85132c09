"""The client log (gateway/node/clientlog.py): a real node and real clients, one line per accepted CONNECT and one
per closed connection, in the JSON and the text log formats."""

import re

import paho.mqtt.client as mqtt
import pytest

from gateway.auth.passwords import PasswordFile
from tests.helpers.mqtt_fixtures import Client, RawClient
from tests.helpers.processes import LightgateProcess

TEXT_CTX = re.compile(r" (\w+)=(\S*)")


def fields(doc: dict, json_logs: bool) -> dict:
    """A log line's fields: the JSON object, or the text line's ``key=value`` context (values as text)."""
    if json_logs:
        return {k: str(v) for k, v in doc.items()}
    line = doc["msg"]
    return {"msg": line.split(": ", 1)[1].split(" client_id=")[0], **dict(TEXT_CTX.findall(line))}


@pytest.mark.slow
@pytest.mark.parametrize("json_logs", [True, False], ids=["json", "text"])
def test_one_line_per_connect_and_per_disconnect(tmp_path, json_logs):
    passwords = PasswordFile.load_or_empty(tmp_path / "passwd")
    passwords.set_password("alice", "alice-pw")
    passwords.save()
    node = LightgateProcess("serve", "--port", "0", "--data", str(tmp_path / "data"), "--admin-port", "0",
                            "--mqtt-sys-interval-s", "0", "--auth-password-file", str(tmp_path / "passwd"),
                            "--auth-allow-anonymous", "true", json_logs=json_logs)
    try:
        ready = node.wait_log(lambda doc: "gateway node ready" in doc.get("msg", ""))
        port = int(ready["port"] if json_logs else re.search(r" port=(\d+)", ready["msg"])[1])

        def line(msg: str, client_id: str) -> dict:
            doc = node.wait_log(lambda d: fields(d, json_logs).get("client_id") == client_id
                                and fields(d, json_logs)["msg"].startswith(msg))
            return fields(doc, json_logs)

        five = Client(port, "log-five", protocol=mqtt.MQTTv5, keepalive=17)
        five.paho.username_pw_set("alice", "alice-pw")
        five.connect()
        up = line("client connected", "log-five")
        local = five.paho.socket().getsockname()
        assert up["peer"] == f"{local[0]}:{local[1]}" and up["username"] == "alice"
        assert (up["protocol"], up["protocol_level"], up["keep_alive_s"]) == ("5.0", "5", "17")
        assert (up["clean_start"], up["session_present"]) == ("True", "False")
        five.disconnect()
        down = line("closing connection", "log-five")
        assert down["reason"] == "SUCCESS" and "client disconnected" in down["msg"] and down["peer"] == up["peer"]

        raw = RawClient(port)  # 3.1.1, then the network goes
        raw.connect("log-311", clean=False, keep_alive=30)
        up = line("client connected", "log-311")
        assert (up["protocol"], up["protocol_level"], up["keep_alive_s"]) == ("3.1.1", "4", "30")
        assert (up["clean_start"], up["username"]) == ("False", "None")
        raw.close()
        down = line("closing connection", "log-311")
        assert down["reason"] == "UNSPECIFIED_ERROR" and "connection lost" in down["msg"]
        assert sum(fields(d, json_logs).get("client_id") in ("log-five", "log-311") for d in node.logs) == 4
    finally:
        node.stop()
