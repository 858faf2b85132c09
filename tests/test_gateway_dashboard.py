"""The dashboard page (gateway/ops/dashboard.html) in headless Chromium: it loads from the node alone, shows a
connected client, and its figures change after traffic.

Selenium drives Debian's chromium through chromium-driver (`make test-deps` installs both): the driver
comes from the same Debian build as the browser, so nothing is downloaded. Without them the test skips.
"""

import os
import shutil
import uuid

import pytest
from mqtt_fixtures import WAIT_S, connected, running_node

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


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
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
        wait.until(lambda b: f"dash-{run}" not in b.find_element(By.ID, "clients").text)
        assert browser.find_element(By.ID, "connections").text == "0"
    assert not [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
                and "/api/v1/overview" not in entry["message"]]  # the page itself has no script errors
