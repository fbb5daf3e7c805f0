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

Where a run's model starts (`start_cost_model`, first that applies; `CostModelStart`
says which, for the log and the run's report):
1. "file" / "cache": the run's own file (`--cost-model PATH`, else the target's cache
   file), when it is there and fits;
2. "nearest": the nearest cached target's model, transferred (only for the target's
   cache file, not an explicit `--cost-model`): this machine's own measurements on a
   similar device. If that model carries a pretrained base (it started from one), the
   base comes along, scoring for the new target's device descriptor;
3. "pretrained": the shipped pretrained base of the target's device family
   (`tunefarm.search.cost_model.pretrained`), unless `pretrained=False`
   (`--no-pretrained`); with `--no-cost-model-cache` too: the shipped model is part of
   the package, not what earlier runs left;
4. "fresh": random scores until the first batch is measured.
A model started from a base saves it with its own trees, so the target's next run starts
from both (a file whose base no longer fits this installation is ignored as a whole: its
own trees were trained on top of that base).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm.search.cost_model import XGBConfig, XGBCostModel
from tunefarm.search.cost_model import pretrained as shipped
from tunefarm.search.cost_model.descriptor import device_descriptor
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
    # Retrain whenever the session asks (`session.retrain_due` paces it by time), not only
    # when the data grew by 20% as MetaSchedule's adaptive training does; start learning
    # after the first batch.
    return XGBCostModel(
        XGBConfig(seed=seed, adaptive_training=False, num_warmup_samples=min(WARMUP_SAMPLES, batch_size))
    )


@dataclass(frozen=True)
class CostModelStart:
    """Which model a run started from (module doc): "file" (`--cost-model`), "cache" (the
    target's cache file), "nearest" (another target's cached model, transferred),
    "pretrained" (the shipped base) or "fresh"; the file it came from; and the note logged."""

    source: str
    path: str | None
    note: str

    def as_report(self) -> dict[str, Any]:
        return {"start": self.source, "file": self.path, "note": self.note}


def start_cost_model(
    path: Path | None,
    target: dict[str, Any],
    *,
    seed: int,
    batch_size: int,
    log: Callable[[str], None],
    pretrained: bool = True,
    pretrained_file: Path | None = None,
) -> tuple[XGBCostModel, CostModelStart]:
    """The model a run on `target` starts from and where it came from (module doc): the
    one saved at `path` if it is there and fits this target and these features (a warning
    when a file was there and does not), else the nearest cached target's (when `path` is
    the target's cache file), else the pretrained one (with `pretrained`: the shipped one
    of the target's family, or `pretrained_file`), else a fresh one."""
    own = "cache" if path is not None and path == cache_path(target) else "file"
    if path is not None and path.exists():
        try:
            model = XGBCostModel.load(path)
            problem = incompatibility(model, target)
        except Exception as exc:  # any unreadable file: a cache must never stop a run
            model, problem = None, f"unreadable ({type(exc).__name__}: {exc})"
        if model is not None and not problem:
            note = f"cost model: {path} ({model.num_samples} programs of earlier runs, trained on {model.trained_on})"
            log(note)
            return model, CostModelStart(own, str(path), note)
        log(f"warning: cost model {path} {'is' if model is None else 'was'} {problem}; starting without it")
    if own == "cache":
        started = _start_from_nearest(target, log)
        if started is not None:
            return started
    if pretrained:
        model, why = shipped.load_pretrained(target, config=fresh_model(seed, batch_size).config, path=pretrained_file)
        if model is not None:
            note = f"cost model: starting from the {why}"
            log(note)
            source = pretrained_file if pretrained_file is not None else shipped.pretrained_path(target)
            return model, CostModelStart("pretrained", str(source), note)
        note = f"cost model: a fresh one ({why})"
    else:
        note = "cost model: a fresh one (pretrained model switched off)"
    log(note)
    return fresh_model(seed, batch_size), CostModelStart("fresh", None, note)


def _start_from_nearest(target: dict[str, Any], log: Callable[[str], None]) -> tuple[XGBCostModel, CostModelStart] | None:
    nearest = nearest_cached(target)
    if nearest is None:
        return None
    source, why = nearest
    try:
        model = transferred_model(source, target)
    except Exception as exc:  # any unreadable file: a cache must never stop a run
        log(f"warning: cost model {source} is unreadable ({type(exc).__name__}: {exc}); not transferred")
        return None
    note = f"cost model: none for this target yet; starting from {source} ({model.num_prior} programs; {why})"
    log(note)
    return model, CostModelStart("nearest", str(source), note)


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
    if model.base is not None:
        problem = shipped.incompatibility(model.base, target)
        if problem:
            return f"started from a pretrained base {problem}"
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
    if loaded.base is not None:
        problem = shipped.incompatibility(loaded.base, target)
        if problem:
            raise ValueError(f"its pretrained base was {problem}")
    descriptor = device_descriptor(target) if loaded.base is not None else None
    model = loaded.transferred(describe(loaded.metadata.get("target") or {}), descriptor)
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
