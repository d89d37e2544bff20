"""Model files: `NAME.joblib` (the scikit-learn estimator) + `NAME.manifest.json` beside it.

The manifest holds the feature names and order, the schema version the features read, the failure
kind, horizon and alarm threshold, the library versions it was trained with, the training sessions,
healthy reference values (for the reasons), and the sha256 of the joblib file.

Loading a joblib file runs code from it (it is a pickle). gpuwatch therefore loads a model only when
its manifest is there, its hash matches the file, its features are the ones this gpuwatch computes
and its scikit-learn is this one; `trust=True` (`--trust-model`) skips the hash check for a file you
made yourself and know. Any mismatch is one line (`ModelError`), never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuwatch.errors import GpuwatchError
from gpuwatch.predict.features import NAMES
from gpuwatch.recording import schema

MANIFEST_FORMAT = 1
# The shipped model: models/ in a checkout (where `gpuwatch train -o models/risk.joblib` writes it), else
# the copy a wheel carries inside the package (pyproject.toml: force-include), so `pip install gpuwatch`
# scores and guards with it too.
_CHECKOUT_MODEL = Path(__file__).resolve().parents[2] / "models" / "risk.joblib"
_PACKAGED_MODEL = Path(__file__).resolve().parents[1] / "models" / "risk.joblib"
DEFAULT_MODEL = _PACKAGED_MODEL if _PACKAGED_MODEL.exists() and not _CHECKOUT_MODEL.exists() else _CHECKOUT_MODEL


class ModelError(GpuwatchError):
    """A model file that cannot be used (missing, tampered, mismatched): one line, exit 1."""


MAX_MODEL_BYTES = 256 * 2**20  # far above any model gpuwatch writes (~1 MB); bounds what loading reads


def sha256(path: Path, limit: int = MAX_MODEL_BYTES) -> str:
    """The file's sha256, reading at most `limit` bytes (a device or an endless file is refused by
    `check_file` first; this bound holds even if it changes under us)."""
    h = hashlib.sha256()
    left = limit
    with open(path, "rb") as fh:
        while left > 0:
            block = fh.read(min(1 << 20, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def check_file(path: Path) -> None:
    """A model must be a regular file of sane size: a symlink to /dev/zero, a FIFO or a device
    would hang the hash and the unpickler (ModelError, one line)."""
    import stat

    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{path}: is a folder, not a model file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{path}: not a regular file (a device, FIFO or socket); refusing to read it")
    if st.st_size > MAX_MODEL_BYTES:
        raise ModelError(f"{path}: {st.st_size} bytes, more than any gpuwatch model ({MAX_MODEL_BYTES} at most)")


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".joblib") + ".manifest.json")


def lib_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("scikit-learn", "numpy", "joblib", "polars"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _minor(v: str | None) -> str:
    return ".".join((v or "").split(".")[:2])


def _major(v: str | None) -> int | None:
    try:
        return int((v or "").split(".")[0])
    except ValueError:
        return None


@dataclass
class RiskModel:
    estimator: Any
    manifest: dict[str, Any]
    path: Path | None = None
    reference: list[float] = field(default_factory=list)
    prior: Any = None  # predict/prior.ShapeLibrary from the manifest's "first_step" (None: older models)

    @property
    def threshold(self) -> float:
        return float(self.manifest["threshold"])

    @property
    def kind(self) -> str:
        return self.manifest.get("kind", "oom")

    @property
    def horizon_s(self) -> float:
        return float(self.manifest.get("horizon_s", 10.0))

    @property
    def label(self) -> str:
        name = self.path.name if self.path else "in-memory"
        return f"{name}@{self.manifest.get('sha256', '')[:12]}"


def save_model(estimator: Any, manifest: dict[str, Any], path: Path) -> Path:
    """Write the joblib file and its manifest (with the file's sha256), each atomically."""
    import joblib

    from gpuwatch.atomic import write_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda tmp: joblib.dump(estimator, tmp, compress=3))
    man = {"format": MANIFEST_FORMAT, "kind": "oom", "features": list(NAMES),
           "schema_version": schema.SCHEMA_VERSION, "versions": lib_versions(), **manifest,
           "file": path.name, "sha256": sha256(path)}
    mp = manifest_path(path)
    write_file(mp, json.dumps(man, indent=2, default=str) + "\n")
    return path


def check_output(path: Path, force: bool = False) -> None:
    """Before training: can the model and its manifest be written at `path`, and may they replace
    what is there? UsageError (one line) where not - so a long fit never ends in a failed write, and
    a shipped model is never overwritten by surprise."""
    from gpuwatch.atomic import check_output_file
    from gpuwatch.errors import UsageError

    path = Path(path)
    if not path.is_dir():  # a folder: check_output_file says so
        if path.suffix != ".joblib":
            raise UsageError(f"-o {path}: a model file ends in .joblib (its manifest and card go beside it)")
        if (path.exists() or manifest_path(path).exists()) and not force:
            shipped = " (the shipped model)" if path.resolve() == DEFAULT_MODEL.resolve() else ""
            raise UsageError(f"-o {path}: exists{shipped}; pass --force to replace it, or give another path")
    check_output_file(path, "-o", example="risk.joblib", create_parent=True)


def read_manifest(path: Path) -> dict[str, Any]:
    mp = manifest_path(path)
    if not mp.exists():
        raise ModelError(f"{path}: no manifest ({mp.name}) beside it; gpuwatch loads only models it wrote")
    try:
        import stat

        if not stat.S_ISREG(mp.stat().st_mode) or mp.stat().st_size > 16 * 2**20:
            raise ModelError(f"{mp}: not a regular manifest file of sane size")
        man = json.loads(mp.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{mp}: unreadable manifest ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(man, dict) or man.get("format") != MANIFEST_FORMAT:
        raise ModelError(f"{mp}: not a gpuwatch model manifest (format {man.get('format') if isinstance(man, dict) else '?'})")
    return man


def check_manifest(path: Path, man: dict[str, Any], trust: bool) -> None:
    if man.get("features") != list(NAMES):
        raise ModelError(f"{path}: trained on other features than this gpuwatch computes; retrain with `gpuwatch train`")
    if man.get("schema_version") not in schema.READABLE_VERSIONS:
        raise ModelError(f"{path}: schema version {man.get('schema_version')!r} unknown to this gpuwatch")
    have, want = lib_versions(), man.get("versions") or {}
    if _minor(have.get("scikit-learn")) != _minor(want.get("scikit-learn")):
        raise ModelError(f"{path}: trained with scikit-learn {want.get('scikit-learn')}, this is {have.get('scikit-learn')}; "
                         "retrain with `gpuwatch train` (minutes)")
    np_have, np_want = _major(have.get("numpy")), _major(want.get("numpy"))
    if np_have is not None and np_want is not None and np_have < np_want:  # a numpy-2 pickle under numpy 1
        raise ModelError(f"{path}: pickled with numpy {want['numpy']}, this is {have['numpy']}, which cannot load it; "
                         f"pip install 'numpy>={np_want}' (or retrain with `gpuwatch train`)")
    if not trust:
        digest = sha256(path)
        if digest != man.get("sha256"):
            raise ModelError(f"{path}: sha256 {digest[:12]}... does not match its manifest; refusing to load it "
                             "(a joblib file runs code when loaded; --trust-model overrides)")


def load_model(path: Path | str | None = None, trust: bool = False, threshold: float | None = None) -> RiskModel:
    """Load and check a model (default: models/risk.joblib). Raises ModelError (one line).
    `threshold` replaces the manifest's alarm threshold (`--risk-threshold`)."""
    path = Path(path) if path is not None else DEFAULT_MODEL
    if not path.exists():
        raise ModelError(f"{path}: no such model file" + (" (train one with `gpuwatch train`)" if path == DEFAULT_MODEL else ""))
    check_file(path)
    man = read_manifest(path)
    check_manifest(path, man, trust)
    try:
        import joblib

        est = joblib.load(path)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is one line
        raise ModelError(f"{path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})") from None
    if not hasattr(est, "predict_proba"):
        raise ModelError(f"{path}: not a classifier with predict_proba")
    if threshold is not None:
        man = {**man, "threshold": threshold}
    from gpuwatch.predict.prior import ShapeLibrary

    return RiskModel(est, man, path, list(man.get("reference") or [0.0] * len(NAMES)),
                     ShapeLibrary.from_json(man.get("first_step")))
