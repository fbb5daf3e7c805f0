"""Imports run one way: `tunefarm` (the core, embedded mode included) never imports
`services` or `tunefarm_app`, not even lazily; the measuring side (what runs on a device
agent) never imports the search."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def violations(package: str, forbidden: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in exempt:
            continue
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{rel}:{line} imports {module}")
    return bad


def test_the_core_imports_nothing_above_it():
    assert violations("tunefarm", ("services", "tunefarm_app")) == []


def test_the_services_never_import_the_app_layer():
    assert violations("services", ("tunefarm_app",)) == []


def test_the_measuring_side_carries_no_search_code():
    # What a device agent runs: the agent and lease service (services/measurer) and the
    # measuring library (tunefarm/measure: builder, runner, task data, local measurer).
    forbidden = ("tunefarm.search", "services.scheduler", "services.worker")
    assert violations("services/measurer", forbidden) == []
    assert violations("tunefarm/measure", (*forbidden, "services", "tunefarm_app")) == []


def test_the_search_engine_is_a_library_of_the_core():
    """The search (`tunefarm.search`) imports nothing of the services or the app layer:
    embedded mode and the farm's scheduler both drive the same engine."""
    assert violations("tunefarm/search", ("services", "tunefarm_app")) == []


def test_importing_every_core_module_loads_nothing_above_it():
    core = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "tunefarm").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, json, sys\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('services', 'tunefarm_app'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The static check is not vacuous: a core module importing the farm's service is caught."""
    fake = tmp_path / "tunefarm"
    fake.mkdir()
    (fake / "bad.py").write_text("from services.scheduler.farm_job import JobRunner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("tunefarm", ("services",)) == ["tunefarm/bad.py:1 imports services.scheduler.farm_job",
                                                     "tunefarm/bad.py:1 imports services.scheduler.farm_job.JobRunner"]
