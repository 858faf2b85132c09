"""A port that is taken stops `lightgate serve` with one line naming the address and the option to change
(gateway/node/binding.py): exit status 1, no traceback, for the MQTT listener and the admin API alike."""

import socket
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port
from tests.helpers.processes import ROOT, WAIT_S

pytestmark = pytest.mark.slow  # a node process per case


@pytest.mark.parametrize(("taken", "option"), [("--port", "node.port (--port)"),
                                               ("--admin-port", "admin.port (--admin-port)")])
def test_a_taken_port_is_one_error_line_naming_the_address_and_the_option(tmp_path, taken, option):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--port": free_port(), "--admin-port": free_port(), taken: port}
        done = subprocess.run([sys.executable, "-m", "gateway.app.cli", "serve", "--data", str(tmp_path / "data"),
                               *(str(value) for pair in ports.items() for value in pair)],
                              capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1, done.stderr
    assert f"127.0.0.1:{port}" in errors[0] and option in errors[0] and "in use" in errors[0], errors
    assert "Traceback" not in done.stderr
