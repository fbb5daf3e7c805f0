"""One cost model per device class, shared by every job of the class, across teams.

Ansor trains one model per tuning run. The farm measures many models on the same kind
of board, so it keeps one model per device class and lets every job of the class rank
with it: a job on a known class starts from what earlier jobs learnt (its first batch is
already ranked by a trained model) instead of from random scores.

- `ClassModel`: a class's `XGBCostModel` in this process, the measurements it has
  learnt (every measurement of the class vouched for up to `seen_through`, by
  `Measurement.vouched_seq`) and the saved version it derives from.
- `SharedModelView`: what a job's `TuningSession` gets as its model. It predicts with
  the class's model; its `update` does nothing, because the class's model does not learn
  from sessions but from Postgres (`ClassModels.catch_up`): every measurement of the
  class vouched for, whichever job, team or scheduler process it came from, exactly
  once, in the order it was vouched for. Sessions' own retraining calls are therefore
  no-ops, and nothing is counted twice.
- `ClassModels`: loads a class's latest version (`cost_model_versions`) on first use and
  catches up on the measurements after it, retrains as measurements land (after each
  finished round of any of the class's jobs, and every `catch_up_secs` for measurements
  made elsewhere), and saves a new version every `save_every` measurements, when a job
  ends, and at shutdown. Versions count up per class; each row keeps its file (under
  `cost_models/<class id>/<sha256>.npz`), the training size and the last measurement id
  it includes, so the next version trains on what came after it.

Transfer: a class with no version of its own starts from the latest version of its
nearest class that has one (`tunefarm.search.cost_model.transfer`: same kind, then architecture
family, ISA overlap, cores), through `XGBCostModel.transferred`: that model's trees rank the
new class's first batch, and its measurements stay in the history as prior data whose
weight fades as the class's own measurements arrive. Every version the class then saves
names the version it descends from (`cost_model_versions.transferred_from_id`), and a job
that starts from such a model says so in its status (`ClassModel.transferred_from`).
`ClassModels(transfer=False)` starts such a class fresh instead. A transferred model
that carries a pretrained base (it, or its ancestor, started from one) keeps it, scoring
for the new class's device descriptor.

Pretrained: a class with no version of its own and no nearest class with one starts from
the shipped pretrained cost model of its device family
(`tunefarm.search.cost_model.pretrained`: `<family>.npz` of the package, or of the
directory `pretrained_dir` / TUNEFARM_PRETRAINED_DIR names), as an embedded run does
(`cache.start_cost_model`): the base's trees rank its first batch, and the class's own
trees learn on top of it from its measurements. The base is saved in every version the
class saves, so it stays under the class's model; a job says so in its status
(`ClassModel.pretrained`, `jobs.cost_model_pretrained`). `ClassModels(pretrained=False)`
starts such a class fresh instead. A version (or a nearest class's) whose base no longer
fits this installation (another feature or descriptor layout, another TVM series) is
not used, as a cached model's is not.

Only believed measurements train it: one agent with a valid token could otherwise teach
every team's model its invented timings. A measurement is vouched for
(`services.db.confirmations.vouch`, at each catch-up) once its agent is in good standing
(`services.db.trust`: a timing of it was confirmed, none below the timing floor, not
more disputed than confirmed, not quarantined); until then it waits (an honest agent's
first measurements are learnt once its first best is confirmed), and a flagged or
quarantined agent's never are. A time below the floor or disputed never is; a
quarantined agent's unconfirmed measurement vouched for before its quarantine is passed
over.

Emulated measurements never train it: a kernel timed by an agent under an emulator
(`MeasureRecord.emulated`, e.g. an aarch64 agent under qemu-user) has a checked output
but the emulator's cost, which ranks programs by how fast the emulator translates them,
not by how fast the board runs them. `catch_up` passes over them (they still count as
seen). A job on an emulated class still makes progress: its tuners keep each task's
fastest verified kernel by the emulated cost (flagged as such in the records and the
report), and propose with the class's model as it is (random scores while it has learnt
nothing).

Features: a measurement's features come from its task's program space (the same
`features_of` the tuner uses). Tasks of running jobs are taken from their tuners; other
tasks are rebuilt from their workload rows (`make_task`), once per process.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from services.common import artifacts
from services.db import class_models, confirmations, cost_models
from services.db.exceptions import DatabaseError
from services.db.models import CostModelVersion
from services.db.session import Session, SessionFactory, transaction
from services.scheduler.decoded_records import DecodedRecords
from tunefarm.errors import TargetError
from tunefarm.records import MeasureRecord
from tunefarm.search.cost_model import CostModel, XGBConfig, XGBCostModel, transfer
from tunefarm.search.cost_model import pretrained as shipped
from tunefarm.search.cost_model.descriptor import device_descriptor
from tunefarm.search.space.rule_set import rule_set_for
from tunefarm.search.task import SearchTask, make_task
from tunefarm.workloads.base import workload_from_stored

CATCH_UP_CHUNK = 2000
"""Measurements read per query while catching up."""


@dataclass(frozen=True)
class TransferSource:
    """The other class's version a class's model started from."""

    version_id: int
    device_class: str
    version: int
    why: str = ""  # how near that class is (`transfer.Similarity.describe`)


@dataclass
class ClassModel:
    """A device class's shared model in this process."""

    device_class_id: int
    target: dict[str, Any]
    model: XGBCostModel
    version_id: int | None  # the saved version it derives from (None: a fresh model)
    version: int | None
    seen_through: int  # every measurement of the class vouched for up to this `vouched_seq` is learnt
    saved_samples: int  # model.num_samples when it was last saved or loaded
    dirty: bool = False  # a round of one of the class's jobs finished: catch up soon
    last_catch_up: float = field(default_factory=time.monotonic)
    tasks: dict[str, SearchTask | None] = field(default_factory=dict)  # task key -> task (None: unusable)
    transferred_from: TransferSource | None = None  # the model descends from another class's

    @property
    def start_version_id(self) -> int | None:
        """The saved version a job starting now starts from: the class's own, or, before
        the class saved one, the other class's its model was transferred from."""
        if self.version_id is not None:
            return self.version_id
        return self.transferred_from.version_id if self.transferred_from else None

    @property
    def unsaved(self) -> int:
        return self.model.num_samples - self.saved_samples

    @property
    def pretrained(self) -> dict[str, Any] | None:
        """The pretrained base under the class's model (`pretrained_summary`), or None."""
        return pretrained_summary(self.model)


def pretrained_summary(model: XGBCostModel) -> dict[str, Any] | None:
    """What the pretrained base under `model` learnt from, from its metadata (a job's
    report says so); None for a model without one."""
    base = model.base
    if base is None:
        return None
    info = base.info
    return {
        "family": info.get("family"), "objective": info.get("objective"), "programs": info.get("programs"),
        "tasks": info.get("tasks"), "classes": len(info.get("classes") or {}), "written": info.get("written"),
    }  # fmt: skip


class SharedModelView(CostModel):
    """A job's view of its class's model: predictions from it, no updates of its own."""

    learns_from_updates = False  # the class's model learns every measurement from Postgres

    def __init__(self, shared: ClassModel):
        self.shared = shared

    def update(
        self, features: Sequence[np.ndarray], costs: Sequence[float], groups: Sequence[str], *, train: bool = True
    ) -> None:
        """A no-op: the class's model learns every measurement from Postgres instead."""

    def predict(self, features: Sequence[np.ndarray]) -> np.ndarray:
        return self.shared.model.predict(features)

    def save(self, path: str | os.PathLike[str]) -> None:
        self.shared.model.save(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        raise NotImplementedError("a SharedModelView wraps a class's model; load the XGBCostModel instead")

    @property
    def num_samples(self) -> int:
        return self.shared.model.num_samples

    @property
    def trained_on(self) -> int:
        return self.shared.model.trained_on

    @property
    def ranks(self) -> bool:
        return self.shared.model.ranks


class ClassModels:
    def __init__(
        self,
        sessions: SessionFactory,
        artifact_root: Path,
        *,
        warmup: int,
        save_every: int,
        catch_up_secs: float,
        seed: int = 43,
        transfer: bool = True,
        pretrained: bool = True,
        pretrained_dir: Path | None = None,
        decoded: DecodedRecords | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ):
        """`decoded`: the process's decoded records, shared with its jobs' measurers.
        `pretrained_dir`: where the pretrained files are (None: `shipped.pretrained_dir()`)."""
        self.sessions = sessions
        self.decoded = decoded if decoded is not None else DecodedRecords()
        self.root = Path(artifact_root)
        self.warmup = warmup
        self.save_every = save_every
        self.catch_up_secs = catch_up_secs
        self.seed = seed
        self.transfer = transfer
        self.pretrained = pretrained
        self.pretrained_dir = pretrained_dir
        self.log = log
        self.models: dict[int, ClassModel] = {}

    # -- getting one --------------------------------------------------------------------------

    def get(self, device_class_id: int, tasks: Mapping[str, SearchTask] | None = None) -> ClassModel:
        """The class's model, loaded from its latest version on first use and caught up
        with every measurement made since."""
        shared = self.models.get(device_class_id)
        if shared is None:
            shared = self._load(device_class_id)
            self.models[device_class_id] = shared
            self.catch_up(shared, tasks)
        return shared

    def _load(self, device_class_id: int) -> ClassModel:
        with transaction(self.sessions) as s:
            target = class_models.class_target(s, device_class_id=device_class_id)
            latest = cost_models.latest_cost_model_version(
                s, device_class_id=device_class_id, feature_version=rule_set_for(dict(target or {})).feature_version
            )
            source = _source(s, latest.transferred_from_id) if latest is not None else None
        if latest is not None:
            own = self._own_version(device_class_id, dict(target or {}), latest, source)
            if own is not None:
                return own
        if self.transfer:
            transferred = self._transferred(device_class_id, dict(target or {}))
            if transferred is not None:
                return transferred
        if self.pretrained:
            started = self._pretrained(device_class_id, dict(target or {}))
            if started is not None:
                return started
        return ClassModel(device_class_id, dict(target or {}), XGBCostModel(self._config()), None, None, 0, 0)

    def _config(self) -> XGBConfig:
        return XGBConfig(seed=self.seed, adaptive_training=False, num_warmup_samples=self.warmup)

    def _own_version(
        self, device_class_id: int, target: dict[str, Any], latest: CostModelVersion, source: TransferSource | None
    ) -> ClassModel | None:
        """The class's model from its latest version, or None when that file cannot be
        read or its pretrained base no longer fits (then the class starts as a new one)."""
        try:
            model = XGBCostModel.load(self.root / latest.path)
        except (OSError, ValueError) as exc:
            self.log(f"cost model version {latest.version} of class {device_class_id} unreadable ({exc}); starting fresh")
            return None
        problem = _base_problem(model, target)
        if problem:
            self.log(f"cost model version {latest.version} of class {device_class_id} started from a pretrained base "
                     f"{problem}; not used")  # fmt: skip
            return None
        self.log(
            f"class {device_class_id}: cost model version {latest.version} "
            f"({latest.trained_on} programs, measurements through #{latest.last_measurement_id})"
        )
        return ClassModel(
            device_class_id, target, model, latest.id, latest.version, latest.last_measurement_id or 0,
            model.num_samples, transferred_from=source,
        )  # fmt: skip

    def _pretrained(self, device_class_id: int, target: dict[str, Any]) -> ClassModel | None:
        """The class's model started from the pretrained model of its device family
        (module doc), or None when there is none that fits (said in the log)."""
        model, note = shipped.load_pretrained(target, config=self._config(), directory=self.pretrained_dir)
        if model is None:
            self.log(f"class {device_class_id}: a fresh cost model ({note})")
            return None
        self.log(f"class {device_class_id}: no cost model of its own or of a near class; starts from the {note}")
        return ClassModel(device_class_id, target, model, None, None, 0, 0)

    def _transferred(self, device_class_id: int, target: dict[str, Any]) -> ClassModel | None:
        """The class's model started from its nearest class's latest version (module doc),
        or None when no other class has one (or it cannot be read)."""
        with transaction(self.sessions) as s:
            others = [
                (dc.name, dict(dc.target or {}), version)
                for dc, version in cost_models.latest_cost_models_of_classes(
                    s, feature_version=rule_set_for(target).feature_version
                )
                if dc.id != device_class_id
            ]
        try:
            choice = transfer.nearest(target, [(name, t) for name, t, _ in others])
        except TargetError as exc:
            self.log(f"class {device_class_id}: no transfer ({exc})")
            return None
        if choice is None:
            return None
        version = next(v for name, _, v in others if name == choice.name)
        try:
            source = XGBCostModel.load(self.root / version.path)
        except (OSError, ValueError) as exc:
            self.log(f"class {device_class_id}: cost model of {choice.name} unreadable ({exc}); starting fresh")
            return None
        problem = _base_problem(source, target)
        if problem:
            self.log(f"class {device_class_id}: cost model of {choice.name} started from a pretrained base {problem}; "
                     "not transferred")  # fmt: skip
            return None
        model = source.transferred(choice.name, device_descriptor(target) if source.base is not None else None)
        why = choice.similarity.describe()
        self.log(
            f"class {device_class_id}: starts from class {choice.name}'s cost model version {version.version} "
            f"({model.num_prior} programs; {why})"
        )
        origin = TransferSource(version.id, choice.name, version.version, why)
        return ClassModel(device_class_id, target, model, None, None, 0, model.num_samples, transferred_from=origin)

    # -- learning -----------------------------------------------------------------------------

    def due(self, shared: ClassModel) -> bool:
        return shared.dirty or time.monotonic() - shared.last_catch_up >= self.catch_up_secs

    def catch_up(self, shared: ClassModel, tasks: Mapping[str, SearchTask] | None = None) -> int:
        """Vouch for the class's measurements whose agents are in good standing, and learn
        every measurement vouched for after `seen_through` but the emulated ones and those
        discredited since (retraining once per chunk); returns how many were read. `tasks`
        are the search tasks of running jobs by key (their feature caches are reused)."""
        with transaction(self.sessions) as s:
            confirmations.vouch(s, device_class_id=shared.device_class_id)
        learnt = 0
        while True:
            with transaction(self.sessions) as s:
                rows = class_models.vouched_measurements(
                    s, device_class_id=shared.device_class_id, after_seq=shared.seen_through, limit=CATCH_UP_CHUNK
                )
                decoded = self.decoded.known(mid for _seq, mid, _wid in rows)
                stored = class_models.measurement_records(
                    s, measurement_ids=[mid for _seq, mid, _wid in rows if mid not in decoded]
                )
            if not rows:
                break
            feats, costs, groups = [], [], []
            by_task: dict[str, list[MeasureRecord]] = {}
            workloads: dict[str, int] = {}
            for _seq, mid, workload_id in rows:
                record = decoded.get(mid) or self.decoded.decode(mid, stored[mid])
                if record.emulated:  # the emulator's cost, not the device's: never learnt
                    continue
                by_task.setdefault(record.task, []).append(record)
                workloads[record.task] = workload_id
            for key, records in by_task.items():
                task = tasks.get(key) if tasks else None
                if task is None:
                    task = self._task(shared, key, workloads[key])
                if task is None:
                    continue
                feats += task.record_features(records)
                costs += [r.cost for r in records]
                groups += [key] * len(records)
            if feats:
                shared.model.update(feats, costs, groups)
            shared.seen_through = rows[-1][0]
            learnt += len(rows)
        shared.dirty = False
        shared.last_catch_up = time.monotonic()
        return learnt

    def _task(self, shared: ClassModel, key: str, workload_id: int) -> SearchTask | None:
        """The search task of a key no running job has, rebuilt from its workload row."""
        if key in shared.tasks:
            return shared.tasks[key]
        task = None
        try:
            with transaction(self.sessions) as s:
                row = class_models.stored_workload(s, workload_id=workload_id)
            workload = workload_from_stored(key=row.key, name=row.name, module_json=row.module_json, n_outputs=row.n_outputs)
            task = make_task(workload, shared.target)
            if task.key != key:
                self.log(f"cost model: {key} rebuilds as {task.key}; its measurements are not learnt")
                task = None
        except DatabaseError:
            raise  # the database is away: try again later, do not remember the task as unusable
        except Exception as exc:  # a workload this version cannot analyse: skip its measurements
            self.log(f"cost model: cannot rebuild task {key} ({type(exc).__name__}: {exc})")
        shared.tasks[key] = task
        return task

    # -- versions -----------------------------------------------------------------------------

    def maybe_save(self, shared: ClassModel, *, force: bool = False) -> int | None:
        """Save a new version when `save_every` measurements were learnt since the last
        one (or any, when `force`); returns its version number, or None."""
        if shared.unsaved <= 0 or (not force and shared.unsaved < self.save_every):
            return None
        return self.save(shared)

    def save(self, shared: ClassModel) -> int:
        directory = self.root / artifacts.cost_model_dir(shared.device_class_id)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="model.", suffix=".npz", dir=directory)
        os.close(fd)
        try:
            shared.model.save(tmp)
            digest = _sha256(tmp)
            final = directory / f"{digest}.npz"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with transaction(self.sessions) as s:
            row = cost_models.add_cost_model_version(
                s,
                device_class_id=shared.device_class_id,
                feature_version=rule_set_for(shared.target).feature_version,
                path=final.relative_to(self.root).as_posix(),
                sha256=digest,
                size=final.stat().st_size,
                trained_on=shared.model.num_samples,
                last_measurement_id=shared.seen_through or None,
                transferred_from_id=shared.transferred_from.version_id if shared.transferred_from else None,
            )
            version_id, version = row.id, row.version
        shared.version_id, shared.version = version_id, version
        shared.saved_samples = shared.model.num_samples
        self.log(
            f"class {shared.device_class_id}: saved cost model version {version} "
            f"({shared.model.num_samples} programs, trained on {shared.model.trained_on})"
        )
        return version


def _base_problem(model: XGBCostModel, target: dict[str, Any]) -> str | None:
    """Why the pretrained base under `model` cannot score `target` here (None: it can, or
    there is none)."""
    if model.base is None:
        return None
    try:
        return shipped.incompatibility(model.base, target)
    except TargetError as exc:
        return f"not for this target ({exc})"


def _source(s: Session, version_id: int | None) -> TransferSource | None:
    """The transfer source a version names (None for a version of the class's own data)."""
    if version_id is None:
        return None
    version, device_class = class_models.version_origin(s, version_id=version_id)
    return TransferSource(version_id, device_class, version)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

