"""One contract, two implementations: the Python model runtime and scorestack's native backend (C).

Both read the per-batch-size dispatch plan (config parameter `scorestack_dispatch`) and apply the
SHA256SUMS rule before a model loads. Each is specified once, in serve/runtime/scorestack_runtime.py
(`parse_dispatch`, `INTEGRITY_MESSAGES` and the comments above them); the C backend implements the
same rule. Here the same cases go through both: the Python functions, and the functions the real
backend library exports for this purpose (the library `native.library()` builds for Triton, loaded
beside stand-ins for the Triton symbols it imports but these functions never call). Every case must
come out the same, message for message. Real Triton loading these cases is in test_native_backend.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from scorestack.compile import dispatch
from scorestack.compile.registry import DispatchBand
from scorestack.serve import native
from scorestack.serve.runtime import scorestack_runtime as rt


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The real backend library, its Triton imports satisfied by empty stand-ins (never called here)."""
    source = native.source().read_text()
    imported = sorted(set(re.findall(r"^extern [^;]*?\b(TRITON\w+)\(", source, flags=re.M)))
    assert "TRITONSERVER_ErrorNew" in imported and "TRITONBACKEND_ModelConfig" in imported, imported
    folder = tmp_path_factory.mktemp("triton_stand_ins")
    stubs = folder / "stubs.c"
    stubs.write_text("".join(f"void {name}(void) {{}}\n" for name in imported))
    built = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libstubs.so"), str(stubs)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ctypes.CDLL(str(folder / "libstubs.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(native.library()))
    lib.scorestack_check_manifest.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.scorestack_check_manifest.restype = ctypes.c_int
    lib.scorestack_parse_dispatch.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    lib.scorestack_parse_dispatch.restype = ctypes.c_int
    return lib


# --- the SHA256SUMS rule --------------------------------------------------------------------------
def _c_integrity(lib: ctypes.CDLL, model: str, folder: Path) -> str | None:
    msg = ctypes.create_string_buffer(4096)
    code = lib.scorestack_check_manifest(model.encode(), os.fsencode(folder), msg, len(msg))
    text = msg.value.decode()
    assert (code == 0) == (text == ""), (code, text)
    return text or None


def _version(root: Path) -> Path:
    folder = root / "1"
    folder.mkdir()
    (folder / "model-trees.so").write_bytes(bytes(range(256)) * 40)
    (folder / "model.py").write_text("# the runtime\n")
    rt.write_manifest(str(folder))
    return folder


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _manifest(folder: Path, text: bytes) -> None:
    (folder / rt.MANIFEST).write_bytes(text)


def _good_line(folder: Path, name: str) -> bytes:
    return f"{rt.file_sha256(folder / name)}  {name}\n".encode()


# Each case: what it does to a freshly written version folder, and the rule's verdict (None: loads).
INTEGRITY_CASES = {
    "good": (lambda f: None, None),
    "good, sha256sum's binary marker, CRLF and empty lines": (
        lambda f: _manifest(f, b"\r\n" + _good_line(f, "model-trees.so").replace(b"  ", b" *").replace(b"\n", b"\r\n") + b"\n" + _good_line(f, "model.py")),
        None,
    ),
    "tampered byte": (lambda f: _flip_byte(f / "model-trees.so"), "modified"),
    "missing file": (lambda f: os.remove(f / "model-trees.so"), "missing_file"),
    "missing manifest": (lambda f: os.remove(f / rt.MANIFEST), "missing_manifest"),
    "empty manifest": (lambda f: _manifest(f, b""), "empty"),
    "only empty lines": (lambda f: _manifest(f, b"\n\r\n"), "empty"),
    "malformed line: no digest": (lambda f: _manifest(f, _good_line(f, "model.py") + b"model-trees.so\n"), "malformed"),
    "malformed line: short digest": (lambda f: _manifest(f, b"abc123  model.py\n"), "malformed"),
    "malformed line: uppercase digest": (lambda f: _manifest(f, _good_line(f, "model.py").upper()), "malformed"),
    "malformed line: one space": (lambda f: _manifest(f, _good_line(f, "model.py").replace(b"  ", b" ")), "malformed"),
    "malformed line: a path, not a file of the folder": (lambda f: _manifest(f, _good_line(f, "model.py").replace(b"model.py", b"../1/model.py")), "malformed"),
    "malformed line: blanks only": (lambda f: _manifest(f, _good_line(f, "model.py") + b"   \n"), "malformed"),
    "malformed line before a tampered file": (lambda f: (_flip_byte(f / "model-trees.so"), _manifest(f, (f / rt.MANIFEST).read_bytes() + b"x\n")), "malformed"),
    "a folder listed as a file": (lambda f: ((f / "sub").mkdir(), _manifest(f, b"0" * 64 + b"  sub\n")), "unreadable"),
    "the manifest is a folder": (lambda f: (os.remove(f / rt.MANIFEST), (f / rt.MANIFEST).mkdir()), "unreadable"),
    "the first failure in the manifest's order": (lambda f: (os.remove(f / "model.py"), _flip_byte(f / "model-trees.so")), "modified"),
    "a local view's folder names the repository's": (
        lambda f: ((f / rt.ORIGIN).write_text("/repository/fraud/1\n"), _flip_byte(f / "model-trees.so"), _manifest(f, (f / rt.MANIFEST).read_bytes())),
        "modified",
    ),
}


@pytest.mark.parametrize("case", list(INTEGRITY_CASES))
def test_the_sha256sums_rule_is_the_same_in_python_and_in_the_native_backend(backend, tmp_path, case):
    change, want = INTEGRITY_CASES[case]
    folder = _version(tmp_path)
    change(folder)
    failure = rt._integrity_failure("fraud", str(folder))
    assert (failure and failure[0]) == want, failure
    assert _c_integrity(backend, "fraud", folder) == (failure and failure[1])
    if want is None:
        rt.check_integrity("fraud", str(folder))
        return
    with pytest.raises(rt.IntegrityError) as raised:
        rt.check_integrity("fraud", str(folder))
    assert str(raised.value) == failure[1]
    shown = "/repository/fraud/1" if (folder / rt.ORIGIN).exists() else str(folder.resolve())
    assert failure[1].startswith(f"model fraud: cannot read {shown}/" if want == "unreadable" else f"model fraud: {shown}/"), failure[1]


def test_the_integrity_messages_say_what_failed_and_the_fix(backend, tmp_path):
    folder = _version(tmp_path)
    _flip_byte(folder / "model-trees.so")
    got, want = rt.file_sha256(folder / "model-trees.so"), rt.read_manifest((folder / rt.MANIFEST).read_bytes())[0][1]
    assert _c_integrity(backend, "fraud", folder) == (
        f"model fraud: {folder.resolve()}/model-trees.so is corrupted or was modified after compile "
        f"(sha256 {got[:16]}…, compiled as {want[:16]}…); refusing to load it. Recompile the model or restore the file"
    )
    _manifest(folder, b"nonsense\n")
    assert _c_integrity(backend, "fraud", folder) == (
        f"model fraud: {folder.resolve()}/SHA256SUMS line 1 is not '<sha256>  <file>'; recompile the model (scorestack compile) or restore the version folder"
    )
    os.remove(folder / rt.MANIFEST)
    assert _c_integrity(backend, "fraud", folder) == (
        f"model fraud: {folder.resolve()}/SHA256SUMS is missing, so the artifact cannot be checked; "
        "recompile the model (scorestack compile) or restore the version folder"
    )


# --- the dispatch plan ----------------------------------------------------------------------------
def _c_plan(lib: ctypes.CDLL, text: str) -> list[dict] | str:
    data = text.encode("utf-8", "surrogatepass")
    out = ctypes.create_string_buffer(1 << 16)
    n = lib.scorestack_parse_dispatch(data, len(data), out, len(out))
    if n == 0:
        return out.value.decode()
    bands = json.loads(out.value.decode())
    assert len(bands) == n
    return bands


def _py_plan(text: str) -> list[dict] | str:
    try:
        return rt.parse_dispatch(text)
    except rt.PlanError as exc:
        return str(exc)


def _band(**over) -> dict:
    return {"min_rows": 1, "runtime": "tl2cgen", "artifact": "tl2cgen-model-tl2cgen.so", "output_column": None, "method": None, **over}


def _plan(*bands: dict) -> str:
    return json.dumps(list(bands))


TWO = [_band(), _band(min_rows=8, artifact="trees-model-trees.so", output_column=1)]
GOOD_PLANS = {
    "one band": (_plan(_band()), [_band()]),
    "two bands, compact as the compiler writes": (json.dumps(TWO, separators=(",", ":")), TWO),
    "optional keys left out, keys in another order": (
        '[{"artifact": "a.so", "min_rows": 1, "runtime": "tl2cgen"}]',
        [{"min_rows": 1, "runtime": "tl2cgen", "artifact": "a.so", "output_column": None, "method": None}],
    ),
    "JSON whitespace and escapes": (
        ' \n[ {"min_rows" :1 ,"runtime":"tl2\\u0063gen","artifact":"a\\/b.so"}]'.replace("a\\/b.so", "a\\u002eso") + "\r\n\t",
        [{"min_rows": 1, "runtime": "tl2cgen", "artifact": "a.so", "output_column": None, "method": None}],
    ),
    "method and output column 0 (-0 is 0)": (
        _plan(_band(method="predict_proba")).replace('"output_column": null', '"output_column": -0'),
        [_band(method="predict_proba", output_column=0)],
    ),
    "sixteen bands, the largest integers": (
        _plan(*[_band(min_rows=1 if i == 0 else 2147483632 + i, output_column=2147483647) for i in range(16)]),
        [_band(min_rows=1 if i == 0 else 2147483632 + i, output_column=2147483647) for i in range(16)],
    ),
}

NAME_RULE = "letters, digits and . _ + -, not starting with ."
BAD_PLANS = {
    "empty": ("", "not valid JSON"),
    "the old native plan": ("probability 1 model-trees.so -1", "not valid JSON"),
    "unterminated": ('[{"min_rows": 1', "not valid JSON"),
    "trailing comma": (_plan(_band())[:-1] + ",]", "not valid JSON"),
    "extra data": (_plan(_band()) + " []", "not valid JSON"),
    "a syntax error after a bad band": ('[{"min_rows": 0, "runtime": "t", "artifact": "a"}, {]', "not valid JSON"),
    "leading zero": (_plan(_band()).replace('"min_rows": 1', '"min_rows": 01'), "not valid JSON"),
    "invalid escape": (_plan(_band(artifact="a")).replace('"a"', '"\\x"'), "not valid JSON"),
    "raw control character": (_plan(_band(artifact="a")).replace('"a"', '"a\tb"'), "not valid JSON"),
    "an object": (json.dumps(_band()), "not a JSON list of bands"),
    "a string": ('"[]"', "not a JSON list of bands"),
    "no bands": ("[]", "no bands"),
    "seventeen bands": (_plan(*[_band(min_rows=i + 1) for i in range(17)]), "more than 16 bands"),
    "a band that is a number": ("[1]", "band 1 is not a JSON object"),
    "unknown key": (_plan(_band(), _band(min_rows=2, runtme="tl2cgen")), 'band 2: unknown key "runtme" (a band has min_rows, runtime, artifact, output_column, method)'),
    "repeated key": ('[{"min_rows": 1, "runtime": "a", "artifact": "b", "runtime": "a"}]', 'band 1: key "runtime" appears twice'),
    "missing artifact": ('[{"min_rows": 1, "runtime": "tl2cgen"}]', 'band 1: "artifact" is missing'),
    "min_rows 0": (_plan(_band(min_rows=0)), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows 1.0": (_plan(_band()).replace('"min_rows": 1', '"min_rows": 1.0'), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows 1e0": (_plan(_band()).replace('"min_rows": 1', '"min_rows": 1e0'), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows true": (_plan(_band(min_rows=True)), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows NaN": (_plan(_band()).replace('"min_rows": 1', '"min_rows": NaN'), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows as a string": (_plan(_band(min_rows="1")), "band 1: min_rows must be an integer from 1 to 2147483647"),
    "min_rows too large": (_plan(_band(), _band(min_rows=2**31)), "band 2: min_rows must be an integer from 1 to 2147483647"),
    "min_rows far too large": (_plan(_band(), _band(min_rows=10**30)), "band 2: min_rows must be an integer from 1 to 2147483647"),
    "a runtime with a space": (_plan(_band(runtime="tl2 cgen")), f"band 1: runtime must be a name ({NAME_RULE})"),
    "an artifact outside the folder": (_plan(_band(artifact="../model.so")), f"band 1: artifact must be a name ({NAME_RULE})"),
    "a hidden artifact": (_plan(_band(artifact=".model.so")), f"band 1: artifact must be a name ({NAME_RULE})"),
    "a non-ASCII artifact": (_plan(_band(artifact="modèle.so")), f"band 1: artifact must be a name ({NAME_RULE})"),
    "an empty artifact": (_plan(_band(artifact="")), f"band 1: artifact must be a name ({NAME_RULE})"),
    "an artifact of 256 characters": (_plan(_band(artifact="a" * 256)), f"band 1: artifact must be a name ({NAME_RULE})"),
    "an artifact that is a list": (_plan(_band(artifact=["a.so"])), f"band 1: artifact must be a name ({NAME_RULE})"),
    "output column -1": (_plan(_band(output_column=-1)), "band 1: output_column must be null or an integer from 0 to 2147483647"),
    "output column as a string": (_plan(_band(output_column="1")), "band 1: output_column must be null or an integer from 0 to 2147483647"),
    "method a number": (_plan(_band(method=5)), f"band 1: method must be null or a name ({NAME_RULE})"),
    "starting at 2 rows": (_plan(_band(min_rows=2)), "band 1: min_rows must be 1 (the first band starts at one row), not 2"),
    "not ascending": (_plan(_band(), _band(min_rows=8), _band(min_rows=8)), "band 3: min_rows 8 does not ascend from band 2's 8"),
    "too long": (_plan(_band(artifact="a" * 200)).replace("[", "[" + " " * 16300, 1), "longer than 16383 bytes"),
}


@pytest.mark.parametrize("case", list(GOOD_PLANS))
def test_both_readers_read_a_plan_as_the_same_bands(backend, case):
    text, bands = GOOD_PLANS[case]
    assert _py_plan(text) == bands
    assert _c_plan(backend, text) == bands


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_both_readers_refuse_a_malformed_plan_with_the_same_message(backend, case):
    text, message = BAD_PLANS[case]
    assert _py_plan(text) == message
    assert _c_plan(backend, text) == message


def test_the_compiler_writes_the_plan_once_and_both_readers_read_it_back(backend):
    bands = [
        DispatchBand("tl2cgen", 1, 7, "tl2cgen", "tl2cgen-model-tl2cgen.so", None, None),
        DispatchBand("onnx", 8, 63, "onnxruntime", "onnx-model.onnx", 1, None),
        DispatchBand("native", 64, 512, "sklearn", "native-model.joblib", 1, "predict_proba"),
    ]
    text = dispatch.dispatch_parameter(bands)
    want = [
        {"min_rows": b.min_rows, "runtime": b.runtime, "artifact": b.artifact, "output_column": b.output_column, "method": b.method} for b in bands
    ]
    assert json.loads(text) == want
    assert _py_plan(text) == want
    assert _c_plan(backend, text) == want
    # An artifact no server could name fails in the compiler, not at load.
    with pytest.raises(ValueError, match=r"cannot be written as scorestack_dispatch: band 1: artifact must be a name"):
        dispatch.dispatch_parameter([DispatchBand("trees", 1, 8, "tl2cgen", "model trees.so")])


def test_an_unreadable_plan_fails_the_python_load_naming_the_parameter_and_the_fix(tmp_path):
    config = {
        "max_batch_size": 8,
        "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": ["3"]}],
        "output": [{"name": "probability", "data_type": "TYPE_FP32", "dims": ["1"]}],
        "parameters": {rt.PARAM_RUNTIME: {"string_value": rt.DISPATCH}, rt.PARAM_DISPATCH: {"string_value": "probability 1 model-trees.so -1"}},
    }
    with pytest.raises(rt.RuntimeLoadError) as raised:
        rt.ModelRuntime("fraud", str(tmp_path), config)
    assert str(raised.value) == (
        "model fraud: config parameter scorestack_dispatch cannot be read (not valid JSON); recompile the model (scorestack compile)"
    )
    del config["parameters"][rt.PARAM_DISPATCH]
    with pytest.raises(rt.RuntimeLoadError, match=r"scorestack_dispatch cannot be read \(the parameter is missing\); recompile"):
        rt.ModelRuntime("fraud", str(tmp_path), config)


def test_the_old_native_plan_parameter_is_gone():
    assert not hasattr(native, "PARAM_NATIVE") and not hasattr(native, "plan")
    assert "scorestack_native" not in native.source().read_text()
    assert shutil.which("gcc"), "the native backend needs gcc"
