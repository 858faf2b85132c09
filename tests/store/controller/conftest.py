"""The etcd the controller tests share: one member for the module, each test in a key space of its own."""

import pytest

from tests.helpers.etcd import EtcdCluster, running_etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> EtcdCluster:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster
