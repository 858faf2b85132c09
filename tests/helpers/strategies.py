"""Hypothesis strategies for MQTT input: text, valid properties per packet, CONNECTs valid and mutated."""

from hypothesis import strategies as st

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connect
from gateway.mqtt.properties import EMPTY_PROPERTIES, PROPERTY_TABLE, PacketType, Properties, PropertyType

mqtt_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)


def properties_for(packet_type: PacketType, will: bool = False) -> st.SearchStrategy[Properties]:
    """Valid properties for one place, each allowed property present or absent at random."""
    allowed = {}
    for prop in PROPERTY_TABLE:
        if not (prop.in_will if will else packet_type in prop.packets):
            continue
        value = _value_strategy(prop)
        if prop.multiple:
            most = 3 if packet_type in prop.repeatable_in else 1
            allowed[prop.name] = st.lists(value, max_size=most).map(tuple)
        else:
            allowed[prop.name] = st.none() | value
    return st.builds(Properties, **allowed)


@st.composite
def mutated(draw) -> bytes:
    """A valid CONNECT with a few bytes flipped, inserted, deleted, or cut off."""
    data = bytearray(draw(connects()))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if kind == "flip" and where < len(data):
            data[where] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[where:where] = draw(st.binary(min_size=1, max_size=3))
        elif kind == "delete" and where < len(data):
            del data[where]
        elif kind == "cut":
            del data[where:]
    return bytes(data)


def _value_strategy(prop):
    if prop.type is PropertyType.BOOL:
        return st.booleans()
    if prop.type is PropertyType.STRING:
        return mqtt_text
    if prop.type is PropertyType.STRING_PAIR:
        return st.tuples(mqtt_text, mqtt_text)
    if prop.type is PropertyType.BINARY:
        return st.binary(max_size=12)
    low, high = prop.value_range
    return st.integers(low, high)


@st.composite
def connects(draw) -> bytes:
    """A valid CONNECT of either level, with most fields drawn."""
    level = draw(st.sampled_from([MQTT_311, MQTT_5]))
    five = level == MQTT_5
    username = draw(st.none() | mqtt_text)
    will = draw(st.booleans())
    props = EMPTY_PROPERTIES
    will_props = EMPTY_PROPERTIES
    if five:
        props = Properties(
            session_expiry_interval=draw(st.none() | st.integers(0, 0xFFFF_FFFF)),
            receive_maximum=draw(st.none() | st.integers(1, 0xFFFF)),
            maximum_packet_size=draw(st.none() | st.integers(1, 64)),
            topic_alias_maximum=draw(st.none() | st.integers(0, 0xFFFF)),
            request_problem_information=draw(st.none() | st.booleans()),
            user_properties=tuple(draw(st.lists(st.tuples(mqtt_text, mqtt_text), max_size=2))),
        )
        if will:
            will_props = Properties(will_delay_interval=draw(st.none() | st.integers(0, 0xFFFF_FFFF)))
    packet = Connect(
        level, draw(mqtt_text), draw(st.booleans()), draw(st.integers(0, 0xFFFF)), username,
        draw(st.none() | st.binary(max_size=8)) if username is not None or five else None,
        draw(mqtt_text.filter(bool)) if will else None, draw(st.binary(max_size=8)) if will else b"",
        draw(st.integers(0, 2)) if will else 0, draw(st.booleans()) if will else False, will_props, props,
    )
    return encode(packet, level)

