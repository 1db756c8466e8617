"""lockstep.rl.rollout: a client of `lockstep serve` for rollouts and weight updates, over SGLang's
native API (the one slime, AReaL and verl's SGLang rollout speak).

`generate` posts token ids to POST /generate with `n` completions per prompt, seeded sampling
(`sampling_seed`) and the sampler's logprobs (`return_logprob`); `update_weights` posts a
safetensors folder's path to POST /update_weights_from_disk (a shared filesystem), or its
model.safetensors to POST /update_weights (a server on another host, or push "http"), with a
`weight_version` label, which every later completion carries in its meta_info. The client starts the server as a subprocess on
127.0.0.1 when it is given no url.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass

from .. import checks


# How weight updates reach a server: "disk" (it reads the pushed folder), "http" (the file is the
# request's body) or "auto" (http for a server on another host).
PUSHES = ("auto", "disk", "http")


@dataclass
class Rollout:
    """One completion: its token ids, the sampler's logprob of each, its text, why it ended and the
    weight version that produced it."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RolloutClient:
    """A `lockstep serve` over HTTP (started here as a subprocess when `url` is None, listening on
    `host`: this machine only unless told, as other nodes of a cluster must reach it)."""

    def __init__(self, url: str | None = None, model: str | None = None, dtype: str = "bf16", backend: str = "auto",
                 timeout: float = 600.0, startup_s: float = 300.0, max_num_seqs: int = 64,
                 host: str = "127.0.0.1", push: str = "auto"):
        import httpx

        checks.one_of("push", push, PUSHES)
        self.push = push
        self.process = None
        self.fingerprints: list[dict] = []      # the server's, once `connect` has checked it
        if url is None:
            if model is None:
                raise ValueError("model: expected the model to serve when no server url is given")
            port = free_port()
            cmd = [sys.executable, "-m", "lockstep", "serve", model, "--dtype", dtype, "--port", str(port),
                   "--host", host, "--backend", backend, "--log-level", "warning", "--max-num-seqs", str(max_num_seqs),
                   "--max-num-batched-tokens", "4096"]
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            url = f"http://{host}:{port}"
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=timeout)
        deadline = time.time() + startup_s
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"lockstep serve exited: {self.process.stderr.read()[-2000:]}")
            if time.time() > deadline:
                self.close()
                raise TimeoutError(f"the server at {url} did not answer within {startup_s:.0f} s")
            time.sleep(0.25)

    @property
    def server_urls(self) -> list[str]:
        """The servers behind this client: its own."""
        return [self.url]

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 seed: int) -> list[Rollout]:
        """n completions of every prompt (token ids), prompt by prompt, with the sampler's logprobs."""
        r = self.http.post("/generate", json={
            "input_ids": prompts, "return_logprob": True,
            "sampling_params": {"n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                                "sampling_seed": seed}})
        if r.status_code != 200:
            raise RuntimeError(f"rollout: the server answered {r.status_code}: {r.text[:500]}")
        answers = r.json()
        if len(answers) != len(prompts) * n:
            raise RuntimeError(f"rollout: expected {len(prompts) * n} completions, the server sent {len(answers)}")
        rollouts = []
        for j, a in enumerate(answers):           # prompt-major: the n completions of prompt 0, then of 1, ...
            meta = a["meta_info"]
            triples = meta["output_token_logprobs"]
            if [t[1] for t in triples] != a["output_ids"]:
                raise RuntimeError(f"rollout: completion {j}'s logprobs do not follow its output_ids")
            rollouts.append(Rollout(j // n, list(a["output_ids"]), [float(t[0]) for t in triples], a["text"],
                                    meta["finish_reason"]["type"], str(meta["weight_version"])))
        return rollouts

    def update_weights(self, model_path: str, weight_version: str) -> str:
        """Load a model folder's weights into the server under the label `weight_version`, which every
        later completion carries; returns the label the server reports. The server reads the folder
        itself (POST /update_weights_from_disk) where it shares this machine's filesystem; otherwise
        (push "http", or "auto" with a server on another host) the folder's model.safetensors is
        the body of POST /update_weights."""
        if self.over_http:
            with open(os.path.join(model_path, "model.safetensors"), "rb") as f:
                body = f.read()
            r = self.http.post("/update_weights", content=body, params={"weight_version": weight_version},
                               headers={"content-type": "application/octet-stream"})
        else:
            r = self.http.post("/update_weights_from_disk", json={"model_path": model_path, "flush_cache": True,
                                                                  "weight_version": weight_version})
        if r.status_code != 200 or not r.json().get("success"):
            raise RuntimeError(f"weight update: the server answered {r.status_code}: {r.text[:500]}")
        return str(r.json()["weight_version"])

    @property
    def over_http(self) -> bool:
        """Whether weight updates travel in the request (push "http", or "auto" with a server whose
        host is not this machine's loopback) rather than through a shared filesystem."""
        if self.push != "auto":
            return self.push == "http"
        return urllib.parse.urlsplit(self.url).hostname not in ("127.0.0.1", "localhost", "::1")

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

