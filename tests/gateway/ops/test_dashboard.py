"""The dashboard page (gateway/ops/dashboard.html) in headless Chromium: it loads from the node alone, shows a
connected client, and its figures change after traffic.

Selenium drives Debian's chromium through chromium-driver (`make test-deps` installs both): the driver
comes from the same Debian build as the browser, so nothing is downloaded. Without them the test skips.
"""

import os
import shutil
import uuid
from contextlib import ExitStack
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connected, properties, running_node
from paho.mqtt.packettypes import PacketTypes

from gateway.auth.passwords import PasswordFile
from tests.helpers.cluster import pop_once, running_cluster
from tests.helpers.admin import admin_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip("Debian's chromium and chromium-driver are not installed (make test-deps, as root)",
                allow_module_level=True)

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

ADMINISTRATIVE_ACTION = 0x98


@pytest.fixture
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_the_dashboard_shows_clients_and_live_figures(tmp_path, browser):
    run = uuid.uuid4().hex[:6]
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0") as node:
        admin = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        with connected(node.port, client_id=f"dash-{run}") as device:
            device.subscribe(f"dash{run}/#", 1)
            browser.get(f"http://127.0.0.1:{admin}/")
            wait = WebDriverWait(browser, WAIT_S)
            wait.until(lambda b: f"dash-{run}" in b.find_element(By.ID, "clients").text)
            assert browser.find_element(By.ID, "connections").text == "1"
            assert browser.find_element(By.ID, "status").text.startswith("live")
            received = int(browser.find_element(By.ID, "messages-in").text)
            sent = int(browser.find_element(By.ID, "messages-out").text)
            for i in range(20):
                device.publish(f"dash{run}/t", str(i).encode(), 1)
            device.receive(20)
            wait.until(lambda b: int(b.find_element(By.ID, "messages-in").text) == received + 20)
            wait.until(lambda b: int(b.find_element(By.ID, "messages-out").text) == sent + 20)
            assert browser.execute_script("return history.some((point) => point.in > 0 && point.out > 0)")
            browser.save_screenshot(str(tmp_path / "dashboard.png"))
            browser.find_element(By.CSS_SELECTOR, "nav button[data-view=cluster]").click()
            wait.until(lambda b: len(rows(b, "nodes")) == 1)
            (node_row,) = rows(browser, "nodes")
            assert node_row[1:3] == ["embedded", str(node.proc.pid)] and node_row[0].endswith("(this node)")
            assert float(node_row[3]) >= 0 and float(node_row[4]) > 1 and node_row[5] == "1"  # CPU %, MiB, clients
            browser.find_element(By.CSS_SELECTOR, "nav button[data-view=clients]").click()
        wait.until(lambda b: f"dash-{run}" not in b.find_element(By.ID, "clients").text)
        assert browser.find_element(By.ID, "connections").text == "0"
    assert not [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
                and "/api/v1/overview" not in entry["message"]]  # the page itself has no script errors


PAGE_SIZE = 20  # dashboard.html's PAGE_SIZE
SCREENSHOT_ENV = "LIGHTGATE_SCREENSHOT"
"""Where the clients view is saved (e.g. bench/results/dashboard.png, to refresh the committed one); by default
the test's own directory, so a test run leaves the checkout as it was."""


def rows(browser, table: str) -> list[list[str]]:
    """The cells' text of a table's body rows (an "empty" row is no row)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#' + arguments[0] + ' tbody tr')]"
        ".filter((tr) => !tr.querySelector('td.empty'))"
        ".map((tr) => [...tr.cells].map((td) => td.textContent));", table)


def client_ids(browser) -> list[str]:
    return [row[0] for row in rows(browser, "clients")]


def test_clients_are_searched_sorted_paged_and_kicked_and_the_views_show_the_node(tmp_path, browser):
    """27 real clients: the page shows 20 sorted by the node, pages, searches, kicks one (the client gets
    DISCONNECT 0x98, Administrative action); the subscriptions and retained views and the lag and
    authentication-failure cards show what clients did."""
    run = uuid.uuid4().hex[:6]
    passwords = PasswordFile.load_or_empty(tmp_path / "users.txt")
    passwords.set_password("alice", "alice-pw")
    passwords.save()
    devices = [f"dev-{run}-{i:02d}" for i in range(25)]
    others = [f"probe-{run}-a", f"probe-{run}-b"]
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0", "--auth-password-file", str(passwords.path),
                      "--auth-allow-anonymous", "true", "--auth-failure-delay-s", "0") as node, ExitStack() as stack:
        admin = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        clients = {cid: Client(node.port, cid, protocol=mqtt.MQTTv5) for cid in devices + others}
        for client in clients.values():
            stack.callback(client.paho.loop_stop)
            stack.callback(client.paho.disconnect)
            client.connect()
        laggard = Client(node.port, f"laggard-{run}", protocol=mqtt.MQTTv5, clean=False)
        laggard.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=300))
        laggard.subscribe(f"dash{run}/#", 1)
        laggard.disconnect()  # its session waits: what is published now is its lag
        publisher = clients[devices[0]]
        for i in range(7):
            publisher.publish(f"dash{run}/t", str(i).encode(), 1)
        publisher.publish(f"dash{run}/status", b"online", 1, retain=True)
        intruder = Client(node.port, f"intruder-{run}", protocol=mqtt.MQTTv5)
        intruder.paho.username_pw_set("alice", "wrong")
        intruder.paho.connect("127.0.0.1", node.port)
        intruder.paho.loop_start()
        assert intruder.connacks.get(timeout=WAIT_S)[1].is_failure  # refused: Bad User Name or Password
        intruder.paho.disconnect()
        intruder.paho.loop_stop()
        everyone = sorted(devices + others)

        browser.get(f"http://127.0.0.1:{admin}/")
        wait = WebDriverWait(browser, WAIT_S)
        wait.until(lambda b: b.find_element(By.ID, "page-info").text == f"1–20 of {len(everyone)}")
        assert client_ids(browser) == everyone[:PAGE_SIZE]  # sorted by client id, ascending
        browser.find_element(By.CSS_SELECTOR, "#clients th[data-sort=client_id]").click()
        wait.until(lambda b: client_ids(b) == everyone[::-1][:PAGE_SIZE])  # descending
        browser.find_element(By.ID, "next").click()
        wait.until(lambda b: client_ids(b) == everyone[::-1][PAGE_SIZE:])
        assert browser.find_element(By.ID, "page-info").text == f"21–27 of {len(everyone)}"
        assert not browser.find_element(By.ID, "next").is_enabled()
        browser.find_element(By.ID, "client-search").send_keys(f"PROBE-{run}")  # case does not matter
        wait.until(lambda b: client_ids(b) == others[::-1])
        assert browser.find_element(By.ID, "page-info").text == "1–2 of 2"

        browser.execute_script(  # found and clicked at once: the table is drawn again at every poll
            "[...document.querySelectorAll('#clients tbody tr')].find((tr) => tr.cells[0].textContent === arguments[0])"
            ".querySelector('button.kick').click();", others[0])
        reason = clients[others[0]].disconnects.get(timeout=WAIT_S)  # the client sees the server's DISCONNECT
        clients[others[0]].paho.loop_stop()  # paho would connect again
        assert getattr(reason, "value", reason) == ADMINISTRATIVE_ACTION
        wait.until(lambda b: client_ids(b) == [others[1]])
        assert browser.find_element(By.ID, "notice").text == f"disconnected {others[0]}"
        assert clients[others[1]].paho.is_connected()

        wait.until(lambda b: b.find_element(By.ID, "worst-session-lag").text == "8")  # 7 + the retained one
        assert f"laggard-{run}" in browser.find_element(By.ID, "worst-session").text
        wait.until(lambda b: b.find_element(By.ID, "auth-failed").text == "1")
        assert "alice" in browser.find_element(By.ID, "auth-failures").text
        for card in ("lag-card", "auth-card"):  # above the fold of a 1400x1000 window
            assert browser.execute_script(
                "return document.getElementById(arguments[0]).getBoundingClientRect().bottom", card) <= 1000

        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=subscriptions]").click()
        wait.until(lambda b: [f"laggard-{run}", "no", f"dash{run}/#", "1", "–", "0", "8", "8"] in rows(b, "subscriptions"))
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=retained]").click()
        wait.until(lambda b: any(r[0] == f"dash{run}/status" and r[3] == "online" for r in rows(b, "retained")))
        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=node]").click()
        wait.until(lambda b: b.find_element(By.ID, "queues").text.count(f"dash{run}/#") == 1)

        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=clients]").click()
        browser.find_element(By.ID, "client-search").clear()
        browser.find_element(By.ID, "client-search").send_keys(f"-{run}-")
        wait.until(lambda b: b.find_element(By.ID, "page-info").text == f"1–20 of {len(everyone) - 1}")
        screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(screenshot))
    assert not [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
                and "/api/v1/" not in entry["message"]]  # the page itself has no script errors


def test_a_cluster_gateways_dashboard_lists_and_kicks_the_clients_of_every_gateway(tmp_path, browser):
    """One store, two gateways: the second's dashboard lists the clients of both and kicks one on the first."""
    run = uuid.uuid4().hex[:6]
    with running_cluster(tmp_path) as (store, gateways), ExitStack() as stack:
        ids = [f"gw-{run}-{i}" for i in range(3)]
        clients = {}
        for client_id, gateway in zip(ids, (gateways[0], gateways[1], gateways[0])):
            clients[client_id] = Client(gateway.port, client_id, protocol=mqtt.MQTTv5)
            clients[client_id].paho.reconnect_delay_set(60, 60)  # paho reconnects by itself; not within this test
            stack.callback(clients[client_id].paho.loop_stop)
            stack.callback(clients[client_id].paho.disconnect)
            clients[client_id].connect()
        browser.get(f"http://127.0.0.1:{admin_port(gateways[1])}/")
        wait = WebDriverWait(browser, WAIT_S)
        browser.find_element(By.ID, "client-search").send_keys(run)
        wait.until(lambda b: client_ids(b) == ids)
        assert browser.find_element(By.ID, "page-info").text == "1–3 of 3"
        browser.execute_script(
            "[...document.querySelectorAll('#clients tbody tr')].find((tr) => tr.cells[0].textContent === arguments[0])"
            ".querySelector('button.kick').click();", ids[2])
        reason = clients[ids[2]].disconnects.get(timeout=WAIT_S)  # closed on the first gateway
        assert getattr(reason, "value", reason) == ADMINISTRATIVE_ACTION
        wait.until(lambda b: client_ids(b) == ids[:2])

        browser.find_element(By.CSS_SELECTOR, "nav button[data-view=cluster]").click()  # each gateway has a client
        wait.until(lambda b: len(rows(b, "nodes")) == 3)
        nodes = rows(browser, "nodes")
        assert [(row[1], row[2]) for row in nodes][0] == ("store", str(store.proc.pid))
        assert {(row[1], row[2]) for row in nodes[1:]} == {("gateway", str(g.proc.pid)) for g in gateways}
        assert [row[0].endswith("(this node)") for row in nodes].count(True) == 1
        assert all(float(row[3]) >= 0 and float(row[4]) > 1 for row in nodes)  # CPU %, resident MiB
        assert browser.find_element(By.ID, "nodes-missing").text == ""
    for process in (store, *gateways):
        assert not process.errors(), process.errors()


def test_the_dead_letters_view_lists_a_groups_letters_and_re_drives_them(tmp_path, browser):
    """A POP group's message popped once and never acknowledged is dead-lettered; the view lists it for the group
    the operator types (GET /api/v1/dlq/{group}) and its button appends it back to its topic (POST)."""
    run = uuid.uuid4().hex[:6]
    group, topic = f"workers{run}", f"jobs{run}/a"
    with running_cluster(tmp_path, 1) as (store, (gateway,)):
        with connected(gateway.port) as subscriber:
            subscriber.subscribe(f"jobs{run}/#", 1)
            assert pop_once(store.port, group, topic, b"poison", f"jobs{run}/#") == [1]
            assert [m.payload for m in subscriber.receive(1)] == [b"poison"]
            browser.get(f"http://127.0.0.1:{admin_port(gateway)}/")
            wait = WebDriverWait(browser, WAIT_S)
            browser.find_element(By.CSS_SELECTOR, "nav button[data-view=dlq]").click()
            wait.until(lambda b: "type a POP group" in b.find_element(By.ID, "dlq").text)
            browser.find_element(By.ID, "dlq-group").send_keys(group + "\n")  # Enter: the field's change event
            wait.until(lambda b: [r[1:7] + r[8:] for r in rows(b, "dlq")] ==
                       [[topic, "dev-1", "1", "0", "1", "poison", "no"]])  # the revive step dead-lettered it
            assert browser.find_element(By.ID, "dlq-info").text == "1 not re-driven yet"
            browser.find_element(By.ID, "redrive").click()
            again = subscriber.receive(1)  # appended back to its original topic
            assert [(m.topic, m.payload) for m in again] == [(topic, b"poison")]
            wait.until(lambda b: [r[-1] for r in rows(b, "dlq")] == ["yes"])
            assert not browser.find_element(By.ID, "redrive").is_enabled()
            assert browser.find_element(By.ID, "notice").text == f"re-drove 1 dead letters of {group} to their topics"
    assert not [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
                and "/api/v1/" not in entry["message"]]  # the page itself has no script errors
    for process in (store, gateway):
        assert not process.errors(), process.errors()
