"""gateway/bench/etcd.py: the benchmarks' own etcd, started on free loopback ports, read through its v3 JSON API."""

import json
import os
import shutil
import socket
import subprocess

import pytest

from gateway.bench import etcd, peers

pytestmark = [pytest.mark.slow, pytest.mark.skipif(etcd.missing() is not None, reason=str(etcd.missing()))]


def _put(server: etcd.Etcd, key: str, value: str) -> None:
    """A write by etcd's own client, so the reads are checked against something this module did not write."""
    subprocess.run([shutil.which("etcdctl") or "etcdctl", "--endpoints", server.client_url, "put", key, value],
                   check=True, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"})


def test_a_started_etcd_is_healthy_serves_the_group_keys_and_stops(tmp_path):
    server = etcd.start(tmp_path / "etcd", peers.free_port(), peers.free_port(), tmp_path / "etcd.log")
    with server:
        assert server.healthy()
        assert server.leader("g") is None and server.in_sync("g") is None and server.get("/nothing") is None
        _put(server, "/lightgate/groups/g/leader", json.dumps({"name": "r1", "epoch": 4, "address": "127.0.0.1:9"}))
        _put(server, "/lightgate/groups/g/isr", json.dumps({"epoch": 4, "members": ["r1", "r2"]}))
        _put(server, "/lightgate/groups/other/leader", json.dumps({"name": "r0", "epoch": 1, "address": "x"}))
        assert server.leader("g") == {"name": "r1", "epoch": 4, "address": "127.0.0.1:9"}
        assert server.in_sync("g") == {"epoch": 4, "members": ["r1", "r2"]}
    assert server.process.returncode is not None and not server.healthy()
    with pytest.raises(etcd.EtcdError, match="did not answer a read of /lightgate/groups/g/leader"):
        server.leader("g")


def test_an_etcd_that_cannot_listen_is_an_error_with_its_log(tmp_path):
    with socket.socket() as taken:
        taken.bind((etcd.HOST, 0))
        taken.listen()
        with pytest.raises(etcd.EtcdError, match="(?s)exited with status 1: .*address already in use"):
            etcd.start(tmp_path / "etcd", taken.getsockname()[1], peers.free_port(), tmp_path / "etcd.log")
