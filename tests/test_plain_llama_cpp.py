"""The project's wheel is a plain llama-cpp-python wheel too: `llama_cpp.Llama` loads ggml's backend modules itself,
on the first call that needs them, and `import llama_cpp` loads none.

Each check runs in a fresh interpreter (the backend registry lives for the whole process), in an empty working
directory: libllama's own fallback looks for modules there and next to the Python executable, never in llama_cpp/lib.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pairs import pair_files

from dflash_runtime.llama_compat import DFlashDraftModel, DFlashLlama
from dflash_runtime.native import backends

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "prebuilt_wheels" / "build_wheel.py"
PROMPT = "the quick brown fox jumps over the lazy dog."
MAX_TOKENS = 12
CHILD_TIMEOUT_S = 180

MAPS = """
def mapped(*names):
    maps = open("/proc/self/maps").read()
    return sorted({n for n in names if "/" + n in maps})
"""
# Nothing but llama_cpp: the way any user of the wheel writes it.
PLAIN = MAPS + """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0)
llm.close()
print(json.dumps({
    "text": out["choices"][0]["text"], "completion_tokens": out["usage"]["completion_tokens"],
    "mapped": mapped("libggml-cpu.so", "libggml-cuda.so"),
    "dflash_imported": sorted(m for m in sys.modules if m.startswith("dflash_runtime")),
}))
"""
IMPORT_ONLY = MAPS + """
import ctypes, json, sys
import llama_cpp
from llama_cpp import Llama
from llama_cpp import _backend_modules as loader
reg_count = llama_cpp.llama_cpp._lib["ggml_backend_reg_count"]
reg_count.restype = ctypes.c_size_t
facts = {"mapped": mapped("libggml-cpu.so", "libggml-cuda.so", "libcuda.so.1", "libcudart.so.13"),
         "registered": reg_count(), "loaded": loader.backends_loaded()}
if len(sys.argv) > 1:  # then one binding that needs backends, alone
    getattr(llama_cpp, sys.argv[1])()
    facts |= {"after_mapped": mapped("libggml-cpu.so"), "after_registered": reg_count(),
              "after_loaded": loader.backends_loaded()}
print(json.dumps(facts))
"""
# A package whose backend modules cannot load: the loader says so before libllama's "Failed to load model".
NO_BACKEND = """
import json, sys, warnings
from llama_cpp import Llama
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        Llama(model_path=sys.argv[1], verbose=False)
        error = None
    except ValueError as failure:
        error = str(failure)
print(json.dumps({"warnings": [str(w.message) for w in caught if w.category is RuntimeWarning], "error": error}))
"""
# Plain Llama first, dflash_runtime after it; or the other way round.
PLAIN_THEN_DFLASH = MAPS + """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
plain = llm.create_completion(sys.argv[3], max_tokens=int(sys.argv[4]), temperature=0)["choices"][0]["text"]
llm.close()
from dflash_runtime import load_pair
from dflash_runtime.native import backends
loaded_before = backends.backends_loaded()
report = backends.backend_report()
with load_pair(sys.argv[1], sys.argv[2], n_ctx=256, draft_length=7) as engine:
    result = engine.generate(sys.argv[3], max_tokens=int(sys.argv[4]))
print(json.dumps({"plain": plain, "dflash": result.text, "verify_steps": result.stats.verify_steps,
                  "loaded_before": loaded_before, "modules": report.modules, "registered": report.registered,
                  "after": backends.registered_backends(), "mapped": mapped("libggml-cpu.so")}))
"""
DFLASH_THEN_PLAIN = MAPS + """
import json, sys
from dflash_runtime import load_pair
from dflash_runtime.native import backends
with load_pair(sys.argv[1], sys.argv[2], n_ctx=256, draft_length=7) as engine:
    result = engine.generate(sys.argv[3], max_tokens=int(sys.argv[4]))
report = backends.backend_report()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
plain = llm.create_completion(sys.argv[3], max_tokens=int(sys.argv[4]), temperature=0)["choices"][0]["text"]
llm.close()
print(json.dumps({"plain": plain, "dflash": result.text, "verify_steps": result.stats.verify_steps,
                  "loaded_before": True, "modules": report.modules, "registered": report.registered,
                  "after": backends.registered_backends(), "mapped": mapped("libggml-cpu.so")}))
"""
# Both loaders at once from many threads: one of them loads, the registry gets each backend once.
RACE = """
import json, threading
import llama_cpp
from dflash_runtime.native import backends
barrier = threading.Barrier(8)
errors = []
def run(call):
    try:
        barrier.wait(timeout=30)
        call()
    except Exception as error:
        errors.append(repr(error))
calls = [llama_cpp.llama_backend_init, backends.load_backends] * 4
threads = [threading.Thread(target=run, args=(call,)) for call in calls]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=60)
print(json.dumps({"errors": errors, "alive": sum(t.is_alive() for t in threads),
                  "registered": backends.registered_backends(), "report": backends.backend_report().modules}))
"""


def run_fresh(code: str, *args: str, cwd: Path, with_project: bool = False) -> dict:
    """Run `code` in a new interpreter in `cwd`; its last stdout line is JSON. Without `with_project` the project's
    packages are not even importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "GGML_BACKEND_PATH")}
    if with_project:
        env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("build_wheel_for_plain_tests", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> str:
    """Greedy text of the tiny target (DFlashLlama is lossless: the same text plain decoding gives)."""
    files = pair_files("dense", "dflash2")
    with DFlashLlama(model_path=str(files.target), draft_model=DFlashDraftModel(files.draft), n_ctx=256,
                     verbose=False) as llm:  # fmt: skip
        response = llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response["usage"]["completion_tokens"] == MAX_TOKENS
    return response["choices"][0]["text"]


def test_installed_wheel_carries_the_recipes_loader(recipe) -> None:
    """The wheel under test is this recipe's: its llama_cpp has the loader module and the hook, byte for byte."""
    package = backends.library_dir().parent
    assert (package / "_backend_modules.py").is_file(), (
        f"{package} has no backend loader: install the wheel built by prebuilt_wheels/build_wheel.py --cpu"
    )
    assert (package / "_backend_modules.py").read_bytes() == recipe.PATCH_MODULE_SOURCE.read_bytes(), (
        "the installed loader differs from prebuilt_wheels/llama_cpp_patch/: rebuild and reinstall the wheel"
    )
    assert (package / "llama_cpp.py").read_text().count(recipe.PATCH_ANCHOR + recipe.PATCH_HOOK) == 1


def test_plain_llama_loads_a_model_and_generates(tmp_path: Path, reference: str) -> None:
    target = pair_files("dense", "dflash2").target
    child = run_fresh(PLAIN, str(target), PROMPT, str(MAX_TOKENS), cwd=tmp_path)
    assert child["dflash_imported"] == []
    assert child["mapped"] == ["libggml-cpu.so"]
    assert child["completion_tokens"] == MAX_TOKENS and child["text"] == reference


def test_import_loads_and_registers_no_backend(tmp_path: Path) -> None:
    child = run_fresh(IMPORT_ONLY, cwd=tmp_path)
    assert child == {"mapped": [], "registered": 0, "loaded": False}


@pytest.mark.parametrize("binding", ["llama_backend_init", "llama_supports_gpu_offload", "llama_print_system_info"])
def test_a_binding_that_needs_backends_loads_them_first(tmp_path: Path, binding: str) -> None:
    """The control for the test above: the same process registers the CPU backend once such a binding runs."""
    child = run_fresh(IMPORT_ONLY, binding, cwd=tmp_path)
    assert child["mapped"] == [] and child["registered"] == 0 and child["loaded"] is False
    assert child["after_mapped"] == ["libggml-cpu.so"] and child["after_registered"] == 1 and child["after_loaded"]


def test_a_package_whose_modules_cannot_load_says_so(tmp_path: Path) -> None:
    """The CPU module replaced by a file that is no library: the warning names it, and only it (libggml-base.so is a
    library libggml links, not a module), and the model load then fails as libllama makes it fail."""
    site = tmp_path / "site"
    shutil.copytree(backends.library_dir().parent, site / "llama_cpp", ignore=shutil.ignore_patterns("__pycache__"))
    assert (site / "llama_cpp" / "lib" / "libggml-base.so").is_file()
    (site / "llama_cpp" / "lib" / "libggml-cpu.so").write_bytes(b"not a shared library")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "GGML_BACKEND_PATH")}
    target = pair_files("dense", "dflash2").target
    out = subprocess.run([sys.executable, "-c", NO_BACKEND, str(target)], cwd=tmp_path, capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(site)}, timeout=CHILD_TIMEOUT_S)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    lib = site / "llama_cpp" / "lib"
    assert child["warnings"] == [
        f"no ggml backend could be loaded from {lib} (backend modules there: libggml-cpu.so); llama.cpp cannot open "
        "a model"
    ]
    assert child["error"] is not None and "Failed to load model" in child["error"]


def test_every_named_binding_goes_through_the_loader() -> None:
    """A name in NEEDS_BACKENDS that llama_cpp does not bind (a typo, a renamed function) would protect nothing."""
    import llama_cpp
    from llama_cpp import _backend_modules as loader

    assert loader.wrapped_bindings() == loader.NEEDS_BACKENDS
    assert llama_cpp.llama_model_load_from_file.native is not None
    assert not hasattr(llama_cpp.llama_decode, "native"), "per-token bindings stay plain ctypes functions"


@pytest.mark.parametrize("order", [PLAIN_THEN_DFLASH, DFLASH_THEN_PLAIN], ids=["plain-first", "dflash-first"])
def test_plain_llama_and_dflash_runtime_share_one_registry(tmp_path: Path, reference: str, order: str) -> None:
    files = pair_files("dense", "dflash2")
    child = run_fresh(order, str(files.target), str(files.draft), PROMPT, str(MAX_TOKENS), cwd=tmp_path,
                      with_project=True)  # fmt: skip
    assert child["loaded_before"] is True, "backends_loaded() must count the wheel's own loading"
    assert child["modules"] == ["libggml-cpu.so"] and child["registered"] == ["CPU"] and child["after"] == ["CPU"]
    assert child["mapped"] == ["libggml-cpu.so"]
    assert child["plain"] == reference and child["verify_steps"] > 0
    assert child["dflash"] == reference


def test_both_loaders_racing_register_each_backend_once(tmp_path: Path) -> None:
    child = run_fresh(RACE, cwd=tmp_path, with_project=True)
    assert child == {"errors": [], "alive": 0, "registered": ["CPU"], "report": ["libggml-cpu.so"]}
