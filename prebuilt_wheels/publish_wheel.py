"""Publish a built wheel and its manifest to a public Hub model repository, and point requirements.txt at it.

A Space installs requirements.txt before its repository is copied in, so the wheel must come from a URL. The line
written here pins the upload's commit (the file behind the URL can never change) and carries the wheel's sha256
(pip refuses other bytes). A CUDA wheel also needs the CUDA runtime from PyPI; those lines are version ranges, so
they agree with whatever the platform's own packages (torch) already pin. Run through `build_wheel.py publish`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from build_wheel import MANIFEST_NAME, PACKAGE, RecipeError, file_sha256, load_manifest

DEFAULT_ENDPOINT = "https://huggingface.co"
# CUDA 13 runtime for the wheel (built against 13.0): any 13.x works under CUDA's minor-version compatibility, and
# ranges admit the exact versions the platform's torch pins (13.0.96 / 13.1.x, 13.2.86 / 13.4.1.3, ...).
CUDA_RUNTIME_REQUIREMENTS = {"nvidia-cuda-runtime": ">=13.0,<14", "nvidia-cublas": ">=13.0,<14"}
PUBLISHED_MANIFEST_DIR = Path("prebuilt_wheels") / "published"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Published:
    repo: str
    commit: str
    path_in_repo: str
    url: str  # the wheel at that commit
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{PACKAGE} @ {self.url}#sha256={self.sha256}"


# ---------------------------------------------------------------- requirements.txt


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    """The project a requirements line names (None for comments, blank lines and options such as --find-links)."""
    text = line.split(" #", 1)[0].strip()
    if not text or text.startswith(("#", "-")):
        return None
    match = _NAME.match(text)
    return normalized(match.group(1)) if match else None


def rewrite_requirements(text: str, requirement: str, runtime: dict[str, str]) -> str:
    """Replace the llama-cpp-python line with `requirement`, followed by the CUDA runtime lines `runtime` (none for a
    CPU wheel); earlier CUDA runtime lines go. Every other line, comment and option stays as it is. Idempotent."""
    managed = {normalized(name) for name in CUDA_RUNTIME_REQUIREMENTS}
    out: list[str] = []
    anchor = None
    for line in text.splitlines():
        name = requirement_name(line)
        if name == normalized(PACKAGE) and anchor is None:
            anchor = len(out)
        elif name == normalized(PACKAGE) or name in managed:
            continue  # a second llama-cpp-python line would conflict with the first
        out.append(line)
    if anchor is None:
        anchor = len(out)
        out.append("")
    out[anchor : anchor + 1] = [requirement, *(f"{name}{spec}" for name, spec in runtime.items())]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the upload


def checked_manifest(out_dir: Path, variant: str) -> tuple[dict, Path]:
    """The manifest of the built wheel in out_dir, after checking that the wheel next to it is the one it names."""
    manifest = load_manifest(out_dir)
    if not manifest:
        raise RecipeError(f"no {MANIFEST_NAME} in {out_dir}: build the wheel first")
    if manifest.get("variant") != variant:
        raise RecipeError(f"{out_dir / MANIFEST_NAME} describes a {manifest.get('variant')} wheel, not {variant}")
    wheel = out_dir / manifest["wheel"]["filename"]
    if not wheel.is_file():
        raise RecipeError(f"{wheel} is missing: build it again")
    if file_sha256(wheel) != manifest["wheel"]["sha256"]:
        raise RecipeError(f"{wheel} does not have the sha256 its manifest records: build it again")
    return manifest, wheel


def hub_api(endpoint: str, token: str | None):  # -> huggingface_hub.HfApi
    try:
        from huggingface_hub import HfApi
    except ImportError as error:
        raise RecipeError("publishing needs huggingface_hub: pip install 'huggingface-hub>=2.4,<3'") from error
    return HfApi(endpoint=endpoint, token=token)


def upload(manifest: dict, wheel: Path, manifest_path: Path, repo: str, endpoint: str, token: str | None) -> Published:
    """Upload the wheel and its manifest under <variant>/ in one commit; read back what the URL serves there."""
    from huggingface_hub import CommitOperationAdd, get_hf_file_metadata, hf_hub_url

    api = hub_api(endpoint, token)
    api.create_repo(repo, repo_type="model", private=False, exist_ok=True)
    if api.model_info(repo).private:
        raise RecipeError(f"{repo} is private: the Spaces builder downloads the wheel without a token, make it public")
    variant, sha256 = manifest["variant"], manifest["wheel"]["sha256"]
    path_in_repo = f"{variant}/{wheel.name}"
    operations = [
        CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=str(wheel)),
        CommitOperationAdd(path_in_repo=f"{variant}/{MANIFEST_NAME}", path_or_fileobj=str(manifest_path)),
    ]
    message = f"{PACKAGE} {manifest['version']} {variant} wheel, sha256 {sha256[:12]}"
    commit = api.create_commit(repo, operations, commit_message=message, repo_type="model").oid
    url = hf_hub_url(repo, path_in_repo, revision=commit, endpoint=endpoint)
    served = get_hf_file_metadata(url, token=token)
    problems = []
    if served.commit_hash != commit:
        problems.append(f"the Hub resolves it at commit {served.commit_hash}, not {commit}")
    if served.size != manifest["wheel"]["size"]:
        problems.append(f"the Hub serves {served.size} bytes, not {manifest['wheel']['size']}")
    etag = (served.etag or "").strip('"')
    if _HEX64.fullmatch(etag) and etag != sha256:  # large files: the ETag is the content's sha256
        problems.append(f"the Hub serves sha256 {etag}, not {sha256}")
    if problems:
        raise RecipeError(f"uploaded {path_in_repo} to {repo}, but " + "; ".join(problems))
    return Published(repo, commit, path_in_repo, url, sha256)


def publish(
    out_dir: Path,
    variant: str,
    repo: str,
    requirements: Path,
    *,
    endpoint: str | None = None,
    token: str | None = None,
) -> Published:
    """Upload, rewrite requirements.txt, and keep a copy of the manifest beside it for the start-up check."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise RecipeError(f"--repo must be OWNER/NAME, not {repo!r}")
    if not requirements.is_file():
        raise RecipeError(f"{requirements} does not exist")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    manifest, wheel = checked_manifest(out_dir, variant)
    hub_api(endpoint, token)  # huggingface_hub is importable
    from huggingface_hub.errors import HfHubHTTPError

    try:
        published = upload(manifest, wheel, out_dir / MANIFEST_NAME, repo, endpoint, token)
    except HfHubHTTPError as error:  # a bad token, no write access, a name taken: the Hub's own message
        raise RecipeError(f"the Hub at {endpoint} refused the upload to {repo}: {error}") from error
    runtime = CUDA_RUNTIME_REQUIREMENTS if variant == "cuda" else {}
    text = requirements.read_text()
    requirements.write_text(rewrite_requirements(text, published.requirement, runtime))
    # The start-up check compares the installed libraries with this copy (the build output is not committed).
    record = requirements.parent / PUBLISHED_MANIFEST_DIR / variant / MANIFEST_NAME
    record.parent.mkdir(parents=True, exist_ok=True)
    stamped = {**manifest, "published": {"repo": published.repo, "commit": published.commit, "url": published.url}}
    record.write_text(json.dumps(stamped, indent=2, sort_keys=True) + "\n")
    return published
