"""The README's minimal application is examples/jar.py, under 40 lines, and type-checks as
part of the examples."""

from __future__ import annotations

import re

from conftest import ROOT


def test_the_readme_shows_the_minimal_application() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing an application in Python", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    code = block.group(1)
    assert code == (ROOT / "examples" / "jar.py").read_text()
    assert len(code.splitlines()) < 40
    compile(code, "jar.py", "exec")
