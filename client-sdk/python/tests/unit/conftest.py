"""Test setup: the package (installed, or this working tree with its generated modules) and
the example bank, importable."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

try:
    import cairn.v1.app_pb2  # noqa: F401  (installed, or on the path already)
except ImportError:
    if not (ROOT / "cairn" / "v1" / "app_pb2.py").is_file():
        raise SystemExit(
            "cairn's generated modules are missing: `pip install ./client-sdk/python`, or "
            "`python client-sdk/python/scripts/gen_protos.py` for the working tree"
        ) from None
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_example(name: str) -> object:
    """Imports ``examples/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
