"""The client list's search, sort and paging (gateway/ops/listing.py), and its merge over a cluster's nodes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.ops.admin import ClientInfo
from gateway.ops.listing import MAX_PAGE, SORT_KEYS, ClientQuery, QueryError, merge_pages

clients = st.lists(st.builds(
    ClientInfo, client_id=st.text("abAB-", min_size=1, max_size=4), username=st.none() | st.text("xyXY", max_size=2),
    peer=st.sampled_from(["10.0.0.1:1", "10.0.0.2:2"]), protocol=st.sampled_from(["3.1.1", "5.0"]),
    keep_alive_s=st.integers(0, 3), expiry_s=st.integers(0, 2), subscriptions=st.integers(0, 3),
    inflight=st.integers(0, 2)), unique_by=lambda c: c.client_id, max_size=30)
queries = st.builds(ClientQuery, search=st.sampled_from(["", "a", "X", "10.0.0.2"]), sort=st.sampled_from(SORT_KEYS),
                    descending=st.booleans(), offset=st.integers(0, 12), limit=st.none() | st.integers(1, 8))


@given(clients, queries, st.lists(st.integers(0, 2), min_size=30, max_size=30))
def test_a_page_merged_from_the_nodes_is_the_page_of_all_their_clients(everyone, query, nodes):
    """Clients spread over three nodes, each answering ``query.head()`` (as JSON objects, like another node's
    answer, or records): the merged page and count are those of one node holding them all."""
    parts = [[c for c, n in zip(everyone, nodes) if n == node] for node in range(3)]
    answers = [query.head().page(part) for part in parts]
    answers[1] = (answers[1][0], [_json(c) for c in answers[1][1]])
    total, page = merge_pages(query, answers)
    expected_total, expected = query.page(everyone)
    assert total == expected_total
    assert [c["client_id"] if isinstance(c, dict) else c.client_id for c in page] == \
        [c.client_id for c in expected]


def _json(client: ClientInfo) -> dict:
    return {name: getattr(client, name) for name in ClientInfo.__dataclass_fields__}


def test_a_search_matches_any_part_of_id_user_or_peer_whatever_the_case():
    people = [ClientInfo("Sensor-1", None, "10.0.0.9:5", "5.0", 60, 0, 0, 0),
              ClientInfo("pump", "SENSORS", "10.0.0.8:5", "5.0", 60, 0, 0, 0),
              ClientInfo("valve", None, "10.0.0.7:5", "5.0", 60, 0, 0, 0)]
    assert [c.client_id for c in ClientQuery(search="sensor").page(people)[1]] == ["Sensor-1", "pump"]
    assert [c.client_id for c in ClientQuery(search="0.0.7").page(people)[1]] == ["valve"]


@pytest.mark.parametrize("params", [{"sort": "password"}, {"order": "sideways"}, {"offset": "-1"}, {"offset": "x"},
                                    {"limit": "0"}, {"limit": str(MAX_PAGE + 1)}])
def test_a_bad_parameter_is_refused_by_name(params):
    with pytest.raises(QueryError, match=f"'{next(iter(params))}'"):
        ClientQuery.from_params(params)
