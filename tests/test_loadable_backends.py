"""One wheel for every machine: with ggml's loadable backends, a backend module that cannot load is skipped and the
CPU module runs the models.

The real CUDA module needs the NVIDIA driver (`libcuda.so.1`). Here a stand-in `libggml-cuda.so`, compiled with gcc
at test time, needs a library that is nowhere on the loader's path, and sits in a copy of the installed llama_cpp
package next to its real CPU module. (The real CUDA wheel on a machine without a driver: prebuilt_wheels/README.md.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pairs import pair_files

from dflash_runtime import load_pair
from dflash_runtime.native import backends
from dflash_runtime.space.setup import startup

ROOT = Path(__file__).resolve().parent.parent
ABSENT = "libdflash-absent-driver.so.1"
DRIVER_C = "int dflash_absent_driver_ready(void) { return 1; }\n"
# Exports what ggml looks for in a backend module; using the absent library makes the loader need it.
MODULE_C = """
extern int dflash_absent_driver_ready(void);
int ggml_backend_score(void) { return dflash_absent_driver_ready() ? 100 : 0; }
void *ggml_backend_init(void) { return 0; }
"""
PROMPT = "the draft proposes tokens and the target verifies them."
# Runs in a child process that imports llama_cpp from the copy (PYTHONPATH first).
CHILD = """
import json, sys
maps = lambda: open("/proc/self/maps").read()
import llama_cpp
imported_only = [name for name in ("libggml-cpu", "libggml-cuda") if name in maps()]
from dflash_runtime import load_pair
from dflash_runtime.native import backends
report = backends.backend_report()
with load_pair(sys.argv[1], sys.argv[2], n_ctx=512, draft_capacity=7) as engine:
    result = engine.generate(sys.argv[3], max_tokens=24)
    plain = engine.generate(sys.argv[3], max_tokens=24, speculative=False)
print(json.dumps({
    "package": llama_cpp.__file__, "mapped_after_import": imported_only,
    "modules": report.modules, "registered": report.registered, "skipped": report.skipped,
    "cuda_mapped": "libggml-cuda" in maps(), "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
    "tokens": result.tokens, "plain": plain.tokens, "verify_steps": result.stats.verify_steps,
}))
"""


def compile_c(source: str, output: Path, *args: str) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "a C compiler is needed (the wheel recipe needs one too)"
    output.parent.mkdir(parents=True, exist_ok=True)
    cmd = [compiler, "-shared", "-fPIC", "-o", str(output), "-x", "c", "-", *args]
    subprocess.run(cmd, input=source, text=True, check=True, capture_output=True, timeout=60)
    return output


@pytest.fixture(scope="module")
def package_with_stand_in(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(site directory holding a copy of llama_cpp with the stand-in CUDA module, directory of the absent library)."""
    lib = backends.library_dir()
    assert "libggml-cpu.so" in backends.backend_modules(lib) and not (lib / "libggml-cuda.so").exists(), (
        f"{lib} is not the recipe's CPU wheel with loadable backends: "
        "install it (python prebuilt_wheels/build_wheel.py --cpu; see .ci/run)"
    )
    tmp = tmp_path_factory.mktemp("dl")
    driver_dir = tmp / "driver"
    compile_c(DRIVER_C, driver_dir / ABSENT, f"-Wl,-soname,{ABSENT}")
    site = tmp / "site"
    shutil.copytree(lib.parent, site / "llama_cpp", ignore=shutil.ignore_patterns("__pycache__"))
    module = site / "llama_cpp" / "lib" / "libggml-cuda.so"
    compile_c(MODULE_C, module, f"-L{driver_dir}", f"-l:{ABSENT}")
    needed = subprocess.run(["readelf", "-d", str(module)], capture_output=True, text=True, check=True).stdout
    assert f"[{ABSENT}]" in needed
    return site, driver_dir


def run_child(site: Path, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "DFLASH_WHEEL_MANIFEST")}
    env |= {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])} | (extra_env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_module_that_cannot_load_is_skipped_and_the_cpu_generates(package_with_stand_in: tuple[Path, Path]) -> None:
    site, _ = package_with_stand_in
    files = pair_files("hybrid", "dflash2", head="shaped")
    with load_pair(files.target, files.draft, n_ctx=512, draft_capacity=7) as engine:
        expected = engine.generate(PROMPT, max_tokens=24).tokens
    out = run_child(site, "-c", CHILD, str(files.target), str(files.draft), PROMPT)
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.splitlines()[-1])
    assert child["package"].startswith(str(site))
    assert child["mapped_after_import"] == [], "importing llama_cpp must load no backend module"
    assert child["modules"] == ["libggml-cpu.so", "libggml-cuda.so"]
    assert child["registered"] == ["CPU"] and child["gpu_offload"] is False and child["cuda_mapped"] is False
    assert list(child["skipped"]) == ["libggml-cuda.so"] and ABSENT in child["skipped"]["libggml-cuda.so"]
    assert child["tokens"] == expected == child["plain"] and len(expected) == 24 and child["verify_steps"] > 0



# Plain llama-cpp-python, nothing of this project imported: the wheel's own loader skips the module too.
PLAIN_CHILD = """
import json, sys
from llama_cpp import Llama
import llama_cpp
llm = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=24, temperature=0)
maps = open("/proc/self/maps").read()
print(json.dumps({"package": llama_cpp.__file__, "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
                  "tokens": out["usage"]["completion_tokens"], "cuda_mapped": "libggml-cuda" in maps,
                  "dflash_imported": [m for m in sys.modules if m.startswith("dflash_runtime")]}))
"""


def test_plain_llama_skips_the_module_and_runs_on_the_cpu(package_with_stand_in: tuple[Path, Path]) -> None:
    site, _ = package_with_stand_in
    files = pair_files("hybrid", "dflash2", head="shaped")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", PLAIN_CHILD, str(files.target), PROMPT], capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(site)}, cwd=site, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.splitlines()[-1])
    assert child["package"].startswith(str(site)) and child["dflash_imported"] == []
    assert child["gpu_offload"] is False and child["cuda_mapped"] is False and child["tokens"] == 24


def test_the_same_module_loads_once_its_library_is_found(package_with_stand_in: tuple[Path, Path]) -> None:
    """The control: with the library on the loader's path the stand-in loads (and, having no real backend, does not
    register), so the skip above is the loader failing on the missing library."""
    site, driver_dir = package_with_stand_in
    code = "from dflash_runtime.native import backends; r = backends.backend_report(); print(r.registered, r.skipped)"
    out = run_child(site, "-c", code, extra_env={"LD_LIBRARY_PATH": str(driver_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "['CPU'] {'libggml-cuda.so': 'loads, but its backend did not register (not supported on this machine)'}"
    )


def test_startup_check_reports_a_cuda_build_running_on_the_cpu(package_with_stand_in: tuple[Path, Path]) -> None:
    site, _ = package_with_stand_in
    out = run_child(site, "-m", "dflash_runtime.space.setup.startup", "--json")
    line, details = out.stdout.split("\n", 1)
    info = json.loads(details)
    assert info["cuda_build"] is True and info["gpu_offload"] is False and info["loadable_backends"] is True
    assert info["backends_registered"] == ["CPU"] and ABSENT in info["backends_skipped"]["libggml-cuda.so"]
    assert any(d["type"] == "CPU" for d in info["devices"]) and info["cuda_devices"] == []
    assert "backends (loadable): CPU" in line and "the CUDA backend did not load" in line and ABSENT in line
    assert "import failed" not in line and info["dflash_missing_symbols"] == []


def test_a_cuda_module_that_does_not_load_beside_a_gpu_is_a_problem() -> None:
    """Where no GPU is attached, the CPU fallback is the point; where one is, a skipped CUDA module is a fault."""
    reason = "libcuda.so.1: cannot open shared object file: No such file or directory"
    info = {"cuda_build": True, "backends_registered": ["CPU"], "backends_skipped": {"libggml-cuda.so": reason}}
    assert startup.problems_of({**info, "nvidia_device_node": False}) == []
    problems = startup.problems_of({**info, "nvidia_device_node": True})
    assert problems == [f"this machine has an NVIDIA GPU, but the CUDA backend did not load: {reason}"]


def test_no_backend_at_all_is_a_problem() -> None:
    info = {"backends_registered": [], "backends_skipped": {"libggml-cpu.so": "not supported on this machine"}}
    assert startup.problems_of(info) == ["no ggml backend registered (libggml-cpu.so: not supported on this machine)"]
