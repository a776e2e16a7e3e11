"""A local fake of the Hub's repository API, enough for `huggingface_hub` to create a model repo and commit files to
it (regular files inline, large files through Git LFS "basic" transfer), and for anyone (pip, hf_hub_download) to
read them back under `/{repo}/resolve/{revision}/{path}`.

Like the Hub, large files are served by redirect to a separate storage host (a second server here, on another
port: another origin, which huggingface_hub does not follow for metadata and pip follows for downloads), with the
file's sha256 in `X-Linked-Etag`. The fake speaks LFS, not Xet: clients run with HF_HUB_DISABLE_XET=1.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from local_http import origin, serve, shut

LFS_FROM_BYTES = 10 * 1024  # the Hub stores binary and large files in LFS; a size threshold stands in for its rules


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    @property
    def etag(self) -> str:
        """The Hub's ETag: sha256 for an LFS file, the git blob id for a regular one."""
        if self.lfs:
            return hashlib.sha256(self.data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class FakeRepo:
    private: bool = False
    commits: list[tuple[str, dict[str, StoredFile]]] = field(default_factory=list)  # oldest first

    def tree(self, revision: str) -> tuple[str, dict[str, StoredFile]] | None:
        if not self.commits:
            return None
        if revision == "main":
            return self.commits[-1]
        return next((c for c in self.commits if c[0] == revision), None)


@dataclass
class FakeHubRepos:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes, on the storage host
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path), both servers
    servers: list[ThreadingHTTPServer] = field(default_factory=list)
    rejected_token: str | None = None  # requests carrying it get the Hub's 401

    @property
    def endpoint(self) -> str:
        return origin(self.servers[0])

    @property
    def storage(self) -> str:
        return origin(self.servers[1])

    def start(self) -> FakeHubRepos:
        self.servers = [serve(self._dispatch) for _ in range(2)]  # the Hub, then its storage host
        return self

    def stop(self) -> None:
        for server in self.servers:
            shut(server)

    # ------------------------------------------------------------ routing

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if h.command in ("POST", "PUT") else b""
        on_storage = h.server is self.servers[1]
        if self.rejected_token and h.headers.get("Authorization") == f"Bearer {self.rejected_token}":
            return _reply_json(h, 401, {"error": "Invalid credentials in Authorization header"})
        parts = path.strip("/").split("/")
        if on_storage and h.command == "PUT" and parts[0] == "upload":
            return self._store_object(h, parts[1], body)
        if on_storage and h.command in ("GET", "HEAD") and parts[0] == "objects" and parts[1] in self.lfs_objects:
            return _reply(h, 200, self.lfs_objects[parts[1]], send_body=h.command == "GET")
        if on_storage:
            return _reply(h, 404, b"")
        if h.command == "POST" and path == "/api/repos/create":
            return self._create_repo(h, json.loads(body))
        if h.command == "GET" and parts[:2] == ["api", "models"]:
            return self._model_info(h, "/".join(parts[2:4]))
        if h.command == "POST" and parts[:2] == ["api", "models"] and parts[4] == "preupload":
            return self._preupload(h, json.loads(body))
        if h.command == "POST" and parts[:2] == ["api", "models"] and parts[4] == "commit":
            return self._commit(h, "/".join(parts[2:4]), body)
        if h.command == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch(h, json.loads(body))
        if h.command == "POST" and path == "/lfs-verify":
            oid = json.loads(body)["oid"]
            return _reply_json(h, 200 if oid in self.lfs_objects else 404, {})
        if h.command in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        return _reply_json(h, 404, {"error": f"not faked: {h.command} {path}"})

    # ------------------------------------------------------------ the API

    def _create_repo(self, h: BaseHTTPRequestHandler, payload: dict) -> None:
        repo = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if repo in self.repos:
            url = f"{self.endpoint}/{repo}"
            return _reply_json(h, 409, {"error": "You already created this model repo", "url": url})
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        self.repos[repo] = FakeRepo(private=private)
        return _reply_json(h, 200, {"url": f"{self.endpoint}/{repo}"})

    def _model_info(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        if repo not in self.repos:
            return _reply_json(h, 404, {"error": "Repository not found"}, error_code="RepoNotFound")
        head = self.repos[repo].tree("main")
        siblings = [{"rfilename": name} for name in (head[1] if head else {})]
        info = {"id": repo, "private": self.repos[repo].private, "sha": head[0] if head else None}
        return _reply_json(h, 200, {**info, "siblings": siblings})

    def _preupload(self, h: BaseHTTPRequestHandler, payload: dict) -> None:
        modes = {f["path"]: "lfs" if f["size"] >= LFS_FROM_BYTES else "regular" for f in payload["files"]}
        files = [{"path": path, "uploadMode": mode, "shouldIgnore": False} for path, mode in modes.items()]
        return _reply_json(h, 200, {"files": files})

    def _lfs_batch(self, h: BaseHTTPRequestHandler, payload: dict) -> None:
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.storage}/upload/{obj['oid']}"},
                    "verify": {"href": f"{self.endpoint}/lfs-verify"},
                }
            objects.append(entry)
        return _reply_json(h, 200, {"transfer": "basic", "objects": objects})

    def _store_object(self, h: BaseHTTPRequestHandler, oid: str, body: bytes) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return _reply(h, 400, b"content does not match the oid")
        self.lfs_objects[oid] = body
        return _reply(h, 200, b"")

    def _commit(self, h: BaseHTTPRequestHandler, repo: str, body: bytes) -> None:
        if repo not in self.repos:
            return _reply_json(h, 404, {"error": "Repository not found"}, error_code="RepoNotFound")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        parent = self.repos[repo].tree("main")
        files = dict(parent[1]) if parent else {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    return _reply_json(h, 422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = StoredFile(self.lfs_objects[value["oid"]], lfs=True)
        commit = hashlib.sha1(((parent[0] if parent else "") + body.decode()).encode()).hexdigest()
        self.repos[repo].commits.append((commit, files))
        return _reply_json(h, 200, {"commitUrl": f"{self.endpoint}/{repo}/commit/{commit}", "commitOid": commit})

    def _resolve(self, h: BaseHTTPRequestHandler, repo: str, revision: str, path: str) -> None:
        tree = self.repos[repo].tree(revision) if repo in self.repos else None
        if tree is None:
            return _reply_json(h, 404, {"error": "Repository not found"}, error_code="RepoNotFound")
        commit, files = tree
        stored = files.get(path)
        if stored is None:
            return _reply_json(h, 404, {"error": "Entry not found"}, error_code="EntryNotFound")
        headers = {"X-Repo-Commit": commit, "ETag": f'"{stored.etag}"'}
        if stored.lfs:  # the Hub redirects large files to its storage host
            headers |= {"Location": f"{self.storage}/objects/{stored.etag}", "X-Linked-Etag": f'"{stored.etag}"'}
            headers["X-Linked-Size"] = str(len(stored.data))
            return _reply(h, 302, b"", headers=headers)
        return _reply(h, 200, stored.data, headers=headers, send_body=h.command == "GET")


def _reply(
    h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None, send_body: bool = True
) -> None:
    h.send_response(status)
    for key, value in (headers or {}).items():
        h.send_header(key, value)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if send_body and body:
        h.wfile.write(body)


def _reply_json(h: BaseHTTPRequestHandler, status: int, payload: dict, error_code: str | None = None) -> None:
    headers = {"Content-Type": "application/json"} | ({"X-Error-Code": error_code} if error_code else {})
    _reply(h, status, json.dumps(payload).encode(), headers=headers, send_body=h.command != "HEAD")
