"""lockstep.rl.servers: rollouts from several `lockstep serve` behind SGLang's router, with the bits
of one server.

`connect` gives the run its rollout client: one server (started here, or running at one URL) as
before, or a ServerPool: N servers started here (`lockstep rl --servers N`) or running at several
URLs (`--server URL` given several times), with one sglang-router started here in front of them.

What keeps the bits of one server:
- a step's prompts go through the router as one request each, concurrently, so every server serves
  part of the step; each request carries the step's sampling seed, and a completion's noise is drawn
  from (seed, its index among the prompt's n), so the same completion comes back whichever server
  draws it (lockstep.sampling), and lockstep's ops are batch invariant, so what else a server runs
  at the same time changes no bit;
- weight pushes go to every server directly (sglang-router 0.3.2 does not route them), and the
  step's rollouts start only once every server reports the new weight_version;
- before anything is sampled, every server's fingerprint (backend, instruction set or GPU, torch
  and Triton versions: lockstep.machine) must equal the trainer's, unless accept_mismatch.

A request that fails (its server died) is sent again through the router, which by then routes
around the dead server; once no server answers /health the run stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from ..machine import FingerprintMismatch, differences, in_words
from .rollout import Rollout, RolloutClient, free_port

log = logging.getLogger("lockstep.rl")

ROUTER_POLICY = "round_robin"      # consecutive requests to each server in turn


class NoServerLeft(RuntimeError):
    """Every rollout server of the pool has stopped answering: the run cannot sample."""


def check_fingerprints(servers: list[RolloutClient], ours: dict, accept_mismatch: bool = False) -> list[dict]:
    """Each server's fingerprint (its /get_server_info), compared with the trainer's `ours`. A server
    that differs is refused with a FingerprintMismatch naming the field and both values; with
    accept_mismatch it is logged instead. Returns the servers' fingerprints."""
    found = []
    for server in servers:
        r = server.http.get("/get_server_info")
        if r.status_code != 200:
            raise RuntimeError(f"rollout server {server.url}: /get_server_info answered {r.status_code}: {r.text[:300]}")
        theirs = r.json().get("fingerprint")
        if theirs is None:
            raise FingerprintMismatch(f"rollout server {server.url} reports no fingerprint in /get_server_info "
                                      "(an older lockstep serve?); pass --accept-mismatch to sample from it anyway")
        found.append(theirs)
        diff = differences(ours, theirs)
        if not diff:
            continue
        words = in_words(diff, "the trainer", "the server")
        if not accept_mismatch:
            raise FingerprintMismatch(f"rollout server {server.url} computes differently from the trainer ({words}); "
                                      "its logprobs would not be the trainer's bits. Pass --accept-mismatch to "
                                      "sample from it anyway")
        log.warning("lockstep rl: rollout server %s differs from the trainer (%s); sampling from it anyway "
                    "(--accept-mismatch)", server.url, words)
    return found


def _start_clients(urls: list[str | None], **kwargs) -> list[RolloutClient]:
    """A RolloutClient for each url (a server started here for each None), all started at once; if
    one fails, the others are closed."""
    with ThreadPoolExecutor(len(urls)) as ex:
        futures = [ex.submit(RolloutClient, url, **kwargs) for url in urls]
    clients, error = [], None
    for f in futures:
        try:
            clients.append(f.result())
        except Exception as e:          # noqa: BLE001 -- the first failure is raised once all are closed
            error = error or e
    if error is not None:
        for c in clients:
            c.close()
        raise error
    return clients


class Router:
    """sglang-router (`python -m sglang_router.launch_router`) in front of `worker_urls`, on a free
    127.0.0.1 port; ready once it has registered every server as healthy."""

    def __init__(self, worker_urls: list[str], startup_s: float = 60.0):
        import httpx

        try:
            import sglang_router  # noqa: F401 -- to say what to install before starting a process
        except ImportError:
            raise ImportError("--servers/--server: several rollout servers need SGLang's router: "
                              "pip install 'lockstep[router]'") from None
        self.log = tempfile.TemporaryFile(mode="w+")
        port, metrics = free_port(), free_port()
        # Its metrics listener takes a port too (29000 unless told): a free one, so that runs side by
        # side do not collide.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
               "--host", "127.0.0.1", "--port", str(port), "--policy", ROUTER_POLICY, "--log-level", "warn",
               "--worker-startup-timeout-secs", str(int(startup_s)),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"      # Prometheus' text format
        deadline = time.time() + startup_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited: {self.output()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                if sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(worker_urls):
                    break
            if time.time() > deadline:
                self.close()
                raise TimeoutError(f"sglang-router did not register the servers {worker_urls} within {startup_s:.0f} s")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


class ServerPool:
    """Several `lockstep serve` behind one sglang-router started here: the RolloutClient interface
    (url, generate, update_weights, close) over all of them.

    urls: servers already running, or None for `count` servers started here with the RolloutClient
    settings of `server_kwargs`. `ours`: the trainer's fingerprint, which every server must have."""

    def __init__(self, urls: list[str] | None, count: int, ours: dict, accept_mismatch: bool = False,
                 retries: int = 3, **server_kwargs):
        self.servers = _start_clients(list(urls) if urls else [None] * count, **server_kwargs)
        self.router = self.client = None
        self.retries = retries
        try:
            self.fingerprints = check_fingerprints(self.servers, ours, accept_mismatch)
            self.router = Router([s.url for s in self.servers])
            self.client = RolloutClient(self.router.url, timeout=server_kwargs.get("timeout", 600.0))
        except BaseException:
            self.close()
            raise
        self.url = self.router.url
        self.server_urls = [s.url for s in self.servers]

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 seed: int) -> list[Rollout]:
        """What RolloutClient.generate returns for the same arguments, bit for bit: one request per
        prompt through the router, all at once, so that the servers share the step."""
        def one(k: int) -> list[Rollout]:
            rollouts = self._generate_one(prompts[k], n, max_new_tokens, temperature, seed)
            for r in rollouts:
                r.prompt_index = k
            return rollouts

        with ThreadPoolExecutor(min(len(prompts), 64)) as ex:
            return [r for rollouts in ex.map(one, range(len(prompts))) for r in rollouts]

    def _generate_one(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float,
                      seed: int) -> list[Rollout]:
        import httpx

        for attempt in range(self.retries + 1):
            try:
                return self.client.generate([prompt], n, max_new_tokens, temperature, seed)
            except (httpx.TransportError, RuntimeError) as e:
                alive = self.alive()
                if not alive:
                    raise NoServerLeft(f"rollout: no rollout server is left ({', '.join(self.server_urls)} do not "
                                       f"answer /health); the last error: {e}") from None
                if attempt == self.retries:
                    raise
                # The same request again: its seed makes it the same completions on another server.
                log.warning("lockstep rl: a rollout request failed (%s); sending it again through the router", e)
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def served(self) -> dict[str, int]:
        """Requests each server has answered through the router since the pool started (the router's
        own count: its smg_worker_cb_outcomes_total metric, outcome "success")."""
        import httpx

        counts = {url: 0 for url in self.server_urls}
        with contextlib.suppress(httpx.HTTPError):
            for line in httpx.get(self.router.metrics_url, timeout=5).text.splitlines():
                if line.startswith("smg_worker_cb_outcomes_total{") and 'outcome="success"' in line:
                    url = line.split('worker="', 1)[1].split('"', 1)[0]
                    counts[url] = counts.get(url, 0) + int(float(line.rsplit(" ", 1)[1]))
        return counts

    def alive(self) -> list[RolloutClient]:
        """The servers that answer /health now."""
        import httpx

        up = []
        for s in self.servers:
            with contextlib.suppress(httpx.HTTPError):
                if s.http.get("/health", timeout=5).status_code == 200:
                    up.append(s)
        return up

    def update_weights(self, model_path: str, weight_version: str) -> str:
        """Push the weights to every server that is alive, directly (the router does not route weight
        updates), all at once; returns the version once every one of them reports it. A server that
        died is left out of the pool (the router routes around it); none left stops the run."""
        alive = self.alive()
        if not alive:
            raise NoServerLeft(f"weight update: no rollout server is left ({', '.join(self.server_urls)} do not "
                               "answer /health)")
        for s in self.servers:
            if s not in alive:
                log.warning("lockstep rl: rollout server %s does not answer; the run goes on without it", s.url)
                s.close()
        self.servers = alive
        with ThreadPoolExecutor(len(alive)) as ex:
            versions = list(ex.map(lambda s: s.update_weights(model_path, weight_version), alive))
        for s, version in zip(alive, versions):
            reported = str(s.http.get("/get_model_info").json().get("weight_version"))
            if version != weight_version or reported != weight_version:
                raise RuntimeError(f"weight update: server {s.url} reports weight version {reported!r}, expected "
                                   f"{weight_version!r}")
        return weight_version

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.router is not None:
            self.router.close()
        for s in self.servers:
            s.close()


def connect(urls: list[str] | None, count: int, ours: dict, accept_mismatch: bool = False,
            **server_kwargs) -> RolloutClient | ServerPool:
    """The run's rollout client: with at most one url and count 1, one server (started here unless
    a url is given), as `lockstep rl` has always sampled, its fingerprint checked; else a ServerPool
    (count servers started here, or the servers at urls, behind a router started here)."""
    if urls and count != 1:
        raise ValueError(f"servers: {count} servers to start and {len(urls)} running ones given (--server); "
                         "give one or the other")
    n_servers = count if not urls else len(urls)
    if isinstance(n_servers, bool) or not isinstance(n_servers, int) or n_servers < 1:
        raise ValueError(f"servers: expected a positive int, got {count!r}")
    if n_servers == 1:
        client = RolloutClient(urls[0] if urls else None, **server_kwargs)
        try:
            client.fingerprints = check_fingerprints([client], ours, accept_mismatch)
        except BaseException:
            client.close()
            raise
        return client
    return ServerPool(urls, count, ours, accept_mismatch, **server_kwargs)
