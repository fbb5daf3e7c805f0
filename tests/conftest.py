"""Shared helpers for the test-suite.

Small workloads are built with TE here so that tests do not depend on the registry's
benchmark-sized defaults.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest


def te_workload(name: str, build):
    """A Workload from a function returning TE tensors (inputs first, outputs last)."""
    from tunefarm.workloads import workload_from_te

    return workload_from_te(name, build())


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory):
    """`tunefarm tune` keeps its cost model under $XDG_CACHE_HOME: tests (and the
    processes they start) get a throw-away one, never the user's..."""
    path = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session", autouse=True)
def no_shipped_pretrained_model(tmp_path_factory):
    """Runs start from the shipped pretrained cost model of their device family when one
    ships (`tunefarm.search.cost_model.pretrained`): tests (and the processes they start,
    farms included: they inherit this environment) look in an empty directory instead,
    so that what they assume of a fresh start holds whatever the package ships. A test
    about the pretrained start sets its own directory (`monkeypatch.setenv`)."""
    from tunefarm.search.cost_model.pretrained import DIRECTORY_ENV

    path = tmp_path_factory.mktemp("no-pretrained")
    old = os.environ.get(DIRECTORY_ENV)
    os.environ[DIRECTORY_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(DIRECTORY_ENV, None)
    else:
        os.environ[DIRECTORY_ENV] = old


@pytest.fixture(autouse=True)
def fresh_cache_home(private_cache_home, monkeypatch, request):
    """...and one of their own each: a model one test's tuning kept must not steer another's."""
    path = private_cache_home / hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


@pytest.fixture(scope="session")
def host_target():
    from tunefarm.target import host_target_dict

    return host_target_dict()


# Farm database and Redis fixtures (a throw-away PostgreSQL database per module): see farm_fixtures.py.
from farm_fixtures import database_url, db_sessions, empty_database_url, redis_conn  # noqa: E402, F401

_SESSION_START = time.time()


def pytest_terminal_summary(terminalreporter):
    """Where the dashboard tests wrote their screenshots in this run (tests/browser.py)."""
    from browser import SCREENSHOTS

    shots = sorted(p for p in SCREENSHOTS.glob("*.png") if p.stat().st_mtime >= _SESSION_START) \
        if SCREENSHOTS.is_dir() else []
    if shots:
        terminalreporter.write_line(f"dashboard screenshots: {SCREENSHOTS} ({', '.join(p.name for p in shots)})")
