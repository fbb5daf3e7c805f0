"""The embedded cost model, kept between runs on the same target.

`tunefarm tune` and `tune-op` start from the model earlier runs on the same target
trained, so a new model's tasks are ranked by a trained model from their first round
instead of at random (the farm does the same per device class, in Postgres). The file
is per target: `$XDG_CACHE_HOME/tunefarm/cost_models/<target key>.npz` (`~/.cache`
without XDG_CACHE_HOME), or the one `--cost-model PATH` names; `--no-cost-model-cache`
starts from a fresh model and writes nothing.

The file is an `XGBCostModel` file whose metadata say what it is compatible with: the
cache format (`CACHE_FORMAT`), the feature version and width, and the target. A file
that cannot be read, or that was written for other features or another target, is
ignored with a warning (it is replaced at the end of the run); nothing here stops a
run. The model keeps the latest `MAX_PROGRAMS` programs, so its retraining stays
bounded however many runs fed it, and the identities of the programs it learnt
(`session.program_id`, in the metadata), so that a run resuming a records file does not
learn the measurements it made before the interruption twice. Two runs on one target at
the same time each save what they learnt; the last to finish wins.

A target with no cache file of its own yet starts from the cached model of its nearest
target (`tunefarm.search.cost_model.transfer.nearest`: same kind, then architecture family, ISA
overlap, core count), transferred (`XGBCostModel.transferred`): tune on one machine, then
another, and the second starts ranked, as a new device class in the farm does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunefarm.search.cost_model import XGBConfig, XGBCostModel
from tunefarm.search.features import feature_width
from tunefarm.search.space.rule_set import rule_set_for
from tunefarm.search.task import target_key
from tunefarm.target import describe

CACHE_FORMAT = 1
"""Version of the cache entry; a file of another version is ignored."""

MAX_PROGRAMS = 8192
"""Programs of history a cached model keeps (the latest ones)."""

WARMUP_SAMPLES = 64
"""A fresh model gives random scores until it has this many programs (or one batch)."""


def cache_dir() -> Path:
    """Where per-target cost models live: $XDG_CACHE_HOME/tunefarm/cost_models."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tunefarm" / "cost_models"


def cache_path(target: dict[str, Any]) -> Path:
    return cache_dir() / f"{target_key(target)}.npz"


def model_path(explicit: Path | None, target: dict[str, Any], *, use_cache: bool) -> Path | None:
    """The file a run loads its cost model from and saves it to: `explicit`
    (`--cost-model`), else the target's cache file, or None (`--no-cost-model-cache`)."""
    if explicit is not None:
        return explicit
    return cache_path(target) if use_cache else None


def fresh_model(seed: int, batch_size: int) -> XGBCostModel:
    # Retrain after every measured batch, not only when the data grew by 20% as
    # MetaSchedule's adaptive training does; start learning after the first batch.
    return XGBCostModel(
        XGBConfig(seed=seed, adaptive_training=False, num_warmup_samples=min(WARMUP_SAMPLES, batch_size))
    )


def load_cost_model(
    path: Path | None, target: dict[str, Any], *, seed: int, batch_size: int, log: Callable[[str], None]
) -> XGBCostModel:
    """The model saved at `path` if it is there and fits this target and these features;
    otherwise (with a warning when a file was there) a fresh one."""
    if path is None:
        return fresh_model(seed, batch_size)
    if not path.exists():
        nearest = nearest_cached(target) if path == cache_path(target) else None
        if nearest is None:
            return fresh_model(seed, batch_size)
        source, why = nearest
        try:
            model = transferred_model(source, target)
        except Exception as exc:  # any unreadable file: a cache must never stop a run
            log(f"warning: cost model {source} is unreadable ({type(exc).__name__}: {exc}); starting from a fresh one")
            return fresh_model(seed, batch_size)
        log(f"cost model: none for this target yet; starting from {source} ({model.num_prior} programs; {why})")
        return model
    try:
        model = XGBCostModel.load(path)
    except Exception as exc:  # any unreadable file: a cache must never stop a run
        log(
            f"warning: cost model {path} is unreadable ({type(exc).__name__}: {exc}); starting from a fresh one"
        )
        return fresh_model(seed, batch_size)
    problem = incompatibility(model, target)
    if problem:
        log(f"warning: cost model {path} was {problem}; starting from a fresh one")
        return fresh_model(seed, batch_size)
    log(f"cost model: {path} ({model.num_samples} programs of earlier runs, trained on {model.trained_on})")
    return model


def incompatibility(model: XGBCostModel, target: dict[str, Any]) -> str | None:
    """Why a loaded model does not fit this run, or None."""
    meta = model.metadata
    if meta.get("cache_format") != CACHE_FORMAT:
        return f"written in cache format {meta.get('cache_format')!r}, not {CACHE_FORMAT}"
    version = rule_set_for(target).feature_version
    width = feature_width(version)
    if meta.get("feature_version") != version or model.num_features not in (None, width):
        return (
            f"trained on features version {meta.get('feature_version')!r} ({model.num_features} wide), "
            f"not {version} ({width} wide)"
        )
    if meta.get("target_key") != target_key(target):
        return f"trained for target {meta.get('target')!r}"
    return None


def nearest_cached(target: dict[str, Any]) -> tuple[Path, str] | None:
    """The cache file of the target nearest to `target` among those cached with the
    features `target` uses, and why it is nearest; None when there is none."""
    from tunefarm.search.cost_model import transfer

    version = rule_set_for(target).feature_version
    candidates: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(cache_dir().glob("*.npz")):
        try:
            meta = XGBCostModel.read_metadata(path)
        except Exception:  # an unreadable file is no candidate
            continue
        other = meta.get("target")
        if meta.get("cache_format") == CACHE_FORMAT and meta.get("feature_version") == version and isinstance(other, dict):
            if target_key(other) != target_key(target):
                candidates.append((str(path), other))
    try:
        choice = transfer.nearest(target, candidates)
    except Exception:  # a target the ISA tables do not know: no transfer
        return None
    return (Path(choice.name), choice.similarity.describe()) if choice is not None else None


def transferred_model(source: Path, target: dict[str, Any]) -> XGBCostModel:
    """The model cached at `source` transferred to `target` (its trees, and its history
    as prior programs), with `target`'s metadata."""
    loaded = XGBCostModel.load(source)
    model = loaded.transferred(describe(loaded.metadata.get("target") or {}))
    model.metadata = {
        "cache_format": CACHE_FORMAT,
        "feature_version": rule_set_for(target).feature_version,
        "target_key": target_key(target),
        "target": target,
        "programs": [],
    }
    return model


def learnt_programs(model: XGBCostModel) -> list[str]:
    """The identities of the programs a loaded model learnt, in its history's order
    (empty for a fresh model); the run extends the list as the model learns."""
    learnt = [str(p) for p in model.metadata.get("programs") or ()]
    return learnt if len(learnt) == model.num_samples else []


def save_model(
    model: XGBCostModel,
    path: Path,
    target: dict[str, Any],
    *,
    learnt: list[str] | None = None,
    log: Callable[[str], None],
) -> None:
    """Write the model (latest `MAX_PROGRAMS` programs) with its metadata; `learnt`: the
    identities of its programs in the history's order (kept only when they match it).
    A failure to write is a warning (the run's results are already saved)."""
    aligned = learnt is not None and len(learnt) == model.num_samples
    model.trim_history(MAX_PROGRAMS)
    model.metadata = {
        "cache_format": CACHE_FORMAT,
        "feature_version": rule_set_for(target).feature_version,
        "target_key": target_key(target),
        "target": target,
        "programs": learnt[-MAX_PROGRAMS:] if aligned and learnt else [],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
    except OSError as exc:
        log(f"warning: could not save the cost model to {path} ({exc})")
