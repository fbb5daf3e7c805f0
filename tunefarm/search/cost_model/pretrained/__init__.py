"""The pretrained cost models shipped in the package, one file per device family.

`tunefarm tune` and `tune-op` start a target with no cost model of its own from the
pretrained base of its family (`cache.start_cost_model`; `--no-pretrained` turns it off):
this directory's `<family>.npz` (`device_family`: `x86.npz`, `arm.npz`, `cuda.npz`), or
the directory named by the environment variable `TUNEFARM_PRETRAINED_DIR` (tests, or a
base trained on one's own dataset with `tunefarm pretrain`).

A file is the trees of a `BaseTrees` and its metadata (`save_pretrained`): the feature
version and width and the descriptor version and width it was trained with, the TVM
release series (major.minor) whose kernels were measured, the objective, the classes (and
their targets), the numbers of programs, tasks and workloads it learnt from, those
workloads by name and key (`pretrain.trained_workloads`), and the dataset's provenance.
`load_pretrained` returns None with a note, never an exception, when there is no file or
it does not fit: another feature or descriptor layout, another TVM series, another family,
or an unreadable file. A run never fails because of it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.search.cost_model.base_trees import BaseTrees
from tunefarm.search.cost_model.descriptor import device_descriptor, device_family
from tunefarm.search.cost_model.xgb import XGBConfig, XGBCostModel

FORMAT = "tunefarm-pretrained-cost-model/1"
"""The file's format; a file of another format is ignored."""

DIRECTORY_ENV = "TUNEFARM_PRETRAINED_DIR"
"""Environment variable naming another directory of pretrained files."""


class PretrainedFileError(ValueError):
    """A file that is not a pretrained cost model of this format."""


def pretrained_dir() -> Path:
    """Where pretrained files are looked for: $TUNEFARM_PRETRAINED_DIR, else this package."""
    return Path(os.environ.get(DIRECTORY_ENV) or Path(__file__).parent)


def pretrained_path(target: dict[str, Any], directory: Path | None = None) -> Path:
    """The file of `target`'s device family."""
    return (directory or pretrained_dir()) / f"{device_family(target)}.npz"


def tvm_series() -> str:
    """This TVM's release series, "major.minor" ("0.27")."""
    import tvm

    return ".".join(str(tvm.__version__).split(".")[:2])


def save_pretrained(base: BaseTrees, path: str | os.PathLike[str], *, provenance: Mapping[str, Any]) -> Path:
    """Write `base` (its trees, scale and offset, `info`) to `path` with this TVM's series,
    the time and `provenance` (how the dataset was made) in its metadata; atomically."""
    from tunefarm import __version__

    path = Path(path)
    info = {**dict(base.info), "tvm": tvm_series(), "tunefarm": __version__,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "provenance": dict(provenance)}  # fmt: skip
    state = {"format": FORMAT, "base": {**base.state(), "info": info}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        try:
            np.savez(f, state=np.array(json.dumps(state)), trees=base.tree_bytes())
        except BaseException:
            f.close()
            os.unlink(f.name)
            raise
    os.chmod(f.name, 0o644)  # a file to ship and share, not the temporary file's 0600
    os.replace(f.name, path)
    return path


def read_pretrained(path: str | os.PathLike[str], *, nthread: int = 1) -> BaseTrees:
    """The base saved at `path` (its descriptor the zeros it was saved with). Raises
    PretrainedFileError for a file of another format, OSError/ValueError for an unreadable one."""
    with np.load(path, allow_pickle=False) as data:
        state = json.loads(str(data["state"]))
        trees = data["trees"]
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise PretrainedFileError(f"{os.fspath(path)} is not a pretrained cost model of format {FORMAT}")
    return BaseTrees.from_saved(state["base"], trees, nthread)


def incompatibility(base: BaseTrees, target: dict[str, Any]) -> str | None:
    """Why `base` cannot score `target`'s programs in this installation, or None."""
    from tunefarm.search.features import feature_width
    from tunefarm.search.space.rule_set import rule_set_for

    problem = base.incompatibility()
    if problem:
        return problem
    info = base.info
    version = rule_set_for(target).feature_version
    if info.get("feature_version") != version or info.get("feature_width") != feature_width(version):
        return (f"trained on features version {info.get('feature_version')!r} ({info.get('feature_width')!r} wide), "
                f"not {version} ({feature_width(version)} wide)")  # fmt: skip
    if info.get("tvm") != tvm_series():
        return f"measured with TVM {info.get('tvm')!r}, not {tvm_series()}"
    if info.get("family") != device_family(target):
        return f"trained for device family {info.get('family')!r}, not {device_family(target)!r}"
    return None


def describe(base: BaseTrees) -> str:
    """What a base learnt from, in one phrase."""
    info = base.info
    classes = info.get("classes") or {}
    return (f"{info.get('objective', '?')} objective, {info.get('programs', '?')} programs of {info.get('tasks', '?')} "
            f"tasks on {len(classes)} device class{'es' if len(classes) != 1 else ''}")  # fmt: skip


def load_pretrained(
    target: dict[str, Any], *, config: XGBConfig | None = None, directory: Path | None = None, path: Path | None = None
) -> tuple[XGBCostModel | None, str]:
    """A model with no history of its own over the pretrained base of `target`'s family
    (the file in `directory`, or the file `path` names), scoring for `target`'s
    descriptor, and a note saying what it is; (None, why) when there is no such file or
    it does not fit (module doc)."""
    if path is None:
        try:
            path = pretrained_path(target, directory)
        except Exception as exc:  # a target the ISA tables cannot place: no family, no file
            return None, f"no pretrained cost model for this target ({type(exc).__name__}: {exc})"
        if not path.is_file():
            return None, f"no pretrained cost model for {path.stem} in {path.parent}"
    elif not path.is_file():
        return None, f"no pretrained cost model {path}"
    try:
        base = read_pretrained(path, nthread=(config or XGBConfig()).nthread)
        problem = incompatibility(base, target)
        descriptor = None if problem else device_descriptor(target)
    except Exception as exc:  # any unreadable file: the shipped model must never stop a run
        return None, f"pretrained cost model {path} is unreadable ({type(exc).__name__}: {exc}); not used"
    if problem:
        return None, f"pretrained cost model {path} was {problem}; not used"
    return XGBCostModel(config, base=base.with_descriptor(descriptor)), f"pretrained cost model {path} ({describe(base)})"
