"""`pip install scorestack` serves and scores; compiling, vision models and the benchmarks are extras.

The proof runs the project in a **view** of the project environment that holds only what an install
would: a folder of links to the installed distributions in the dependency closure of pyproject.toml's
base dependencies (plus, for one view, an extra's), and the scorestack packages laid out as the wheel
installs them. A subprocess started with `python -S` sees that folder and nothing else of `.venv`, so
torch, onnx, scikit-learn, XGBoost... are not installed there, as in a fresh base install: imports and
`importlib.util.find_spec` both miss them. In it, a real Triton serves a model and the client scores
it; the commands that need an extra say which, with exit 2 and no traceback.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest
import typer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from scorestack.extras import EXTRAS, MissingExtra, extra_of, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Distributions (and the modules they import as) that a fraud or ranking service must not pull.
HEAVY_DISTRIBUTIONS = {
    "torch", "onnx", "onnxruntime", "skl2onnx", "onnxmltools", "onnxscript", "onnxconverter-common", "hummingbird-ml",
    "tl2cgen", "treelite", "xgboost", "xgboost-cpu", "scikit-learn", "matplotlib", "joblib",
}
HEAVY_MODULES = ("torch", "onnx", "onnxruntime", "skl2onnx", "onnxmltools", "onnxscript", "hummingbird", "tl2cgen", "treelite", "xgboost", "sklearn", "matplotlib", "joblib")


def _installed() -> dict[str, md.Distribution]:
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def closure(extras: tuple[str, ...] = ()) -> set[str]:
    """The installed distributions `pip install 'scorestack[extras]'` needs: pyproject's base
    dependencies and those extras (`scorestack[...]` inside an extra expands to its own extras), then
    each distribution's requirements with their markers and extras, read from the installed metadata."""
    wanted, ours, todo = [], set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra in ours:
            continue
        ours.add(extra)
        for line in PYPROJECT["optional-dependencies"][extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "scorestack":
                todo.extend(req.extras)
            else:
                wanted.append(req)
    wanted += [Requirement(line) for line in PYPROJECT["dependencies"]]
    installed = _installed()
    seen: dict[str, set[str]] = {}
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        assert name in installed, f"{req} is declared but not installed in {sys.prefix}: run scripts/setup.sh"
        if name in seen and set(req.extras) <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | set(req.extras)
        for line in installed[name].requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *seen[name]}):
                wanted.append(Requirement(str(sub).split(";")[0]))
    return set(seen)


def build_view(root: Path, extras: tuple[str, ...] = ()) -> Path:
    """A virtual environment (no pip, no system packages) whose site-packages links the top-level
    entries of every distribution in `closure(extras)`, and the scorestack packages where the wheel puts
    them (pyproject's package-dir). Its interpreter is returned: processes it starts (compile jobs)
    run in the same view."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    installed = _installed()
    for name in sorted(closure(extras)):
        dist = installed[name]
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or ()}
        for top in sorted(tops - {"..", "__pycache__"}):
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    package = site / "scorestack"
    package.mkdir()
    for src in (ROOT / "scorestack").glob("*.py"):
        (package / src.name).symlink_to(src)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for dotted, folder in setuptools["package-dir"].items():
        if dotted.count(".") == 1:
            (package / dotted.split(".")[1]).symlink_to(ROOT / folder)
    return python


def run_in(python: Path, code: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` with the view's interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", COLUMNS="250", OMP_NUM_THREADS="1")
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def scorestack_command(python: Path, args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """`scorestack ARGS` (the console script's entry point) in the view."""
    return run_in(python, f"import sys\nsys.argv = ['scorestack', *{args!r}]\nfrom scorestack.cli import main\nmain()\n", cwd, timeout)


@pytest.fixture(scope="module")
def base_python(tmp_path_factory) -> Path:
    return build_view(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def compile_python(tmp_path_factory) -> Path:
    return build_view(tmp_path_factory.mktemp("compile"), ("compile",))


def test_the_base_install_pulls_no_compiler_vision_or_plotting_stack():
    base = closure()
    assert base & HEAVY_DISTRIBUTIONS == set()
    assert {"tritonclient", "grpcio", "feast", "redis", "hiredis", "typer", "cryptography", "prometheus-client"} <= base
    with_compile = closure(("compile",))
    assert {"onnx", "onnxruntime", "scikit-learn", "xgboost-cpu", "tl2cgen"} <= with_compile
    assert "torch" not in with_compile and "hummingbird-ml" not in with_compile
    assert {"torch", "scikit-learn"} <= closure(("vision",))
    assert {"hummingbird-ml", "torch"} <= closure(("hummingbird",))
    # The test suite's extra brings every stack the tests, the demo and the benchmarks use.
    assert HEAVY_DISTRIBUTIONS - {"xgboost", "matplotlib"} <= closure(("dev",)) and {"psutil", "fastapi", "uvicorn"} <= closure(("dev",))


def test_every_pinned_torch_requirement_keeps_its_pin():
    """An unpinned torch pulls a multi-GB CUDA build: every extra that brings torch pins it."""
    for extra, lines in PYPROJECT["optional-dependencies"].items():
        for line in lines:
            req = Requirement(line)
            if canonicalize_name(req.name) in ("torch", "hummingbird-ml"):
                assert "torch==2.13.0" in lines, f"[{extra}] brings torch without the torch==2.13.0 pin"


def test_serving_and_scoring_modules_import_without_the_extras(base_python, tmp_path):
    out = run_in(base_python, f"""
        import importlib.util, sys
        assert sys.prefix != {sys.prefix!r} and importlib.util.find_spec("torch") is None and importlib.util.find_spec("sklearn") is None, "the view leaks the project environment"
        import scorestack.client, scorestack.client.fraud, scorestack.client.ranking, scorestack.client.vision
        import scorestack.client.diagnose, scorestack.client.replay, scorestack.client.triton
        import scorestack.features, scorestack.features.fetch, scorestack.features.store, scorestack.features.push
        import scorestack.serve, scorestack.serve.server, scorestack.serve.control, scorestack.serve.devcerts
        import scorestack.demo.features, scorestack.demo.traffic  # `features apply` and `demo diagnose`
        from scorestack.client import TritonClient
        from scorestack.client.fraud import FraudService
        from scorestack.client.ranking import RankingService
        from scorestack.features import FeatureFetcher
        from scorestack.serve import LocalTriton
        from scorestack.serve.devcerts import write_dev_certs
        write_dev_certs({str(tmp_path / "certs")!r})
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY_MODULES!r})
        assert heavy == [], heavy
        print("ok")
        """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "args",
    [["--help"], ["serve", "--help"], ["server-env", "--help"], ["dev-certs", "--help"], ["diagnose", "--help"], ["features", "--help"], ["features", "get", "--help"],
     ["compile", "--help"], ["demo", "--help"]],
    ids=" ".join,
)
def test_the_command_line_answers_without_the_extras(base_python, tmp_path, args):
    out = scorestack_command(base_python, args, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


def _tabular_spec(root: Path) -> Path:
    spec = root / "fraud.yaml"
    spec.write_text(json.dumps({"name": "fraud", "source": {"path": "fraud.json", "format": "xgboost-json"}, "task": "binary", "inputs": {"features": ["a", "b"]}, "holdout": "h.npz"}))
    return spec


def _image_spec(root: Path) -> Path:
    spec = root / "digits.yaml"
    spec.write_text(json.dumps({"name": "digits", "source": {"path": "digits.onnx", "format": "onnx-model"}, "task": "image-classification",
                                "inputs": {"dtype": "uint8", "image": {"height": 8, "width": 8, "channels": 1}}, "holdout": "h.npz"}))
    return spec


@pytest.mark.parametrize(
    "args,message",
    [
        (["compile", "{tabular}"], "error: scorestack compile needs the compile extra: pip install 'scorestack[compile]' (not installed: onnx, onnxruntime,"),
        (["compile", "{image}"], "error: scorestack compile needs the compile and vision extras: pip install 'scorestack[compile,vision]'"),
        (["demo", "train"], "error: scorestack demo train needs the compile extra: pip install 'scorestack[compile]'"),
        (["demo"], "error: scorestack demo needs the compile and vision extras: pip install 'scorestack[compile,vision]'"),
        (["demo", "--vision-requests", "0"], "error: scorestack demo needs the compile extra: pip install 'scorestack[compile]'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_command_that_needs_a_missing_extra_names_it(base_python, tmp_path, args, message):
    args = [a.format(tabular=_tabular_spec(tmp_path), image=_image_spec(tmp_path)) for a in args]
    out = scorestack_command(base_python, args, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "model_repository").exists() and not (tmp_path / ".scorestack").exists()  # refused before doing anything


@pytest.mark.parametrize(
    "args",
    [["demo", "train", "--vision"], ["demo"], ["compile", "{image}"]],
    ids=" ".join,
)
def test_vision_work_without_torch_names_the_vision_extra(compile_python, tmp_path, args):
    args = [a.format(image=_image_spec(tmp_path)) for a in args]
    out = scorestack_command(compile_python, args, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs the vision extra: pip install 'scorestack[vision]' (not installed: torch" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_compile_extra_alone_compiles_a_tabular_model(compile_python, tmp_path):
    """`scorestack compile` with [compile] and nothing more (no torch, no hummingbird): verified, measured,
    served by the real local Triton; the hummingbird candidate is skipped, naming its extra."""
    import xgboost as xgb

    rng = np.random.default_rng(0)
    X = rng.normal(size=(1000, 4)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] * X[:, 2] > 0).astype(int)
    xgb.XGBClassifier(n_estimators=10, max_depth=3, n_jobs=1).fit(X, y).save_model(tmp_path / "tiny.json")
    np.savez(tmp_path / "holdout.npz", X=X[:300], y=y[:300])
    (tmp_path / "tiny.yaml").write_text(json.dumps({
        "name": "tiny", "source": {"path": "tiny.json", "format": "xgboost-json"}, "task": "binary",
        "inputs": {"features": ["a", "b", "c", "d"]}, "serving": {"batch_sizes": [1, 8], "dispatch": False},
        "formats": ["onnx", "hummingbird"], "holdout": "holdout.npz",
    }))
    out = scorestack_command(compile_python, ["compile", "tiny.yaml", "--repository", "repo"], tmp_path, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    report = json.loads((tmp_path / "repo" / "tiny" / "report.json").read_text())
    status = {c["format"]: c for c in report["candidates"]}
    assert status["onnx"]["status"] == "selected" and report["serve_check"]["status"] == "passed"
    assert status["hummingbird"]["status"] == "skipped" and "scorestack[hummingbird]" in status["hummingbird"]["reason"]


def test_a_base_install_serves_a_model_and_scores_it(base_python, tmp_path):
    """The real thing: in the base view, the local Triton starts and the client scores over gRPC."""
    import onnxruntime as ort
    from sklearn.linear_model import LogisticRegression
    from skl2onnx import to_onnx

    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4)).astype(np.float32)
    model = LogisticRegression().fit(X, (X[:, 0] + X[:, 1] > 0).astype(int))
    onx = to_onnx(model, X[:1], options={id(model): {"zipmap": False}}, target_opset=17)
    repo = tmp_path / "repo"
    (repo / "lr" / "1").mkdir(parents=True)
    (repo / "lr" / "1" / "model.onnx").write_bytes(onx.SerializeToString())
    (repo / "lr" / "config.pbtxt").write_text(textwrap.dedent("""\
        name: "lr"
        backend: "onnxruntime"
        max_batch_size: 8
        input [{ name: "X" data_type: TYPE_FP32 dims: [4] }]
        output [{ name: "probabilities" data_type: TYPE_FP32 dims: [2] }, { name: "label" data_type: TYPE_INT64 dims: [1] }]
        instance_group [{ count: 1 kind: KIND_CPU }]
        """))
    rows = X[:3]
    want = ort.InferenceSession(onx.SerializeToString(), providers=["CPUExecutionProvider"]).run(["probabilities"], {"X": rows})[0]
    np.save(tmp_path / "rows.npy", rows)
    out = run_in(base_python, f"""
        import asyncio, sys
        import numpy as np
        from scorestack.client import TritonClient
        from scorestack.serve import LocalTriton

        async def score(url):
            async with TritonClient(url, deadline_s=10.0) as triton:
                return (await triton.infer("lr", {{"X": np.load({str(tmp_path / "rows.npy")!r})}}, ["probabilities"])).outputs["probabilities"]

        with LocalTriton({str(repo)!r}, exit_timeout_s=0) as server:
            got = asyncio.run(score(server.grpc_url))
        np.save({str(tmp_path / "got.npy")!r}, got)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY_MODULES!r})
        assert heavy == [], heavy
        """, tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    np.testing.assert_allclose(np.load(tmp_path / "got.npy"), want, rtol=1e-5, atol=1e-6)


def test_a_base_install_writes_materializes_and_reads_features(base_python, tmp_path):
    """The other half of a fraud service: the feature repository and the fetch layer, in the base view."""
    for args in (["features", "apply", "--repo-dir", "repo", "--users", "50", "--items", "20"], ["features", "materialize", "--repo-dir", "repo"]):
        out = scorestack_command(base_python, args, tmp_path, timeout=300)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    out = scorestack_command(base_python, ["features", "get", "fraud", "--user-id", "7", "--repo-dir", "repo", "--timeout-ms", "5000"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "degraded=False" in out.stdout and "present" in out.stdout, out.stdout


def test_an_extra_module_missing_deep_inside_a_command_is_named():
    """A command that did not check first still reports the extra, not an ImportError traceback."""
    from scorestack.cli.errors import reported as wrapped

    app = typer.Typer()

    @app.command()
    @wrapped
    def train() -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    @app.command()
    @wrapped
    def other() -> None:
        raise ModuleNotFoundError("No module named 'not_ours'", name="not_ours")

    out = CliRunner().invoke(app, ["train"], prog_name="scorestack")
    assert out.exit_code == 2
    assert "this command needs the vision extra: pip install 'scorestack[vision]' (not installed: torch)" in out.output
    out = CliRunner().invoke(app, ["other"], prog_name="scorestack")
    assert isinstance(out.exception, ModuleNotFoundError)  # not an optional dependency: a bug, kept


def test_require_names_only_the_missing_extras(monkeypatch):
    import scorestack.extras as extras

    monkeypatch.setattr(extras, "installed", lambda module: module not in ("torch", "psutil"))
    require("x", "compile")  # complete: no error
    with pytest.raises(MissingExtra) as caught:
        require("scorestack demo", "compile", "vision", "bench")
    assert str(caught.value) == "scorestack demo needs the vision and bench extras: pip install 'scorestack[vision,bench]' (not installed: torch, psutil)"
    assert isinstance(caught.value, ImportError) and caught.value.extras == ["vision", "bench"]
    assert extra_of("torch.nn") == "vision" and extra_of("sklearn.ensemble") == "compile" and extra_of("hummingbird.ml") == "hummingbird" and extra_of("numpy") is None


def test_the_extras_table_matches_pyproject():
    assert set(EXTRAS) <= set(PYPROJECT["optional-dependencies"])
