"""A small, in-memory, Hub-compatible HTTP server (standard library only) for offline tests.

It implements just what `huggingface_hub` and `transformers` need to push a model and load it back by repo id:

    POST /api/repos/create                                  create a repository (409 if it exists)
    POST /api/validate-yaml                                 always valid
    GET  /api/whoami-v2                                     who the token belongs to
    POST /api/{type}s/{repo}/preupload/{rev}                every file is uploaded "regular" (inline base64)
    POST /api/{type}s/{repo}/commit/{rev}                   newline-delimited JSON commit
    GET  /api/{type}s/{repo}[/revision/{rev}]               repo info with `sha` and `siblings`
    GET  /api/{type}s/{repo}/tree/{rev}[/{path}]            file listing (for delete patterns, chat templates)
    GET  /api/{type}s/{repo}/commits/{rev}                  commit history (newest first)
    GET|HEAD /{repo}/resolve/{rev}/{path}                   file content (404 + X-Error-Code: EntryNotFound)

Write requests need `Authorization: Bearer <token>` with a token from `tokens`; anything else is answered 401
like the Hub does. Private repositories are readable only with a valid token. Every commit is kept, so a file can be
resolved at `main` or at any earlier commit sha.

Run it by hand with `python tests/support/hub_server.py --port 8000` (prints the endpoint), or in a test with
`HubServer(tokens={"hf_test"}).start()` (binds 127.0.0.1 on a free port, serves from a daemon thread).
"""

import argparse
import base64
import hashlib
import json
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


class Repo:
    def __init__(self, repo_id, repo_type, private):
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.private = private
        self.commits = []  # list of (sha, message, {path: bytes}); newest last
        self._commit({}, "initial commit")

    def _commit(self, files, message):
        parent = self.commits[-1][0] if self.commits else ""
        digest = hashlib.sha1(f"{parent}{message}{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha1(files[path]).digest())
        sha = digest.hexdigest()
        self.commits.append((sha, message, files))
        return sha

    def files_at(self, revision):
        if revision in ("main", "HEAD"):
            return self.commits[-1][0], self.commits[-1][2]
        for sha, _, files in self.commits:
            if sha == revision:
                return sha, files
        return None, None


class HubState:
    def __init__(self, tokens, user):
        self.tokens = set(tokens)
        self.user = user
        self.repos = {}
        self.lock = threading.Lock()
        self.requests = []  # (method, path, status) of every request, for tests


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState = None  # set on the subclass made per server

    def log_message(self, format, *args):  # keep test output clean
        pass

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _authorised(self):
        header = self.headers.get("Authorization", "")
        return header.startswith("Bearer ") and header[len("Bearer ") :] in self.state.tokens

    def _send(self, status, body=b"", headers=None, head=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.state.requests.append((self.command, self.path, status))

    def _error(self, status, message, code=None, head=False):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers, head=head)

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _repo(self, repo_type, repo_id, head=False, write=False):
        repo = self.state.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._authorised()) or (write and not self._authorised()):
            if write and not self._authorised():
                self._error(401, "Invalid credentials in Authorization header", head=head)
            else:
                self._error(404, f"Repository not found: {repo_id}", "RepoNotFound", head=head)
            return None
        return repo

    @staticmethod
    def _split_api_path(parts):
        """['models', 'org', 'name', 'rest'...] -> (repo_type, repo_id, rest); the repo id is 'org/name'."""
        repo_type = parts[0][:-1]
        return repo_type, "/".join(parts[1:3]), parts[3:]

    # ---- verbs --------------------------------------------------------------------------------------------------

    def do_HEAD(self):
        self._get(head=True)

    def do_GET(self):
        self._get(head=False)

    def _get(self, head):
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        with self.state.lock:
            if parts[:2] == ["api", "whoami-v2"]:
                if not self._authorised():
                    return self._error(401, "Invalid credentials in Authorization header", head=head)
                return self._send(
                    200, {"type": "user", "name": self.state.user, "auth": {"type": "access_token"}}, head=head
                )
            if len(parts) >= 4 and parts[0] == "api" and parts[1] in ("models", "datasets", "spaces"):
                repo_type, repo_id, rest = self._split_api_path(parts[1:])
                repo = self._repo(repo_type, repo_id, head=head)
                if repo is None:
                    return
                if not rest or rest[0] == "revision":
                    return self._repo_info(repo, rest[1] if len(rest) > 1 else "main", head)
                if rest[0] == "tree":
                    return self._tree(
                        repo, rest[1] if len(rest) > 1 else "main", "/".join(rest[2:]), parse_qs(url.query), head
                    )
                if rest[0] == "commits":
                    commits = [
                        {"id": sha, "title": msg, "message": msg, "authors": [], "date": formatdate()}
                        for sha, msg, _ in reversed(repo.commits)
                    ]
                    return self._send(200, commits, head=head)
                return self._error(404, f"Unknown endpoint {url.path}", head=head)
            # /{repo}/resolve/{rev}/{path} (models), /datasets/{repo}/resolve/... (datasets)
            repo_type = "model"
            if parts and parts[0] in ("datasets", "spaces"):
                repo_type, parts = parts[0][:-1], parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo(repo_type, "/".join(parts[:2]), head=head)
                if repo is None:
                    return
                return self._resolve(repo, parts[3], "/".join(parts[4:]), head)
            return self._error(404, f"Unknown endpoint {url.path}", head=head)

    def do_POST(self):
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        body = self._body()
        with self.state.lock:
            if parts == ["api", "validate-yaml"]:
                return self._send(200, {"errors": [], "warnings": []})
            if parts == ["api", "repos", "create"]:
                if not self._authorised():
                    return self._error(401, "Invalid credentials in Authorization header")
                payload = json.loads(body or b"{}")
                name = payload["name"]
                owner = payload.get("organization") or self.state.user
                repo_id = name if "/" in name else f"{owner}/{name}"
                repo_type = payload.get("type") or "model"
                url_prefix = "" if repo_type == "model" else f"{repo_type}s/"
                repo_url = f"http://{self.headers.get('Host')}/{url_prefix}{repo_id}"
                if (repo_type, repo_id) in self.state.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": repo_url})
                private = bool(payload.get("private")) or payload.get("visibility") == "private"  # hub 1.x | 2.x
                self.state.repos[(repo_type, repo_id)] = Repo(repo_id, repo_type, private)
                return self._send(200, {"url": repo_url, "name": repo_id})
            if len(parts) >= 6 and parts[0] == "api" and parts[1] in ("models", "datasets", "spaces"):
                repo_type, repo_id, rest = self._split_api_path(parts[1:])
                repo = self._repo(repo_type, repo_id, write=True)
                if repo is None:
                    return
                if rest[0] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                            ],
                            "commitOid": repo.commits[-1][0],
                        },
                    )
                if rest[0] == "commit":
                    return self._commit(repo, body)
            return self._error(404, f"Unknown endpoint {url.path}")

    # ---- endpoints ----------------------------------------------------------------------------------------------

    def _repo_info(self, repo, revision, head):
        sha, files = repo.files_at(revision)
        if sha is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound", head=head)
        return self._send(
            200,
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": sha,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "tags": [],
                "downloads": 0,
                "likes": 0,
                "lastModified": "2026-01-01T00:00:00.000Z",
                "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": path, "size": len(data)} for path, data in sorted(files.items())],
            },
            head=head,
        )

    def _tree(self, repo, revision, prefix, query, head):
        sha, files = repo.files_at(revision)
        if sha is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound", head=head)
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = prefix.strip("/")
        entries, folders = [], set()
        for path, data in sorted(files.items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            relative = path[len(prefix) + 1 :] if prefix else path
            if "/" in relative:  # folders on the way
                segments = relative.split("/")[:-1]
                for depth in range(1, len(segments) + 1 if recursive else 2):
                    folder = "/".join(([prefix] if prefix else []) + segments[:depth])
                    if folder not in folders:
                        folders.add(folder)
                        entries.append(
                            {"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()}
                        )
                if not recursive:
                    continue
            entries.append({"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()})
        if prefix and not entries:
            return self._error(404, f"{prefix} does not exist on {revision}", "EntryNotFound", head=head)
        return self._send(200, entries, head=head)

    def _resolve(self, repo, revision, path, head):
        sha, files = repo.files_at(revision)
        if sha is None:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound", head=head)
        if path not in files:
            return self._error(404, f"Entry not found: {path}", "EntryNotFound", head=head)
        data = files[path]
        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
        self._send(
            200, data, {"X-Repo-Commit": sha, "ETag": etag, "Content-Type": "application/octet-stream"}, head=head
        )

    def _commit(self, repo, body):
        _, current = repo.files_at("main")
        files = dict(current)
        message = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value.get("summary", "")
            elif key == "file":
                if value.get("encoding", "base64") != "base64":
                    return self._error(400, f"Unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(folder)}
            else:
                return self._error(400, f"This test server does not support {key!r} operations (LFS/xet uploads)")
        sha = repo._commit(files, message)
        url_prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        self._send(
            200,
            {
                "commitUrl": f"http://{self.headers.get('Host')}/{url_prefix}{repo.repo_id}/commit/{sha}",
                "commitOid": sha,
                "pullRequestUrl": None,
            },
        )


class HubServer:
    """`with HubServer(tokens={"hf_x"}) as hub: ...`; `hub.endpoint` is its base URL."""

    def __init__(self, tokens=("hf_test_token",), user="tester", host="127.0.0.1", port=0):
        self.state = HubState(tokens, user)
        handler = type("BoundHubHandler", (HubHandler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = None

    @property
    def endpoint(self):
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def files(self, repo_id, revision="main", repo_type="model"):
        """{path: bytes} of a repo at a revision (for assertions)."""
        with self.state.lock:
            return dict(self.state.repos[(repo_type, repo_id)].files_at(revision)[1])

    def commits(self, repo_id, repo_type="model"):
        with self.state.lock:
            return [sha for sha, _, _ in self.state.repos[(repo_type, repo_id)].commits]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", action="append", default=None, help="accepted write token (repeatable)")
    args = parser.parse_args()
    server = HubServer(tokens=args.token or ["hf_test_token"], host=args.host, port=args.port)
    print(f"Hub test server on {server.endpoint} (tokens: {sorted(server.state.tokens)})", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
