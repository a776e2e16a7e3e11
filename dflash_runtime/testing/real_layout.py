"""A tiny pair laid out like the real one, converted by llama.cpp's own converter: the files the Space downloads
(an NVFP4 + Q8_0-attention `qwen35` target with an MTP layer, a Q4_K_M DFlash 2 draft, the full 248,320-row Qwen3.5
vocabulary and chat template, `general.sampling.*`) at a few hundred megabytes, with random weights.

Steps (real_layout_hf.py has the layout's facts): the llama-cpp-python 0.3.36 sdist's vendored converter is
extracted; a venv of its own gets torch (CPU), transformers with its huggingface-hub < 1 pin, numpy (the
project's venv cannot hold them); it writes the Hugging Face checkpoints and converts them (the target with
`--outtype bf16 --fp8-as-q8`, the draft with `--target-model-dir`); the draft is quantised to Q4_K_M by
`llama_model_quantize` through llama_cpp in this process. The result is cached under a key of every input.

    python -m dflash_runtime.testing.real_layout [--cache-dir DIR] [--seed S]

The cache: $DFLASH_REAL_LAYOUT_CACHE, else ~/.cache/dflash-space/real-layout. The sdist: $DFLASH_LLAMA_SDIST, else
the wheel recipe's download ($DFLASH_WHEEL_CACHE or ~/.cache/dflash-space/wheels-dl, build/sdist/), else `pip
download` into the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError

GENERATOR_VERSION = 1
CACHE_ENV = "DFLASH_REAL_LAYOUT_CACHE"
SDIST_ENV = "DFLASH_LLAMA_SDIST"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # prebuilt_wheels' pin
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-qwen35.gguf",
          "models/templates/Qwen3.5-4B.jinja")
# The converter's requirements (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt), with the
# machine's CPU build of torch instead of its CUDA one.
CONVERTER_REQUIREMENTS = ("torch==2.13.0", "transformers==4.57.6", "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0",
                          "protobuf>=4.21.0,<5.0.0")
HF_SCRIPT = Path(__file__).with_name("real_layout_hf.py")
MTP_LAYERS_KEY = "qwen35.nextn_predict_layers"
SAMPLING_DEFAULTS = {"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}  # what the target's header carries


class RealLayoutError(DFlashError):
    """The real-layout pair could not be built (a step failed; its output is in the message)."""


@dataclass(frozen=True)
class RealLayoutPair:
    target: Path
    draft: Path


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-space" / "real-layout")


def cache_key(seed: int) -> str:
    digest = hashlib.sha256()
    for part in (str(GENERATOR_VERSION), SDIST_SHA256, str(seed), *CONVERTER_REQUIREMENTS):
        digest.update(part.encode() + b"\0")
    digest.update(HF_SCRIPT.read_bytes())
    return digest.hexdigest()[:16]


def real_layout_pair(cache_dir: Path | None = None, *, seed: int = 0,
                     log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
                     ) -> RealLayoutPair:
    """The pair's files, built on first use (a few minutes on two cores; concurrent callers wait for one build)."""
    cache = Path(cache_dir or default_cache_dir())
    out = cache / f"pair-{cache_key(seed)}"
    pair = RealLayoutPair(out / "target-nvfp4-q8attn-mtp.gguf", out / "draft-dflash2-q4_k_m.gguf")
    if pair.target.is_file() and pair.draft.is_file():
        return pair
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".build.lock"):
        if pair.target.is_file() and pair.draft.is_file():
            return pair
        _build(cache, out, pair, seed, log)
    return pair


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def vendored_file(relative: str, cache_dir: Path | None = None) -> str:
    """A text file of the sdist's vendor/llama.cpp (e.g. "models/templates/Qwen3.5-4B.jinja"), extracted if needed."""
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".build.lock"):
        root = _vendored_converter(cache, lambda line: print(line, file=sys.stderr, flush=True))
    return (root / relative).read_text(encoding="utf-8")


def _build(cache: Path, out: Path, pair: RealLayoutPair, seed: int, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    llama_cpp_dir = _vendored_converter(cache, log)
    python = _converter_venv(cache, log)
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as tmp:
        work = Path(tmp)
        script = [str(python), str(HF_SCRIPT), "--llama-cpp", str(llama_cpp_dir)]
        log("real-layout pair: writing the Hugging Face checkpoints")
        _run([*script, "--out", str(work / "hf"), "--seed", str(seed), "write"], work / "write.log")
        log("real-layout pair: converting the target (--outtype bf16 --fp8-as-q8)")
        _run([*script, "convert", "--", str(work / "hf" / "target"), "--outtype", "bf16", "--fp8-as-q8",
              "--model-name", "Qwen3.8-27B-NVFP4-MTP-Q8attn real layout", "--outfile", str(work / "target.gguf")],
             work / "convert-target.log")
        log("real-layout pair: converting the draft (--target-model-dir)")
        _run([*script, "convert", "--", str(work / "hf" / "draft"), "--outtype", "bf16", "--target-model-dir",
              str(work / "hf" / "target"), "--model-name", "Qwen3.8-27B-DFlash2 real layout",
              "--outfile", str(work / "draft-bf16.gguf")], work / "convert-draft.log")
        log("real-layout pair: quantising the draft to Q4_K_M")
        quantize(work / "draft-bf16.gguf", work / "draft.gguf", "Q4_K_M")
        out.mkdir(parents=True, exist_ok=True)
        os.replace(work / "draft.gguf", pair.draft)
        os.replace(work / "target.gguf", pair.target)  # last: its presence with the draft's means "done"
    for stale in cache.glob("pair-*"):  # pairs of older generator inputs: nothing reads them any more
        if stale != out:
            shutil.rmtree(stale, ignore_errors=True)
    log(f"real-layout pair: built in {time.monotonic() - started:.0f} s under {out}")


def _run(cmd: list[str], log_path: Path) -> None:
    with log_path.open("w") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise RealLayoutError(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}):\n" + "\n".join(tail))


def find_sdist(cache: Path, log: Callable[[str], None]) -> Path:
    if os.environ.get(SDIST_ENV):
        return Path(os.environ[SDIST_ENV])
    wheels = Path(os.environ.get("DFLASH_WHEEL_CACHE") or Path.home() / ".cache" / "dflash-space" / "wheels-dl")
    for candidate in (wheels / "build" / "sdist" / SDIST_NAME, cache / "sdist" / SDIST_NAME):
        if candidate.is_file():
            return candidate
    log("real-layout pair: downloading the llama-cpp-python 0.3.36 sdist")
    target = cache / "sdist"
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(target),
          "llama-cpp-python==0.3.36"], cache / "sdist-download.log")
    return target / SDIST_NAME


def _vendored_converter(cache: Path, log: Callable[[str], None]) -> Path:
    """The converter, gguf-py, the Qwen3.5 template and the Qwen2/3 BPE from the sdist (checked against the pin)."""
    root = cache / f"llama.cpp-{SDIST_SHA256[:12]}"
    if (root / ".complete").is_file():
        return root
    sdist = find_sdist(cache, log)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RealLayoutError(f"{sdist}: sha256 {digest} is not the pinned {SDIST_SHA256}")
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            rel = member.name.removeprefix(VENDOR)
            if rel != member.name and member.isfile() and any(rel == n or rel.startswith(n) for n in NEEDED):
                dest = root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                source = archive.extractfile(member)
                assert source is not None
                dest.write_bytes(source.read())
    (root / ".complete").write_text(SDIST_SHA256 + "\n")
    return root


def _converter_venv(cache: Path, log: Callable[[str], None]) -> Path:
    requirements = "\n".join(CONVERTER_REQUIREMENTS)
    venv = cache / f"convert-venv-{hashlib.sha256(requirements.encode()).hexdigest()[:12]}"
    python = venv / "bin" / "python"
    if (venv / ".complete").is_file():
        return python
    log("real-layout pair: creating the converter's venv (torch CPU, transformers)")
    shutil.rmtree(venv, ignore_errors=True)
    base = shutil.which("python3") or sys.executable
    _run([base, "-m", "venv", str(venv)], cache / "venv.log")
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *CONVERTER_REQUIREMENTS],
         cache / "venv-install.log")
    (venv / ".complete").write_text(requirements + "\n")
    return python


def quantize(src: Path, dst: Path, ftype: str) -> None:
    """llama_model_quantize through llama_cpp's binding; a refused type or file is an error, not a fallback."""
    from llama_cpp import llama_cpp as ll

    from ..pair import init_native

    init_native()
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = os.cpu_count() or 2
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise RealLayoutError(f"llama_model_quantize({src.name} -> {ftype}) returned {rc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_runtime.testing.real_layout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default ${CACHE_ENV} or the user cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        pair = real_layout_pair(args.cache_dir, seed=args.seed)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"target {pair.target} ({pair.target.stat().st_size / 2**20:.0f} MiB)")
    print(f"draft  {pair.draft} ({pair.draft.stat().st_size / 2**20:.0f} MiB)")
    print(f"ready in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
