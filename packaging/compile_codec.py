"""``make compiled``: build the MQTT codec with mypyc, in place beside its Python source; ``make pure`` removes it.

Optional, and never in the way: the compiled modules are built from the very source files that stay the
reference (Python imports an extension module before the ``.py`` beside it, so nothing else changes), and any
failure here (no mypy, no C compiler, a compile error) removes whatever the build left and exits 0 with one
line saying why: the node then runs the pure-Python codec, as it does without ``make compiled``. The build
records its sources' hashes in ``MANIFEST``; the Makefile remakes a build whose sources changed before
``make run`` and ``make test``, and tests/gateway/mqtt/test_compiled_codec.py refuses a stale one.
docs/benchmarks.md#compiled-codec has the figures that chose these modules.

Usage: ``python packaging/compile_codec.py [--root DIR] [--remove]`` (``--root``: the source tree, default this
checkout's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULES = ("gateway/mqtt/properties.py", "gateway/mqtt/codec.py")
"""What is compiled: the decoder and encoder of every packet and the MQTT data types they are made of."""

GROUP = "gateway.mqtt.compiled"
"""The one shared library both modules are linked into (``gateway/mqtt/compiled__mypyc*.so``): calls between them
stay native, and it lives in their package, so an installed node finds it wherever it runs from."""

BUILD = Path("build") / "compiled"
MANIFEST = BUILD / "manifest.json"
"""``{source path: sha256}`` of the modules a build compiled."""


def source_hashes(root: Path) -> dict[str, str]:
    return {module: hashlib.sha256((root / module).read_bytes()).hexdigest() for module in MODULES}


def compiled_files(root: Path) -> list[Path]:
    """The extension modules a build leaves in the source tree."""
    packages = {(root / module).parent for module in MODULES}
    stems = {Path(module).stem for module in MODULES} | {GROUP.rsplit(".", 1)[1] + "__mypyc"}
    return sorted(path for package in packages for path in package.glob("*.so") if path.name.split(".")[0] in stems)


def remove(root: Path) -> None:
    for path in compiled_files(root):
        path.unlink()
    shutil.rmtree(root / BUILD, ignore_errors=True)


def build(root: Path) -> str | None:
    """Compile ``MODULES`` in place under ``root``; None when done, else why not (and nothing is left behind)."""
    remove(root)
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as exc:
        return f"{(exc.name or 'mypyc').split('.')[0]} is not installed (make compiled installs mypy)"
    work = root / BUILD
    cwd = Path.cwd()
    os.chdir(root)  # mypy names the modules by their paths from here
    try:
        extensions = mypycify(
            [*MODULES, "--follow-imports=silent", f"--cache-dir={work / 'mypy_cache'}"],
            group_name=GROUP, target_dir=str(work / "c"),
        )
        setup(name="lightgate-compiled-codec", ext_modules=extensions, script_args=[
            "--quiet", "build_ext", "--inplace", f"--build-temp={work / 'temp'}", f"--build-lib={work / 'lib'}",
        ])
    except (Exception, SystemExit) as exc:  # setuptools and mypyc report a failed build as SystemExit
        remove(root)
        why = (f"mypy or the compiler stopped with status {exc.code}: see above"
               if isinstance(exc, SystemExit) and not isinstance(exc.code, str) else str(exc) or type(exc).__name__)
        return f"the build failed ({why if len(why) <= 200 else why[:200] + ' ...'})"
    finally:
        os.chdir(cwd)
    if len(compiled_files(root)) != len(MODULES) + 1:
        remove(root)
        return "the build did not leave the extension modules expected"
    (root / MANIFEST).write_text(json.dumps(source_hashes(root), indent=1) + "\n")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: this checkout)")
    parser.add_argument("--remove", action="store_true", help="remove the compiled modules (make pure)")
    args = parser.parse_args(argv)
    args.root = args.root.resolve()
    if args.remove:
        remove(args.root)
        print("compiled codec removed: the node runs the pure-Python codec")
        return 0
    why_not = build(args.root)
    if why_not:
        print(f"compiled codec not built, the node runs the pure-Python codec: {why_not}")
    else:
        print(f"compiled codec built: {', '.join(MODULES)} (make pure removes it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
