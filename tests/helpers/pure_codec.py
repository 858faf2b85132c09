"""The pure-Python codec loaded beside a compiled one, in one process: the reference ``make compiled`` is held to.

``pure_twin()`` executes the ``.py`` sources of the codec's modules under their own names while the compiled
ones are set aside, so the twin's modules import each other (never the compiled ones) and then returns them;
``sys.modules`` is left as it was. ``reasons`` is shared: it is not compiled. ``outcome`` turns what either
codec returned or raised into plain values that compare across the two (their classes differ).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

TWINNED = ("gateway.mqtt.properties", "gateway.mqtt.packets", "gateway.mqtt.template", "gateway.mqtt.codec")
"""The compiled modules, and ``packets`` and ``template``, whose classes hold the compiled ``Properties``, in import
order."""

BUILD = runpy.run_path(str(ROOT / "packaging" / "compile_codec.py"))
"""packaging/compile_codec.py's names (it is a script, not a package module)."""


def pure_twin() -> dict[str, ModuleType]:
    """``{name: module}`` of ``TWINNED`` executed from their Python sources."""
    saved = {name: sys.modules.pop(name) for name in TWINNED if name in sys.modules}
    try:
        twin = {}
        for name in TWINNED:
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.origin is not None, name
            source = Path(spec.origin).with_name(name.rsplit(".", 1)[1] + ".py")
            pure = importlib.util.spec_from_file_location(name, source)
            assert pure is not None and pure.loader is not None
            module = importlib.util.module_from_spec(pure)
            sys.modules[name] = module  # the next modules' imports (and dataclasses) find it here
            pure.loader.exec_module(module)
            twin[name] = module
        return twin
    finally:
        for name in TWINNED:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def to_twin(value: Any, twin: dict[str, ModuleType]) -> Any:
    """``value`` (a packet, or what a packet holds) rebuilt of the twin's classes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = next(getattr(module, type(value).__name__) for module in twin.values()
                   if hasattr(module, type(value).__name__))
        return cls(**{field.name: to_twin(getattr(value, field.name), twin) for field in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return tuple(to_twin(item, twin) for item in value)
    return value


def plain(value: Any) -> Any:
    """``value`` as nested tuples of class names and plain values, equal for equal packets of either codec."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(plain(getattr(value, field.name)) for field in dataclasses.fields(value)))
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, enum.Enum):
        return (type(value).__name__, value.name, value.value)
    return value


def outcome(call: Any, *args: Any) -> Any:
    """``plain(call(*args))``, or the error it raised as (class name, reason, message)."""
    try:
        return plain(call(*args))
    except Exception as exc:  # compared, not swallowed: both codecs must raise the same
        return ("raised", type(exc).__name__, plain(getattr(exc, "reason", None)), str(exc))
