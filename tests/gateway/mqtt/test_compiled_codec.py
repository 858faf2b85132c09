"""The compiled codec (``make compiled``, packaging/compile_codec.py) is optional and behaves as its source does.

Optional: a build that cannot be made (no mypy, no C compiler) leaves the pure-Python codec and says so, exit 0,
so it never stands in the way of ``make run``. The same: where the compiled modules are loaded, every packet
drawn encodes to the same bytes or the same error as the pure-Python source (loaded beside it,
tests/helpers/pure_codec.py) encodes it to, and every stream, valid or mutated, decodes to the same packets and
the same error (every check of the codec: [MQTT-1.5.4-1] UTF-8, [MQTT-2.2.1-3] packet id 0, [MQTT-3.3.1-4] QoS 3,
[MQTT-3.1.2-24] Maximum Packet Size in ``fit`` and the rest). The whole suite runs against the
compiled modules when they are built in place (``make compiled test``) and against the source otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.bench.codec import is_compiled
from gateway.mqtt import codec
from gateway.mqtt import packets as p
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_5, MQTT_311
from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.pure_codec import BUILD, ROOT, outcome, plain, pure_twin, to_twin
from tests.helpers.strategies import connects, mqtt_text, properties_for

REQUIRED = "LIGHTGATE_TEST_COMPILED"
"""Set by the build test for its run of this module against the build it made: not compiled is then a failure."""

COMPILED = is_compiled(codec)

needs_compiled = pytest.mark.skipif(
    not COMPILED and not os.environ.get(REQUIRED),
    reason="the codec is not compiled here (make compiled builds it; the build test below checks one)")

needs_mypyc = pytest.mark.skipif(
    shutil.which("cc") is None or not importlib.util.find_spec("mypyc"),
    reason="mypy (make compiled installs it) or a C compiler is missing")


def test_the_codec_loaded_is_the_one_required():
    if os.environ.get(REQUIRED):
        assert COMPILED, "the build test's run must load the compiled codec"


@needs_compiled
def test_a_compiled_build_is_built_from_the_sources_beside_it():
    root = Path(codec.__file__).parents[2]  # the tree it was loaded from: gateway/mqtt/codec.*.so
    manifest = root / BUILD["MANIFEST"]
    recorded = json.loads(manifest.read_text()) if manifest.exists() else None
    assert recorded == BUILD["source_hashes"](root), (
        "the compiled codec is stale: its sources changed since `make compiled` (rebuild it, or `make pure`)")


# --- the build: optional, never in the way ------------------------------------------------------------


def _source_copy(tmp: Path) -> Path:
    """A copy of the gateway package to build in, so the build under test never touches this checkout."""
    shutil.copytree(ROOT / "gateway", tmp / "gateway", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp


def _build(root: Path, *prelude: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = ROOT / "packaging" / "compile_codec.py"
    code = "; ".join((*prelude, f"import runpy, sys; sys.argv = ['compile_codec', '--root', {str(root)!r}]",
                      f"runpy.run_path({str(script)!r}, run_name='__main__')"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def _assert_pure_left(root: Path, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    assert "compiled codec not built, the node runs the pure-Python codec" in result.stdout
    assert not list((root / "gateway").rglob("*.so")) and not (root / BUILD["BUILD"]).exists()
    for module in BUILD["MODULES"]:
        assert (root / module).read_bytes() == (ROOT / module).read_bytes()


def test_without_mypy_the_build_leaves_the_pure_codec(tmp_path):
    root = _source_copy(tmp_path)
    result = _build(root, "import sys; sys.modules['mypyc'] = None")
    _assert_pure_left(root, result)
    assert "mypyc is not installed" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_mypyc
def test_without_a_working_compiler_the_build_leaves_the_pure_codec(tmp_path):
    root = _source_copy(tmp_path)
    _assert_pure_left(root, _build(root, env={"CC": "false", "LDSHARED": "false"}))


@pytest.mark.slow
@pytest.mark.timeout(900)  # mypyc and gcc -O3 take 15 s of CPU, minutes on a busy machine
@needs_mypyc
def test_a_build_loads_compiled_and_agrees_with_the_source(tmp_path):
    root = _source_copy(tmp_path)
    result = _build(root)
    assert result.returncode == 0 and "compiled codec built" in result.stdout, result.stdout + result.stderr
    assert len(BUILD["compiled_files"](root)) == len(BUILD["MODULES"]) + 1
    # This module again, against the build: -P and --import-mode=append put the copy's gateway first.
    run = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "--import-mode=append",
         "-m", "not slow", str(Path(__file__))],
        cwd=root, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(root), REQUIRED: "1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


# --- the compiled codec agrees with its source -----------------------------------------------------------

TWIN = pure_twin() if COMPILED else None
reasons = st.sampled_from(list(ReasonCode))
packet_ids = st.integers(0, 0x10000)  # 0 and 65536 are refused: the errors must agree too
qos = st.integers(0, 3)


def _props(packet_type: PacketType) -> st.SearchStrategy[Any]:
    return st.just(EMPTY_PROPERTIES) | properties_for(packet_type)


def _acks(cls: type, packet_type: PacketType) -> st.SearchStrategy[Any]:
    return st.builds(cls, packet_ids, reasons, _props(packet_type))


packets = st.one_of(
    st.builds(p.Publish, mqtt_text, st.binary(max_size=24), qos, st.booleans(), st.booleans(),
              st.none() | packet_ids, _props(PacketType.PUBLISH)),
    _acks(p.Puback, PacketType.PUBACK), _acks(p.Pubrec, PacketType.PUBREC),
    _acks(p.Pubrel, PacketType.PUBREL), _acks(p.Pubcomp, PacketType.PUBCOMP),
    st.builds(p.Subscribe, packet_ids, st.lists(st.tuples(mqtt_text, st.builds(
        p.SubscriptionOptions, qos, st.booleans(), st.booleans(), st.integers(0, 3))), max_size=3).map(tuple),
        _props(PacketType.SUBSCRIBE)),
    st.builds(p.Suback, packet_ids, st.lists(reasons, max_size=3).map(tuple), _props(PacketType.SUBACK)),
    st.builds(p.Unsubscribe, packet_ids, st.lists(mqtt_text, max_size=3).map(tuple), _props(PacketType.UNSUBSCRIBE)),
    st.builds(p.Unsuback, packet_ids, st.lists(reasons, max_size=3).map(tuple), _props(PacketType.UNSUBACK)),
    st.builds(p.Connack, st.booleans(), reasons, _props(PacketType.CONNACK)),
    st.builds(p.Disconnect, reasons, _props(PacketType.DISCONNECT)),
    st.builds(p.Auth, reasons, _props(PacketType.AUTH)),
    st.just(p.Pingreq()), st.just(p.Pingresp()),
)
levels = st.sampled_from([MQTT_311, MQTT_5])
AGREE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@needs_compiled
@AGREE
@given(packets, levels, st.integers(0, 64))
def test_every_packet_encodes_alike(packet, level, limit):
    pure = TWIN["gateway.mqtt.codec"]
    twin = to_twin(packet, TWIN)
    assert outcome(encode, packet, level) == outcome(pure.encode, twin, level)
    assert outcome(codec.fit, packet, level, limit) == outcome(pure.fit, twin, level, limit)


@st.composite
def streams(draw: st.DrawFn) -> tuple[Role, int, list[bytes]]:
    """What a decoder is fed: a client's CONNECT and packets (SERVER role) or a server's packets (CLIENT role),
    the packets encodable at that level or not (those are left out), then a few mutations and cuts."""
    role = draw(st.sampled_from(list(Role)))
    wire = bytearray(draw(connects()) if role is Role.SERVER else b"")
    level = draw(levels)
    if wire:
        server = MqttDecoder(role=Role.SERVER)
        server.feed(bytes(wire))
        server.next_packet()
        level = server.protocol_level
    for packet in draw(st.lists(packets, max_size=4)):
        try:
            wire += encode(packet, level)
        except codec.LocalProtocolError:
            pass
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, max(len(wire) - 1, 0)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if kind == "flip" and wire:
            wire[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            wire[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif kind == "delete":
            del wire[at:at + draw(st.integers(1, 3))]
        else:
            del wire[at:]
    cuts = sorted(draw(st.lists(st.integers(0, len(wire)), max_size=3)))
    return role, level, [bytes(wire[a:b]) for a, b in zip([0, *cuts], [*cuts, len(wire)])]


NEED_DATA_PLAIN = plain(NEED_DATA)


def _decode(module: Any, role: Role, level: int, chunks: list[bytes]) -> list[Any]:
    """Everything a decoder of ``module`` said about ``chunks``: its packets, then NEED_DATA or its error."""
    decoder = module.MqttDecoder(role=module.Role(role.value), **({} if role is Role.SERVER else
                                                                  {"protocol_level": level}))
    said = []
    for chunk in chunks:
        decoder.feed(chunk)
        while True:
            said.append(outcome(decoder.next_packet))
            if said[-1][0] == "raised" or said[-1] == NEED_DATA_PLAIN:
                break
        if said[-1][0] == "raised":
            break
    return [*said, decoder.protocol_level]


@needs_compiled
@AGREE
@given(streams())
def test_every_stream_decodes_alike(stream):
    role, level, chunks = stream
    assert _decode(codec, role, level, chunks) == _decode(TWIN["gateway.mqtt.codec"], role, level, chunks)

