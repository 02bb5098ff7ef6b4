"""A stand-in for the Hugging Face Hub at its HTTP boundary, for tests and offline demos.

The real `huggingface_hub` client (and everything built on it: `Trainer.push_to_hub`, `from_pretrained`,
`PeftModel.from_pretrained`, `snapshot_download`) talks to it through `HF_ENDPOINT`. Nothing in the client is
patched: the stand-in answers the same HTTP requests the Hub answers, with the same status codes, headers and JSON
shapes, for the subset of the API that pushing and loading a model uses:

* `POST /api/repos/create`, `GET /api/whoami-v2`
* `POST /api/validate-yaml`: a README's metadata is checked before upload, as the Hub does (`validate_card_metadata`:
  a YAML mapping; `base_model` / `datasets` / `tags` strings or lists of them; `base_model` and `datasets` repo ids;
  `library_name` and `pipeline_tag` from the Hub's lists; a `model-index` that `huggingface_hub` can read back)
* `POST /api/models/{repo}/preupload/{rev}`: binary files and the Hub's LFS extensions (`*.safetensors`, `*.bin`,
  `*.png`, ...) are "lfs", everything else "regular", as on the Hub
* `POST /{repo}.git/info/lfs/objects/batch`, `PUT /_lfs/{oid}`, `POST /_lfs/verify`: the Git LFS "basic" transfer
  (the sha256 of every upload is checked)
* `POST /api/models/{repo}/commit/{rev}`: the NDJSON commit (`header`, `file`, `lfsFile`, `deletedFile`,
  `deletedFolder`); every commit is a snapshot addressable by its sha
* `GET /api/models/{repo}[/revision/{rev}]` (model_info: sha, siblings), `GET /api/models/{repo}/tree/{rev}[/{path}]`
  (list_repo_files / list_repo_tree), `POST /api/models/{repo}/paths-info/{rev}`
* `HEAD|GET /{repo}/resolve/{rev}/{path}`: regular files are served directly; LFS files answer a redirect to
  `http://localhost:{port}/_lfs/{oid}` with `X-Linked-Etag` / `X-Linked-Size`, as the Hub redirects to its CDN (another
  host name for the same server, so the client treats it as the Hub's CDN).

Errors carry the Hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`), so the client raises the
same exception classes it raises against the Hub. Writes need a token (`Authorization: Bearer ...`; any value).

Not implemented: the Xet storage protocol. `huggingface_hub` uses it automatically when `hf_xet` is installed, so
clients must run with `HF_HUB_DISABLE_XET=1` (set before `huggingface_hub` is imported); a Xet token request gets a
501 that says so. Requests to any other route are answered 501 and recorded in `HubStub.unhandled`.

Usage in a test::

    with HubStub() as hub:
        env = hub.client_env(cache_dir)  # HF_ENDPOINT, HF_HUB_DISABLE_XET=1, HF_TOKEN, HF_HUB_CACHE, not offline
        subprocess.run([...], env=env)
        hub.files("me/my-adapter")  # {path: bytes} of the newest commit

From a shell (a newcomer's local Hub)::

    python -m tests.support.hub.server --port 8765   # then, in another shell, export the variables it prints
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

# The Hub's default .gitattributes routes these through LFS (a subset of it: what model repos hold).
LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".pkl", ".pickle", ".npy", ".npz",
    ".gz", ".zip", ".tar", ".png", ".jpg", ".jpeg", ".gif", ".parquet", ".arrow", ".model", ".tflite",
)  # fmt: skip
LFS_SIZE_THRESHOLD = 10 * 2**20  # larger files go through LFS whatever their name
USER = "stub-user"
GITATTRIBUTES = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES).encode()


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class StoredFile:
    size: int
    content: bytes | None = None  # regular files
    lfs_oid: str | None = None  # LFS files: sha256 of the content, which lives in the LFS store

    @property
    def blob_id(self) -> str:
        return git_blob_sha1(self.content if self.lfs_oid is None else lfs_pointer(self.lfs_oid, self.size))


@dataclass
class Commit:
    sha: str
    message: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    commits: list[Commit] = field(default_factory=list)  # oldest first
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha

    def resolve(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return next((c for c in self.commits if c.sha == sha), None)


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HubStub:
    """The stand-in Hub: a threaded HTTP server on 127.0.0.1 (random port unless given) plus its in-memory state."""

    def __init__(self, port: int = 0, require_token: bool = True):
        self.require_token = require_token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status), in order
        self.unhandled: list[tuple[str, str]] = []
        self.served: list[tuple[str, str]] = []  # (repo, path) whose content was sent by a GET, in order
        self._redirected: dict[str, set[tuple[str, str]]] = {}  # LFS oid -> (repo, path) resolved to it
        self._lock = threading.RLock()
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubStub:
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> HubStub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def storage_endpoint(self) -> str:
        """Where LFS content is served: the same server under another host name, as the Hub's CDN is another host
        (the client stops at a redirect to another host and reads the file's metadata from the redirect itself)."""
        return f"http://localhost:{self._server.server_address[1]}"

    def client_env(self, cache_dir: str, base: dict | None = None, token: str = "hf_stub_token") -> dict[str, str]:
        """Environment for a client process: this endpoint, no Xet, a token, an empty cache, online."""
        env = dict(os.environ if base is None else base)
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
            env.pop(key, None)
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HUB_DISABLE_XET="1",
            HF_TOKEN=token,
            HF_HUB_CACHE=os.path.join(cache_dir, "hub"),
            HF_HOME=cache_dir,
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_ETAG_TIMEOUT="30",
            HF_HUB_DOWNLOAD_TIMEOUT="60",
        )
        return env

    # ------------------------------------------------------------------------------------------ inspection
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Path -> content of every file of `repo_id` at `revision` (LFS content resolved)."""
        with self._lock:
            commit = self._commit(repo_id, revision)
            return {path: self._content(f) for path, f in commit.files.items()}

    def commits(self, repo_id: str) -> list[Commit]:
        with self._lock:
            return list(self._repo(repo_id).commits)

    def lfs_paths(self, repo_id: str, revision: str = "main") -> set[str]:
        with self._lock:
            return {p for p, f in self._commit(repo_id, revision).files.items() if f.lfs_oid is not None}

    def downloads(self, repo_id: str) -> list[str]:
        """Paths of `repo_id` whose content was downloaded (directly, or from LFS storage after a redirect), in order."""
        return [path for repo, path in self.served if repo == repo_id]

    # ------------------------------------------------------------------------------------------ seeding
    def seed(self, repo_id: str, folder: str, message: str = "Seed") -> str:
        """Create `repo_id` with the files of `folder` (server side, as if someone had pushed them). Returns the sha."""
        files = {}
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
                with open(os.path.join(root, name), "rb") as f:
                    files[path] = f.read()
        with self._lock:
            self.repos.setdefault(repo_id, Repo(repo_id))
            stored = {}
            for path, content in files.items():
                if self._is_lfs(path, content):
                    oid = hashlib.sha256(content).hexdigest()
                    self.lfs_objects[oid] = content
                    stored[path] = StoredFile(len(content), lfs_oid=oid)
                else:
                    stored[path] = StoredFile(len(content), content=content)
            return self._commit_files(self.repos[repo_id], "main", stored, message)

    # ------------------------------------------------------------------------------------------ internals
    @staticmethod
    def _is_lfs(path: str, sample_or_content: bytes, size: int | None = None) -> bool:
        size = len(sample_or_content) if size is None else size
        return path.lower().endswith(LFS_SUFFIXES) or size >= LFS_SIZE_THRESHOLD or b"\0" in sample_or_content[:512]

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _commit(self, repo_id: str, revision: str) -> Commit:
        repo = self._repo(repo_id)
        commit = repo.resolve(unquote(revision))
        if commit is None:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _content(self, stored: StoredFile) -> bytes:
        return stored.content if stored.lfs_oid is None else self.lfs_objects[stored.lfs_oid]

    def _commit_files(self, repo: Repo, branch: str, files: dict[str, StoredFile], message: str) -> str:
        parent = repo.branches.get(branch, "")
        digest = hashlib.sha1(f"{parent}\n{message}\n{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(f"{path}:{files[path].blob_id}\n".encode())
        sha = digest.hexdigest()
        repo.commits.append(Commit(sha, message, files))
        repo.branches[branch] = sha
        return sha


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# The ones the recipe and the tests can produce, plus common neighbours; the Hub's own lists are longer.
LIBRARY_NAMES = {"transformers", "peft", "diffusers", "sentence-transformers", "timm", "gguf", "mlx", "onnx"}
PIPELINE_TAGS = {"text-generation", "text2text-generation", "text-classification", "token-classification",
                 "question-answering", "feature-extraction", "fill-mask", "reinforcement-learning"}  # fmt: skip


def validate_card_metadata(content: str) -> list[str]:
    """Errors in the YAML front matter of a README, as the Hub's metadata validation would report them."""
    import yaml
    from huggingface_hub.repocard_data import model_index_to_eval_results

    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.DOTALL)
    if match is None:
        return []  # no metadata: the Hub only warns
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        return [f"YAML is invalid: {error}"]
    if not isinstance(data, dict):
        return ["metadata must be a YAML mapping"]
    errors = []
    for key in ("base_model", "datasets", "tags", "language"):
        value = data.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            errors.append(f'"{key}" must be a string or a list of strings')
        elif key in ("base_model", "datasets") and not all(_REPO_ID.match(v) for v in values):
            errors.append(f'"{key}" must be Hub repo ids, got {values}')
    if "library_name" in data and data["library_name"] not in LIBRARY_NAMES:
        errors.append(f'"library_name" {data["library_name"]!r} is not a known library')
    if "pipeline_tag" in data and data["pipeline_tag"] not in PIPELINE_TAGS:
        errors.append(f'"pipeline_tag" {data["pipeline_tag"]!r} is not a known pipeline tag')
    if "model-index" in data:
        try:
            model_index_to_eval_results(data["model-index"])
        except (KeyError, TypeError, ValueError, IndexError) as error:
            errors.append(f'"model-index" is malformed: {error!r}')
    return errors


_REPO_PART = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_ROUTES = [
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(rf"^/api/models/{_REPO_PART}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO_PART}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("GET", re.compile(rf"^/api/models/{_REPO_PART}/xet-write-token/(?P<rev>[^/]+)$"), "xet"),
    ("GET", re.compile(rf"^/api/models/{_REPO_PART}/xet-read-token/(?P<rev>[^/]+)$"), "xet"),
    ("GET", re.compile(rf"^/api/models/{_REPO_PART}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("POST", re.compile(rf"^/api/models/{_REPO_PART}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO_PART}/revision/(?P<rev>[^/]+)$"), "model_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO_PART}$"), "model_info"),
    ("POST", re.compile(rf"^/{_REPO_PART}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(r"^/_lfs/verify$"), "lfs_verify"),
    ("GET", re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})$"), "lfs_get"),
    ("HEAD", re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})$"), "lfs_get"),
    ("GET", re.compile(rf"^/{_REPO_PART}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(rf"^/{_REPO_PART}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    hub: HubStub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet: the hub records requests itself
        pass

    # ------------------------------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str | None = None):
        self.send_response(status)
        headers = dict(headers or {})
        if content_type:
            headers.setdefault("Content-Type", content_type)
        headers.setdefault("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._status = status

    def _json(self, payload, status: int = 200, headers: dict | None = None):
        self._send(status, json.dumps(payload).encode(), headers, "application/json")

    def _error(self, error: _HubError):
        headers = {"X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._json({"error": error.message}, error.status, headers)

    def _require_token(self):
        auth = self.headers.get("Authorization", "")
        if self.hub.require_token and (not auth.startswith("Bearer ") or not auth[len("Bearer ") :].strip()):
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self):
        self._status = 0
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query)
        try:
            for method, pattern, name in _ROUTES:
                match = pattern.match(path)
                if match and method == self.command:
                    with self.hub._lock:
                        getattr(self, f"_do_{name}")(query=query, **match.groupdict())
                    break
            else:
                self.hub.unhandled.append((self.command, self.path))
                self._error(_HubError(501, f"The Hub stand-in does not implement {self.command} {split.path}"))
        except _HubError as error:
            self._error(error)
        finally:
            self.hub.requests.append((self.command, path, self._status))

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _dispatch

    # ------------------------------------------------------------------------------------------ account, repos
    def _do_whoami(self, query):
        self._require_token()
        self._json({"type": "user", "name": USER, "fullname": USER, "orgs": [], "auth": {"type": "access_token",
                    "accessToken": {"displayName": "stub", "role": "write"}}})  # fmt: skip

    def _do_create_repo(self, query):
        self._require_token()
        payload = json.loads(self._body() or b"{}")
        if payload.get("type", "model") not in (None, "model"):
            raise _HubError(400, "The Hub stand-in only hosts model repositories")
        name, org = payload.get("name"), payload.get("organization")
        if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise _HubError(400, f"Invalid repo name {name!r}")
        repo_id = f"{org or USER}/{name}"
        if repo_id in self.hub.repos:
            self._json({"error": "You already created this model repo", "url": f"{self.hub.endpoint}/{repo_id}"}, 409)
            return
        repo = Repo(repo_id, private=payload.get("visibility") == "private")
        self.hub.repos[repo_id] = repo
        files = {".gitattributes": StoredFile(len(GITATTRIBUTES), content=GITATTRIBUTES)}
        self.hub._commit_files(repo, "main", files, "initial commit")
        self._json({"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def _do_validate_yaml(self, query):
        payload = json.loads(self._body() or b"{}")
        errors = validate_card_metadata(payload.get("content", ""))
        if errors:
            self._json({"errors": [{"message": e} for e in errors], "warnings": []}, 400)
        else:
            self._json({"errors": [], "warnings": []})

    def _do_model_info(self, query, repo, rev="main"):
        commit = self.hub._commit(repo, rev)
        siblings = []
        for path, stored in sorted(commit.files.items()):
            sibling = {"rfilename": path, "blobId": stored.blob_id, "size": stored.size}
            if stored.lfs_oid:
                pointer_size = len(lfs_pointer(stored.lfs_oid, stored.size))
                sibling["lfs"] = {"sha256": stored.lfs_oid, "size": stored.size, "pointerSize": pointer_size}
            siblings.append(sibling)
        self._json({"id": repo, "_id": hashlib.md5(repo.encode()).hexdigest()[:24], "modelId": repo, "sha": commit.sha,
                    "private": self.hub.repos[repo].private, "disabled": False, "gated": False, "tags": [],
                    "siblings": siblings, "lastModified": "2025-01-01T00:00:00.000Z"})  # fmt: skip

    # ------------------------------------------------------------------------------------------ listing
    def _entry(self, path: str, stored: StoredFile) -> dict:
        entry = {"type": "file", "oid": stored.blob_id, "size": stored.size, "path": path}
        if stored.lfs_oid:
            pointer_size = len(lfs_pointer(stored.lfs_oid, stored.size))
            entry["lfs"] = {"oid": stored.lfs_oid, "size": stored.size, "pointerSize": pointer_size}
        return entry

    def _listing(self, commit: Commit, prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        entries, folders = [], set()
        for path, stored in sorted(commit.files.items()):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                if recursive or depth == 1:
                    folders.add(base + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append(self._entry(path, stored))
        folder_entries = [
            {"type": "directory", "oid": git_blob_sha1(f.encode()), "size": 0, "path": f} for f in folders
        ]
        return sorted(folder_entries, key=lambda e: e["path"]) + entries

    def _do_tree(self, query, repo, rev, path=None):
        commit = self.hub._commit(repo, rev)
        prefix = path or ""
        if prefix and not any(p == prefix or p.startswith(prefix.rstrip("/") + "/") for p in commit.files):
            raise _HubError(404, f"{prefix} does not exist on {rev}", "EntryNotFound")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        self._json(self._listing(commit, prefix, recursive))

    def _do_paths_info(self, query, repo, rev):
        commit = self.hub._commit(repo, rev)
        raw = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:
            paths = parse_qs(raw.decode()).get("paths", [])
        out = []
        for path in paths:
            if path in commit.files:
                out.append(self._entry(path, commit.files[path]))
            elif any(p.startswith(path.rstrip("/") + "/") for p in commit.files):
                out.append({"type": "directory", "oid": git_blob_sha1(path.encode()), "size": 0, "path": path})
        self._json(out)

    # ------------------------------------------------------------------------------------------ upload
    def _do_preupload(self, query, repo, rev):
        self._require_token()
        self.hub._commit(repo, rev)
        files = json.loads(self._body())["files"]
        out = []
        for f in files:
            sample = base64.b64decode(f["sample"])
            mode = "lfs" if HubStub._is_lfs(f["path"], sample, f["size"]) else "regular"
            out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": None})
        self._json({"files": out, "commitOid": self.hub._commit(repo, rev).sha})

    def _do_xet(self, query, repo, rev):
        raise _HubError(501, "The Hub stand-in speaks Git LFS, not Xet: set HF_HUB_DISABLE_XET=1 in the client.")

    def _do_lfs_batch(self, query, repo):
        self._require_token()
        self.hub._repo(repo)
        payload = json.loads(self._body())
        if payload.get("operation") != "upload":
            raise _HubError(400, "The Hub stand-in accepts LFS uploads only (downloads go through /resolve)")
        if "basic" not in payload.get("transfers", ["basic"]):
            raise _HubError(400, "The Hub stand-in only offers the 'basic' LFS transfer")
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.endpoint}/_lfs/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.endpoint}/_lfs/verify", "header": {}},
                }
            objects.append(entry)
        self._json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                   headers={"Content-Type": "application/vnd.git-lfs+json"})  # fmt: skip

    def _do_lfs_put(self, query, oid):
        content = self._body()
        if hashlib.sha256(content).hexdigest() != oid:
            raise _HubError(400, f"LFS upload does not match its oid {oid}")
        self.hub.lfs_objects[oid] = content
        self._send(200)

    def _do_lfs_verify(self, query):
        payload = json.loads(self._body())
        content = self.hub.lfs_objects.get(payload["oid"])
        if content is None or len(content) != payload["size"]:
            raise _HubError(404, f"LFS object {payload['oid']} was not uploaded")
        self._json({"ok": True})

    def _do_commit(self, query, repo, rev):
        self._require_token()
        repo_obj = self.hub._repo(repo)
        parent = self.hub._commit(repo, rev)
        if "create_pr" in query:
            raise _HubError(400, "The Hub stand-in does not open pull requests")
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "A commit starts with a header line")
        header = lines[0]["value"]
        if header.get("parentCommit") and header["parentCommit"] != parent.sha:
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(parent.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise _HubError(400, f"Unknown encoding {value.get('encoding')!r}")
                content = base64.b64decode(value["content"])
                if HubStub._is_lfs(value["path"], content):
                    raise _HubError(400, f"Your push was rejected because it contains binary files: {value['path']}. "
                                         "Please use https://huggingface.co/docs/hub/xet to store binary files.")  # fmt: skip
                files[value["path"]] = StoredFile(len(content), content=content)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.hub.lfs_objects:
                    raise _HubError(422, f"LFS file {value['path']} ({oid}) was never uploaded")
                files[value["path"]] = StoredFile(len(self.hub.lfs_objects[oid]), lfs_oid=oid)
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise _HubError(404, f"{value['path']} does not exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: f for p, f in files.items() if not p.startswith(prefix)}
            else:
                raise _HubError(400, f"Unknown commit operation {key!r}")
        sha = self.hub._commit_files(repo_obj, unquote(rev), files, header.get("summary", ""))
        self._json({"success": True, "commitOid": sha, "commitUrl": f"{self.hub.endpoint}/{repo}/commit/{sha}",
                    "pullRequestUrl": None, "hookOutput": ""})  # fmt: skip

    # ------------------------------------------------------------------------------------------ download
    def _do_resolve(self, query, repo, rev, path):
        commit = self.hub._commit(repo, rev)
        stored = commit.files.get(path)
        if stored is None:
            raise _HubError(404, f"Entry {path} not found", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{stored.blob_id}"', "Accept-Ranges": "bytes"}
        if stored.lfs_oid is None:
            self._send(200, stored.content, headers, "application/octet-stream")
            if self.command == "GET":
                self.hub.served.append((repo, path))
            return
        self.hub._redirected.setdefault(stored.lfs_oid, set()).add((repo, path))
        # As the Hub does for LFS files: redirect to the storage, naming the content's sha256 and size.
        headers.update({"X-Linked-Etag": f'"{stored.lfs_oid}"', "X-Linked-Size": str(stored.size),
                        "Location": f"{self.hub.storage_endpoint}/_lfs/{stored.lfs_oid}"})  # fmt: skip
        self._send(302, b"", headers)

    def _do_lfs_get(self, query, oid):
        content = self.hub.lfs_objects.get(oid)
        if content is None:
            raise _HubError(404, f"LFS object {oid} not found")
        self._send(200, content, {"ETag": f'"{oid}"'}, "application/octet-stream")
        if self.command == "GET":
            self.hub.served.extend(sorted(self.hub._redirected.get(oid, ())))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    hub = HubStub(port=args.port).start()
    print(f"Hub stand-in on {hub.endpoint}. In the shell that pushes or loads, set:")
    print(f"  export HF_ENDPOINT={hub.endpoint} HF_HUB_DISABLE_XET=1 HF_TOKEN=hf_local HF_HUB_OFFLINE=0")
    print("Ctrl-C stops it (everything it holds is in memory).", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
