"""lockstep.rl.rollout: a client of `lockstep serve` for rollouts and weight updates.

`generate` posts token ids to POST /v1/completions with `n` completions per prompt, seeded
sampling, the sampler's logprobs and the completions' token ids (`return_token_ids`);
`update_weights` posts a safetensors folder to POST /update_weights_from_disk, and every later
completion carries the server's new `weights_version`. The client starts the server as a
subprocess on 127.0.0.1 when it is given no url.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass


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
    """A `lockstep serve` over HTTP (started here as a subprocess when `url` is None)."""

    def __init__(self, url: str | None = None, model: str | None = None, dtype: str = "bf16", backend: str = "auto",
                 timeout: float = 600.0, startup_s: float = 300.0, max_num_seqs: int = 64):
        import httpx

        self.process = None
        if url is None:
            if model is None:
                raise ValueError("model: expected the model to serve when no server url is given")
            port = free_port()
            cmd = [sys.executable, "-m", "lockstep", "serve", model, "--dtype", dtype, "--port", str(port),
                   "--backend", backend, "--log-level", "warning", "--max-num-seqs", str(max_num_seqs),
                   "--max-num-batched-tokens", "4096"]
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            url = f"http://127.0.0.1:{port}"
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

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 seed: int) -> list[Rollout]:
        """n completions of every prompt (token ids), prompt by prompt, with the sampler's logprobs."""
        r = self.http.post("/v1/completions", json={
            "prompt": prompts, "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
            "logprobs": 0, "return_token_ids": True})
        if r.status_code != 200:
            raise RuntimeError(f"rollout: the server answered {r.status_code}: {r.text[:500]}")
        answer = r.json()
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise RuntimeError(f"rollout: expected {len(prompts) * n} completions, the server sent {len(choices)}")
        return [Rollout(c["index"] // n, list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]],
                        c["text"], c["finish_reason"], str(answer["weights_version"])) for c in choices]

    def update_weights(self, model_path: str) -> str:
        """Load a safetensors folder into the server; returns the new weight version, which every later
        completion carries."""
        r = self.http.post("/update_weights_from_disk", json={"model_path": model_path, "flush_cache": True})
        if r.status_code != 200 or not r.json().get("success"):
            raise RuntimeError(f"weight update: the server answered {r.status_code}: {r.text[:500]}")
        return str(r.json()["weights_version"])

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

