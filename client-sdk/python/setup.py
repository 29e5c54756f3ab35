"""The build step of cairn-sdk: generates the gRPC modules from cairn's protos.

Everything declarative is in pyproject.toml; this file adds what cannot be: the
``build_py`` step that runs ``scripts/gen_protos.py`` into the build directory (into the
source tree for an editable install), an ``sdist`` that carries the protos, and the runtime
requirements taken from the grpcio-tools the modules are generated with (generated code
needs a grpcio and a protobuf at least as new as the generator's).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cairn_gen_protos", HERE / "scripts" / "gen_protos.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[str]:
    """grpcio and protobuf, at least as new as what the bundled protoc generates for."""
    try:
        tools = metadata.version("grpcio-tools")
        requires = metadata.requires("grpcio-tools") or []
    except metadata.PackageNotFoundError:
        # Metadata only (no build environment): the oldest the SDK is written against.
        return ["grpcio>=1.66", "protobuf>=5.28"]
    grpc = f"grpcio>={tools}"
    protobuf = "protobuf>=5.28"
    for requirement in requires:
        found = re.match(r"^protobuf\s*(.*)$", requirement.split(";")[0].strip())
        if found:
            lower = re.search(r">=\s*([0-9][0-9.]*)", found.group(1))
            if lower:
                major = int(lower.group(1).split(".")[0])
                protobuf = f"protobuf>={lower.group(1)},<{major + 1}"
    return [grpc, protobuf]


class BuildPyWithProtos(build_py):
    """``build_py``, then the generated modules: into the build directory, or into the
    source tree for an editable install (which imports from there)."""

    def run(self) -> None:
        super().run()
        target = HERE if getattr(self, "editable_mode", False) else Path(self.build_lib)
        _gen_protos().generate(target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        build = Path(self.build_lib)
        for package in ("cairn/v1", "cairn/bank"):
            outputs += [str(p) for p in (build / package).rglob("*") if p.is_file()]
        return outputs


class SdistWithProtos(sdist):
    """An sdist that carries the protos (``proto/cairn/**``), so that it builds away from
    the repository."""

    def make_release_tree(self, base_dir: str, files: Any) -> None:
        super().make_release_tree(base_dir, files)
        root = _gen_protos().find_proto_root()
        for proto in (root / "cairn").rglob("*.proto"):
            target = Path(base_dir) / "proto" / proto.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proto, target)


setup(
    install_requires=_requirements(),
    cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithProtos},
)
