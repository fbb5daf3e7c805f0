"""Imports run one way: `tunefarm` (the core, embedded mode included) never imports
`services` or `tunefarm_app`, not even lazily; the measuring side (what runs on a device
agent) never imports the search; the device agent (`services/agent`) imports only the
measuring library, the core and the wire (`services/protocol`); and no two packages of
`services` import each other, even indirectly."""

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
    # The agent, the lease service and the wire between them, and the measuring library
    # (tunefarm/measure: builder, runner, task data, local measurer).
    forbidden = ("tunefarm.search", "services.scheduler", "services.worker")
    for package in ("services/agent", "services/lease", "services/protocol"):
        assert violations(package, forbidden) == []
    assert violations("tunefarm/measure", (*forbidden, "services", "tunefarm_app")) == []


AGENT_MAY_IMPORT = ("services.agent", "services.protocol", "tunefarm")
"""First-party packages a device agent may import (`tunefarm.search` excepted): what a
board runs is the agent, the wire to the lease service, the measuring library
(`tunefarm.measure`) and the core it stands on."""

AGENT_MAY_NOT_IMPORT = (
    "tunefarm.search", "tunefarm_app", "services.db", "services.lease", "services.scheduler", "services.worker",
    "services.api", "services.common", "services.measurer",
    "sqlalchemy", "alembic", "psycopg2", "redis", "rq", "pydantic", "pydantic_settings", "fastapi", "xgboost",
)  # fmt: skip
"""What is never on a board: the search, the server side, and the packages only the
farm's servers install (the `agent` extra has none of them)."""


def agent_violations(package: str) -> list[str]:
    """Imports of `package` a device agent may not make: any first-party module outside
    `AGENT_MAY_IMPORT`, or one of `AGENT_MAY_NOT_IMPORT`."""
    first_party = ("services", "tunefarm", "tunefarm_app")
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, module in imported_modules(path):
            top_allowed = any(module == a or module.startswith(a + ".") for a in AGENT_MAY_IMPORT)
            first = module.split(".")[0] in first_party
            forbidden = any(module == f or module.startswith(f + ".") for f in AGENT_MAY_NOT_IMPORT)
            if forbidden or (first and not top_allowed):
                bad.append(f"{rel}:{line} imports {module}")
    return bad


def test_the_agent_imports_only_the_measuring_library_the_core_and_the_wire():
    assert agent_violations("services/agent") == []
    assert agent_violations("services/protocol") == []  # the agent imports it


def test_the_agent_checker_sees_a_server_side_import(tmp_path, monkeypatch):
    fake = tmp_path / "services" / "agent"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(
        "from services.agent.settings import AgentSettings\nimport rq\n"
        "def f():\n    from services.common import artifacts\n    from tunefarm.search import tuner\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert agent_violations("services/agent") == [
        "services/agent/bad.py:2 imports rq",
        "services/agent/bad.py:4 imports services.common",
        "services/agent/bad.py:4 imports services.common.artifacts",
        "services/agent/bad.py:5 imports tunefarm.search",
        "services/agent/bad.py:5 imports tunefarm.search.tuner",
    ]


def test_starting_the_agent_loads_nothing_of_the_server_side():
    """What `tunefarm agent` imports, followed through every import (the static check
    sees one module at a time)."""
    code = (
        "import json, sys; import services.agent.cli\n"
        f"bad = {AGENT_MAY_NOT_IMPORT!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in bad))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def services_package_imports(root: Path) -> dict[str, set[str]]:
    """Which packages of `services` each package of it imports (`services.a` -> {`services.b`}),
    from every import statement of its modules, those inside functions included."""
    edges: dict[str, set[str]] = {}
    for path in sorted((root / "services").rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 3 or "generated" in parts or "migrations" in parts:
            continue
        package = f"services.{parts[1]}"
        for _, module in imported_modules(path):
            names = module.split(".")
            if names[0] == "services" and len(names) > 1 and f"services.{names[1]}" != package:
                edges.setdefault(package, set()).add(f"services.{names[1]}")
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of the graph, once each, as the packages around it (starting at the
    smallest name)."""
    cycles: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(edges.get(path[-1], ())):
            if nxt == path[0]:
                cycles.add(tuple(path))
            elif nxt not in path and nxt > path[0]:
                walk([*path, nxt])

    for start in sorted(edges):
        walk([start])
    return [list(c) for c in sorted(cycles)]


def test_no_two_services_packages_import_each_other():
    assert import_cycles(services_package_imports(ROOT)) == []


def test_the_cycle_checker_sees_a_cycle(tmp_path):
    for package, text in (("measurer", "from services.worker import jobs\n"),
                          ("worker", "def f():\n    from services.measurer import artifacts\n"),
                          ("api", "from services.db import models\n"), ("db", "")):  # fmt: skip
        (tmp_path / "services" / package).mkdir(parents=True)
        (tmp_path / "services" / package / "x.py").write_text(text)
    edges = services_package_imports(tmp_path)
    assert edges == {"services.measurer": {"services.worker"}, "services.worker": {"services.measurer"},
                     "services.api": {"services.db"}}  # fmt: skip
    assert import_cycles(edges) == [["services.measurer", "services.worker"]]


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
    (fake / "bad.py").write_text("from services.scheduler.farm_job import FarmJob\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("tunefarm", ("services",)) == ["tunefarm/bad.py:1 imports services.scheduler.farm_job",
                                                     "tunefarm/bad.py:1 imports services.scheduler.farm_job.FarmJob"]


def first_party_module_imports(root: Path) -> dict[str, set[str]]:
    """Which first-party modules each module imports (`tunefarm.a.b` -> {`tunefarm.c`}),
    from every import statement, those inside functions included; a name imported from a
    package counts as its module when it is one."""
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for package in ("tunefarm", "tunefarm_app", "services")
        for p in (root / package).rglob("*.py")
        if "generated" not in p.parts and "migrations" not in p.parts
    }
    edges: dict[str, set[str]] = {}
    for name, path in paths.items():
        for _, module in imported_modules(path):
            while module and module not in paths:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):
                edges.setdefault(name, set()).add(module)
    return edges


def test_no_module_imports_itself_through_others():
    assert import_cycles(first_party_module_imports(ROOT)) == []


def test_the_module_cycle_checker_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "tunefarm").mkdir()
    (tmp_path / "tunefarm" / "__init__.py").write_text("")
    (tmp_path / "tunefarm" / "a.py").write_text("from tunefarm import b\n")
    (tmp_path / "tunefarm" / "b.py").write_text("def f():\n    from tunefarm.a import g\n")
    (tmp_path / "tunefarm" / "c.py").write_text("import tunefarm.a\n")
    assert import_cycles(first_party_module_imports(tmp_path)) == [["tunefarm.a", "tunefarm.b"]]


STORAGE_LIBRARIES = ("sqlalchemy", "psycopg2", "alembic")


def test_only_the_database_package_imports_sqlalchemy():
    """Storage sits behind one interface: `services/db` (tables, sessions, queries by
    resource, migrations) is the only importer of SQLAlchemy, psycopg2 and Alembic."""
    bad = [
        v
        for package in ("tunefarm", "tunefarm_app", "services")
        for v in violations(package, STORAGE_LIBRARIES)
        if not v.startswith("services/db/")
    ]
    assert bad == []
