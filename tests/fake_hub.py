"""A local HTTP server that speaks the parts of the Hugging Face Hub API that
`gym-grpc dataset` and `prepare-data --download` use, so that the real
huggingface_hub client runs against it (HF_ENDPOINT points at it).

It keeps repositories in memory: files per revision, the commits with their
message and description, and pull requests as refs/pr/N. Every API call must
carry the expected bearer token; a wrong one gets 401 with a body that echoes
the header (a careless server), so the tests can check nothing prints it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web


def _sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    #: revision -> path -> bytes
    files: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    #: revision -> commit sha
    heads: dict[str, str] = field(default_factory=dict)
    commits: list[dict] = field(default_factory=list)
    pull_requests: int = 0


class FakeHub:
    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> FakeHub:
        self._thread.start()
        assert self._started.wait(10), "the fake Hub did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._authorise], client_max_size=1 << 28)
        app.router.add_post("/api/repos/create", self._create)
        app.router.add_post("/api/datasets/{org}/{name}/preupload/{rev:.+}", self._preupload)
        app.router.add_post("/api/datasets/{org}/{name}/commit/{rev:.+}", self._commit)
        app.router.add_route("HEAD", "/datasets/{org}/{name}/resolve/{rev:refs/pr/\\d+|[^/]+}/{path:.+}", self._resolve)
        app.router.add_get(
            "/datasets/{org}/{name}/resolve/{rev:refs/pr/\\d+|[^/]+}/{path:.+}", self._resolve, allow_head=False
        )
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    # --- the API -------------------------------------------------------------

    @web.middleware
    async def _authorise(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        self.requests.append(f"{request.method} {request.path}")
        if request.path == "/api/agent-harnesses":  # huggingface_hub's import-time lookup
            return web.json_response({"error": "not here"}, status=404)
        sent = request.headers.get("Authorization", "")
        if sent != f"Bearer {self.token}":
            return web.json_response({"error": f"Invalid credentials in Authorization header: {sent!r}"}, status=401)
        return await handler(request)

    def _repo(self, request: web.Request) -> tuple[str, Repo]:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo_id not in self.repos:
            raise web.HTTPNotFound(
                text=json.dumps({"error": "Repository not found"}),
                content_type="application/json",
                headers={"X-Error-Code": "RepoNotFound"},
            )
        return repo_id, self.repos[repo_id]

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["type"] == "dataset", body
        repo_id = f"{body['organization']}/{body['name']}"
        url = {"url": f"{self.url}/datasets/{repo_id}"}
        if repo_id in self.repos:
            return web.json_response({**url, "error": "You already created this dataset repo"}, status=409)
        self.repos[repo_id] = Repo(private=body.get("visibility") == "private" or bool(body.get("private")))
        return web.json_response(url)

    async def _preupload(self, request: web.Request) -> web.Response:
        self._repo(request)
        body = await request.json()
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]
        return web.json_response({"files": files})

    async def _commit(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        revision = request.match_info["rev"]
        if revision not in repo.files:
            return web.json_response(
                {"error": f"Invalid rev id: {revision}"}, status=404, headers={"X-Error-Code": "RevisionNotFound"}
            )
        lines = [json.loads(line) for line in (await request.text()).splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        uploads = {
            line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines if line["key"] == "file"
        }
        create_pr = request.query.get("create_pr") == "1"
        target = revision
        if create_pr:
            repo.pull_requests += 1
            target = f"refs/pr/{repo.pull_requests}"
            repo.files[target] = dict(repo.files[revision])
        repo.files[target].update(uploads)
        sha = hashlib.sha1(f"{repo_id}{len(repo.commits)}".encode()).hexdigest()
        repo.heads[target] = sha
        repo.commits.append(
            {
                "revision": target,
                "summary": header["summary"],
                "description": header.get("description", ""),
                "files": sorted(uploads),
            }
        )
        reply = {"commitOid": sha, "commitUrl": f"{self.url}/datasets/{repo_id}/commit/{sha}"}
        if create_pr:
            reply["pullRequestUrl"] = f"{self.url}/datasets/{repo_id}/discussions/{repo.pull_requests}"
        return web.json_response(reply)

    async def _resolve(self, request: web.Request) -> web.Response:
        _, repo = self._repo(request)
        revision, path = request.match_info["rev"], request.match_info["path"]
        if revision not in repo.files:
            return web.Response(status=404, headers={"X-Error-Code": "RevisionNotFound"})
        head = repo.heads.get(revision, "0" * 40)
        data = repo.files[revision].get(path)
        if data is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": head})
        headers = {"X-Repo-Commit": head, "ETag": f'"{_sha(data)}"', "Content-Length": str(len(data))}
        return web.Response(body=None if request.method == "HEAD" else data, headers=headers)

    async def _unknown(self, request: web.Request) -> web.Response:
        return web.json_response({"error": f"the fake Hub does not know {request.method} {request.path}"}, status=404)
