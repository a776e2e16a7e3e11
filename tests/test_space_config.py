"""The Space's build files agree with each other and with the code: README front matter, requirements.txt,
packages.txt, the preset defaults and the wheel.

The Spaces builder reads the front matter (gradio from sdk_version, Python from python_version, files baked in
from preload_from_hub), installs packages.txt with apt, then requirements.txt on its own together with gradio and
`spaces`. A disagreement between these files shows only when a Space is built; here it fails a test.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

from dflash_runtime.space.setup import startup
from dflash_runtime.space.setup.presets import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parent.parent
# The platform's image provides these; CUDA comes from the host driver and the pip packages requirements.txt names.
BASE_IMAGE_LIBRARIES = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2",
    "libstdc++.so.6", "libgcc_s.so.1",
}  # fmt: skip
CUDA_LIBRARIES = {"libcuda.so.1", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"}
DEBIAN_PACKAGE_OF = {"libgomp.so.1": "libgomp1"}  # run-time libraries the wheel needs -> their Debian package
ALLOWED_OPTIONS = ("--find-links", "--extra-index-url", "--index-url", "--prefer-binary", "--only-binary")


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "README.md starts with a YAML front matter block"
    return yaml.safe_load(match.group(1))


def requirement_lines(path: Path = ROOT / "requirements.txt") -> tuple[list[Requirement], list[str]]:
    """(requirements, option lines) of a requirements file; comments and blank lines dropped."""
    lines = [re.split(r"(?:^|\s)#", raw, maxsplit=1)[0].strip() for raw in path.read_text().splitlines()]
    options = [line for line in lines if line.startswith("-")]
    return [Requirement(line) for line in lines if line and line not in options], options


def pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def named(requirements: list[Requirement], name: str) -> list[Requirement]:
    return [r for r in requirements if canonicalize_name(r.name) == canonicalize_name(name)]


def test_gradio_comes_from_sdk_version_and_spaces_from_the_platform() -> None:
    meta = front_matter()
    assert meta["sdk"] == "gradio" and (ROOT / meta["app_file"]).is_file()
    requirements, _ = requirement_lines()
    for gradio in named(requirements, "gradio"):
        assert str(gradio.specifier) == f"=={meta['sdk_version']}", "a gradio pin must equal sdk_version"
    assert re.search(rf'^space = \["gradio=={re.escape(meta["sdk_version"])}"\]$', pyproject(), re.MULTILINE)
    assert not named(requirements, "spaces"), "the platform installs `spaces`; listing it fights its version"


def test_requirements_install_from_the_file_alone() -> None:
    """The builder mounts requirements.txt alone: no other file, editable or local path can be reached."""
    requirements, options = requirement_lines()
    for option in options:
        assert option.startswith(ALLOWED_OPTIONS), f"{option!r} needs files the Spaces builder does not have"
    for requirement in requirements:
        if requirement.url:
            assert urlsplit(requirement.url).scheme == "https", f"{requirement}: the Hub serves https"
            assert re.search(r"#sha256=[0-9a-f]{64}$", requirement.url), f"{requirement}: pin the wheel's sha256"


def llama_line_problems(requirements: Path, python: str) -> list[str]:
    """What is wrong with the llama-cpp-python line for a Space on `python`: a published wheel must install there
    (tags) and have its manifest in prebuilt_wheels/published/ beside requirements.txt (the start-up check's)."""
    (llama,) = named(requirement_lines(requirements)[0], "llama-cpp-python")
    if not llama.url:
        return [] if str(llama.specifier) == "==0.3.36" else [f"{llama}: expected llama-cpp-python==0.3.36"]
    interpreter = "cp" + python.replace(".", "")
    space_tags = {Tag(t, a, p) for t in (interpreter, "py3") for a in (interpreter, "abi3", "none")
                  for p in ("linux_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")}  # fmt: skip
    filename = urlsplit(llama.url).path.rsplit("/", 1)[-1]
    problems = [] if parse_wheel_filename(filename)[3] & space_tags else [f"{filename} does not install on {python}"]
    published = requirements.parent / "prebuilt_wheels" / "published"
    manifests = [json.loads(path.read_text()) for path in published.glob("*/manifest.json")]
    if not any(m["wheel"]["sha256"] == llama.url.rsplit("#sha256=", 1)[1] for m in manifests):
        problems.append(f"no manifest of {filename} in {published}: commit it with requirements.txt")
    return problems


def test_python_version_fits_the_project_and_the_wheel() -> None:
    python = front_matter()["python_version"]
    assert isinstance(python, str), 'quote python_version ("3.12"): unquoted YAML reads 3.10 as 3.1'
    requires = re.search(r'^requires-python = "([^"]+)"$', pyproject(), re.MULTILINE)
    assert requires and SpecifierSet(requires.group(1)).contains(python)
    assert llama_line_problems(ROOT / "requirements.txt", python) == []


def test_a_published_line_is_checked_against_its_tags_and_manifest(tmp_path: Path) -> None:
    sha256 = "ab" * 32
    wheel = "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    url = f"https://huggingface.co/o/r/resolve/{'1' * 40}/cuda/{wheel}#sha256={sha256}"
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"numpy\nllama-cpp-python @ {url}\n")
    assert llama_line_problems(requirements, "3.12") == [
        f"no manifest of {wheel} in {tmp_path / 'prebuilt_wheels' / 'published'}: commit it with requirements.txt"
    ]
    manifest = tmp_path / "prebuilt_wheels" / "published" / "cuda" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"wheel": {"filename": wheel, "sha256": sha256}}))
    assert llama_line_problems(requirements, "3.12") == []
    requirements.write_text(f"llama-cpp-python @ {url.replace('py3-none', 'cp310-cp310')}\n")
    assert llama_line_problems(requirements, "3.12")[0].endswith("does not install on 3.12")


def test_models_and_preloaded_files_are_the_preset_defaults() -> None:
    meta = front_matter()
    defaults = (DEFAULT_TARGET, DEFAULT_DRAFT)
    assert sorted(meta["models"]) == sorted(source.repo for source in defaults)
    preloaded = set()
    for entry in meta["preload_from_hub"]:
        repo, files, *revision = entry.split()
        assert len(revision) <= 1, f"{entry!r}: 'repo file[,file] [revision]'"
        preloaded |= {(repo, name, revision[0] if revision else None) for name in files.split(",")}
    # Same revision (or none) as the presets: the app then finds the baked-in files in the Hugging Face cache.
    assert preloaded == {(s.repo, s.filename, s.revision) for s in defaults}


def test_startup_timeout_is_a_duration_that_fits() -> None:
    timeout = str(front_matter()["startup_duration_timeout"])
    match = re.fullmatch(r"(\d+)([mh])", timeout)
    assert match, f"startup_duration_timeout {timeout!r}: minutes or hours, e.g. 15m"
    minutes = int(match.group(1)) * (60 if match.group(2) == "h" else 1)
    assert 5 <= minutes <= 60, "models are baked in at build time; start-up only imports and probes the build"


def needed_libraries(library: Path) -> set[str]:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))


def test_packages_txt_brings_what_the_wheel_needs_at_run_time() -> None:
    packages = (ROOT / "packages.txt").read_text().split()
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", p) for p in packages), packages
    lib = startup.installed_package_dir() / "lib"
    libraries = sorted(lib.glob("*.so*"))
    assert libraries, f"no native libraries under {lib}"
    shipped = {p.name for p in libraries}
    needed = set().union(*(needed_libraries(p) for p in libraries)) - shipped - BASE_IMAGE_LIBRARIES - CUDA_LIBRARIES
    unknown = needed - set(DEBIAN_PACKAGE_OF)
    assert not unknown, f"the wheel needs {sorted(unknown)}: add their Debian packages to packages.txt and here"
    assert {DEBIAN_PACKAGE_OF[name] for name in needed} <= set(packages)
    assert "libgomp.so.1" in needed, "the CPU backend is built with OpenMP"


def test_the_find_links_folders_exist_so_pip_stays_quiet() -> None:
    """pip warns at every package it looks up when a --find-links folder is missing (58 warnings an install): the
    local folders requirements.txt names are in the checkout (relative to the file, as pip resolves them), and git
    keeps them while ignoring what is built into them."""
    _, options = requirement_lines()
    local = [option.split(None, 1)[1] for option in options if option.startswith("--find-links")
             and "://" not in option]  # fmt: skip
    assert local, "requirements.txt names the checkout's wheel folders"
    for folder in local:
        assert (ROOT / folder).is_dir(), folder
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", f"{folder}/.keep"], cwd=ROOT,
                                 capture_output=True, text=True)  # fmt: skip
        assert tracked.returncode == 0, f"{folder} is not kept by git: {tracked.stderr}"
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{folder}/llama_cpp_python-0.3.36-x.whl"], cwd=ROOT)
        assert ignored.returncode == 0, f"a wheel built into {folder} would not be ignored"
