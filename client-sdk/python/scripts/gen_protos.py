#!/usr/bin/env python3
"""Generates the Python modules of cairn's protos (``proto/cairn/**/*.proto``).

The modules are generated, never edited by hand: by ``pip install`` (``setup.py``'s build
step calls :func:`generate` with the wheel's build directory), or by hand for a working
tree (``python scripts/gen_protos.py``, which writes into ``client-sdk/python/cairn/``;
those files are ignored by git).

Each proto file ``cairn/v1/app.proto`` becomes the module ``cairn.v1.app_pb2`` (and
``cairn.v1.app_pb2_grpc``), inside this package: the generated modules' own imports
(``from cairn.v1 import types_pb2``) then resolve without being rewritten. With
`mypy-protobuf <https://pypi.org/project/mypy-protobuf/>`_ installed (a build requirement
of the package), typed stubs (``.pyi``) are written beside them for the messages and the
gRPC services; without it, protoc's own message stubs (``--pyi_out``) are.

Needs ``grpcio-tools`` (which bundles protoc). Usage::

    python scripts/gen_protos.py [--proto DIR] [--out DIR] [--no-mypy]
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

#: The package directory (``client-sdk/python``).
HERE = Path(__file__).resolve().parent.parent

#: The generated packages, relative to the output directory; each gets an ``__init__.py``.
GENERATED_PACKAGES = ("cairn/v1", "cairn/bank", "cairn/bank/v1")

#: The file every generated package's ``__init__.py`` holds.
INIT_TEXT = '"""Generated from cairn\'s protos by scripts/gen_protos.py. Do not edit."""\n'


def find_proto_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The directory that holds ``cairn/v1/*.proto``.

    Looked for, in order: ``explicit``; the ``CAIRN_PROTO_DIR`` environment variable;
    ``proto/`` beside this package (an sdist carries a copy there); ``../../proto`` (the
    repository's, for a build from the working tree).
    """
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(Path(explicit))
    env = os.environ.get("CAIRN_PROTO_DIR")
    if env:
        candidates.append(Path(env))
    candidates += [HERE / "proto", HERE.parent.parent / "proto"]
    for candidate in candidates:
        if (candidate / "cairn" / "v1" / "app.proto").is_file():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"cairn's protos (cairn/v1/app.proto) are not in any of: {tried}; "
        "set CAIRN_PROTO_DIR to the repository's proto/ directory"
    )


def proto_files(proto_root: Path) -> list[Path]:
    """Every ``.proto`` under ``proto_root/cairn``, sorted (relative to ``proto_root``)."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / "cairn").rglob("*.proto"))


def _plugin(directory: Path, name: str, entry: str) -> Path:
    """An executable in ``directory`` that runs mypy-protobuf's ``entry`` (``main`` or
    ``grpc``) with this interpreter: found whether or not its console scripts are on PATH
    (a PEP 517 build environment may not put them there)."""
    code = f"import sys\nfrom mypy_protobuf.main import {entry}\nsys.exit({entry}())\n"
    if os.name == "nt":
        script = directory / f"{name}.py"
        script.write_text(code)
        wrapper = directory / f"{name}.cmd"
        wrapper.write_text(f'@"{sys.executable}" "{script}" %*\n')
        return wrapper
    wrapper = directory / name
    wrapper.write_text(f"#!{sys.executable}\n{code}")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def _has_mypy_protobuf() -> bool:
    """Whether mypy-protobuf (the stubs' plugins) is installed."""
    try:
        import mypy_protobuf.main  # noqa: F401
    except ImportError:
        return False
    return True


def clean(out_dir: Path) -> None:
    """Removes what an earlier run generated under ``out_dir`` (the generated packages)."""
    for package in ("cairn/v1", "cairn/bank"):
        target = out_dir / package
        if target.is_dir():
            shutil.rmtree(target)


def generate(
    out_dir: str | os.PathLike[str],
    proto_root: str | os.PathLike[str] | None = None,
    *,
    mypy: bool = True,
    quiet: bool = False,
) -> list[Path]:
    """Generates the modules (and stubs) of every cairn proto into ``out_dir``.

    ``out_dir`` is the directory that holds the ``cairn`` package (the package's build
    directory, or ``client-sdk/python``). Earlier output is removed first. Returns the files
    written. Raises ``RuntimeError`` if protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc  # a build requirement

    out = Path(out_dir).resolve()
    root = find_proto_root(proto_root)
    files = proto_files(root)
    if not files:
        raise RuntimeError(f"no .proto files under {root / 'cairn'}")
    clean(out)
    (out / "cairn").mkdir(parents=True, exist_ok=True)
    # protoc's own include directory: the well-known types (none used today, but an import
    # of google/protobuf/*.proto must resolve).
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    use_mypy = mypy and _has_mypy_protobuf()
    with tempfile.TemporaryDirectory(prefix="cairn-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={root}",
            f"--proto_path={well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
        ]
        if use_mypy:
            mypy_plugin = _plugin(Path(tmp), "protoc-gen-mypy", "main")
            grpc_plugin = _plugin(Path(tmp), "protoc-gen-mypy_grpc", "grpc")
            args += [
                f"--plugin=protoc-gen-mypy={mypy_plugin}",
                f"--plugin=protoc-gen-mypy_grpc={grpc_plugin}",
                f"--mypy_out=quiet:{out}",
                f"--mypy_grpc_out=quiet:{out}",
            ]
        else:
            args.append(f"--pyi_out={out}")
        args += [str(f) for f in files]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed (exit {code}): {' '.join(args[1:])}")
    for package in GENERATED_PACKAGES:
        init = out / package / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(INIT_TEXT)
    written = sorted(
        p
        for package in ("cairn/v1", "cairn/bank")
        for p in (out / package).rglob("*")
        if p.is_file()
    )
    if not quiet:
        print(
            f"generated {len(written)} files from {len(files)} protos ({root}) into {out / 'cairn'}"
            + ("" if use_mypy else " (without mypy-protobuf: message stubs only)"),
            file=sys.stderr,
        )
    return written


def main(argv: list[str] | None = None) -> int:
    """The command line: see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto", help="the directory holding cairn/v1/*.proto")
    parser.add_argument(
        "--out",
        default=str(HERE),
        help="the directory holding the cairn package (default: %(default)s)",
    )
    parser.add_argument(
        "--no-mypy", action="store_true", help="protoc's message stubs instead of mypy-protobuf's"
    )
    args = parser.parse_args(argv)
    generate(args.out, args.proto, mypy=not args.no_mypy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
