"""GRPO over HTTP: rollouts from `lockstep serve`, policy-gradient steps in lockstep's trainer, and new
weights pushed to the server after every step. `lockstep rl` runs it on a small verifiable task.

Each step:
1. POST /v1/completions: every prompt of the step with n = group completions, token ids in and out
   (`return_token_ids`), with the sampler's logprobs;
2. rewards from the task, advantages normalized within each prompt's group;
3. the trainer recomputes the completions' logprobs (`lockstep.logprobs`), logs how far they are
   from the sampler's (max |dlogp|, approx KL(sampler || trainer), mean importance ratio), and
   takes one AdamW step on `policy_loss`;
4. POST /update_weights with the new weights; the next rollouts run on them (`weights_version`).

With lockstep the sampler's and the trainer's logprobs are the same bits, so the KL is exactly 0 and
every ratio exactly 1; on the eager backend (stock PyTorch in server and trainer) they are not.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .model import ModelConfig, Transformer, load_model, logprobs
from .registry import use_backend
from .train import AdamW, AdamWConfig, grad_norm, policy_loss, read_log

# --- the task -----------------------------------------------------------------------------------
DIGITS = list(range(10))
PLUS, EQUALS, EOS, BOS = 10, 11, 12, 13


@dataclass
class AdditionTask:
    """"a + b =" in digit tokens; the answer is (a + b) mod 10, then the end token. Verifiable, with
    partial credit: 0.25 for answering with a digit, 0.25 for ending right after it, 0.5 for the
    right digit."""

    vocab_size: int = 16

    def prompts(self, count: int, rng: random.Random) -> list[list[int]]:
        return [[BOS, a, PLUS, b, EQUALS] for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(count))]

    def answer(self, prompt: list[int]) -> int:
        return (prompt[1] + prompt[3]) % 10

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        if not completion or completion[0] not in DIGITS:
            return 0.0
        return 0.25 + 0.25 * (completion[1:2] == [EOS]) + 0.5 * (completion[0] == self.answer(prompt))

    def model(self, seed: int) -> Transformer:
        config = ModelConfig.tiny("qwen3", vocab_size=self.vocab_size, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=EOS,
                                  bos_token_id=BOS, max_position_embeddings=64)
        return Transformer.from_config(config, seed=seed)


# --- the server ---------------------------------------------------------------------------------
class RolloutServer:
    """A client of a `lockstep serve` (started here as a subprocess when no url is given)."""

    def __init__(self, url: str | None = None, model_dir: str | None = None, backend: str = "auto",
                 api_key: str | None = None, timeout: float = 300.0):
        import httpx

        self.process = None
        if url is None:
            port = _free_port()
            cmd = [sys.executable, "-m", "lockstep", "serve", model_dir, "--dtype", "fp32", "--port", str(port),
                   "--backend", backend, "--log-level", "warning", "--max-num-seqs", "128",
                   "--max-num-batched-tokens", "4096", "--block-size", "8"]
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            url = f"http://127.0.0.1:{port}"
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, timeout=timeout, headers=headers)
        deadline = time.time() + 120
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"lockstep serve exited: {self.process.stderr.read()[-2000:]}")
            if time.time() > deadline:
                raise TimeoutError(f"the server at {url} did not answer within 120 s")
            time.sleep(0.2)

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seed: int) -> dict:
        r = self.http.post("/v1/completions", json={
            "prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "logprobs": 0, "return_token_ids": True})
        if r.status_code != 200:
            raise RuntimeError(f"rollout: the server answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def push(self, model: Transformer) -> int:
        """Send the model's weights (a safetensors body); returns the server's new weights version."""
        from safetensors.torch import save

        raw = save({n: p.detach().contiguous().cpu() for n, p in model.named_parameters()})
        r = self.http.post("/update_weights", content=raw)
        if r.status_code != 200:
            raise RuntimeError(f"weight update: the server answered {r.status_code}: {r.text[:500]}")
        return r.json()["weights_version"]

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the loop -----------------------------------------------------------------------------------
@dataclass
class RLConfig:
    steps: int = 40
    prompts_per_step: int = 8
    group: int = 8                  # completions per prompt (GRPO's group)
    max_tokens: int = 2
    temperature: float = 1.0
    lr: float = 3e-3
    clip: float = 0.2
    seed: int = 0
    backend: str = "auto"           # of the trainer and the server; "eager" shows the mismatch

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "group", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.group < 2:
            raise ValueError(f"group: expected at least 2 completions per prompt (GRPO compares them), got {self.group}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature: expected a positive number, got {self.temperature!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive number, got {self.lr!r}")


def group_advantages(rewards: list[float], group: int) -> torch.Tensor:
    """(r - mean) / (std + 1e-6) within each group of `group` consecutive rewards (float64)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)


def mismatch(trainer: torch.Tensor, sampler: torch.Tensor) -> dict:
    """max |d|, mean(e^d - 1 - d) (approx KL(sampler || trainer)) and mean e^d for d = trainer - sampler."""
    d = trainer.double() - sampler.double()
    return {"max_abs_dlogp": float(d.abs().max()), "approx_kl": float((torch.exp(d) - 1 - d).mean()),
            "mean_ratio": float(torch.exp(d).mean())}


def grpo_step(model: Transformer, opt: AdamW, prompts: list[list[int]], completions: list[list[int]],
              sampler_lps: list[list[float]], advantages: torch.Tensor, cfg: RLConfig) -> dict:
    """One policy-gradient step on a batch of rollouts; returns the loss, gradient norm and mismatch."""
    rows = [i for i, c in enumerate(completions) if c]
    seqs = [prompts[i] + completions[i] for i in rows]
    lps = logprobs(model, seqs, temperature=cfg.temperature)
    trained = torch.cat([lp[-len(completions[i]):] for lp, i in zip(lps, rows)])
    sampled = torch.tensor([x for i in rows for x in sampler_lps[i]], dtype=torch.float32)
    adv = torch.cat([advantages[i].expand(len(completions[i])) for i in rows]).to(torch.float32)
    mask = torch.ones_like(trained, dtype=torch.bool)
    for _, p in opt.params:
        p.grad = None
    loss = policy_loss(trained, sampled, adv, mask, clip=cfg.clip)
    loss.backward()
    norm = grad_norm({n: p.grad for n, p in opt.params if p.grad is not None})
    scale = 1.0 / (float(norm) + 1e-6) if float(norm) > 1.0 else 1.0
    opt.step(cfg.lr, grad_scale=scale)
    return {"loss": float(loss.detach()), "grad_norm": float(norm), **mismatch(trained.detach(), sampled)}


def run(cfg: RLConfig, out: str, task: AdditionTask | None = None, server_url: str | None = None,
        progress: bool = True) -> list[dict]:
    """GRPO for cfg.steps steps, with rollouts from a `lockstep serve` (started here unless
    server_url is given); writes out/log.jsonl (one record a step) and returns the records."""
    cfg.validate()
    task = task or AdditionTask()
    os.makedirs(out, exist_ok=True)
    model = task.model(cfg.seed)
    initial = os.path.join(out, "initial")
    model.save(initial)
    model = load_model(initial, dtype=torch.float32)         # the server starts from the same bits
    server = RolloutServer(server_url, initial, backend=cfg.backend)
    records: list[dict] = []
    rng = random.Random(cfg.seed)
    opt = AdamW(list(model.named_parameters()), AdamWConfig(lr=cfg.lr, betas=(0.9, 0.99)))
    log_path = os.path.join(out, "log.jsonl")
    try:
        with open(log_path, "w") as log, use_backend(cfg.backend):
            log.write(json.dumps({"event": "start", "step": 0, "config": asdict(cfg), "server": server.url}) + "\n")
            version = 0
            for step in range(1, cfg.steps + 1):
                started = time.time()
                prompts = task.prompts(cfg.prompts_per_step, rng)
                answer = server.sample(prompts, cfg.group, cfg.max_tokens, cfg.temperature, seed=step)
                if answer["weights_version"] != version:
                    raise RuntimeError(f"rollout: sampled with weights version {answer['weights_version']}, "
                                       f"the trainer is at {version}")
                choices = answer["choices"]
                owners = [prompts[i // cfg.group] for i in range(len(choices))]
                completions = [c["token_ids"] for c in choices]
                sampler_lps = [c["logprobs"]["token_logprobs"] for c in choices]
                rewards = [task.reward(p, c) for p, c in zip(owners, completions)]
                metrics = grpo_step(model, opt, owners, completions, sampler_lps,
                                    group_advantages(rewards, cfg.group), cfg)
                version = server.push(model)
                rec = {"step": step, "reward": sum(rewards) / len(rewards), **metrics,
                       "tokens": sum(len(c) for c in completions), "weights_version": version,
                       "seconds": round(time.time() - started, 3)}
                records.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if progress:
                    print(f"step {step:3d}  reward {rec['reward']:.3f}  max|dlogp| {rec['max_abs_dlogp']:.3g}  "
                          f"approx KL {rec['approx_kl']:.3g}  mean ratio {rec['mean_ratio']:.9f}", file=sys.stderr)
    finally:
        server.close()
    model.save(os.path.join(out, "final"))
    return records


def summary(out: str) -> dict:
    """The run's first and last rewards and its worst mismatch (from out/log.jsonl)."""
    steps, _ = read_log(out)
    k = max(1, len(steps) // 4)
    return {"steps": len(steps), "reward_first": sum(r["reward"] for r in steps[:k]) / k,
            "reward_last": sum(r["reward"] for r in steps[-k:]) / k,
            "max_abs_dlogp": max(r["max_abs_dlogp"] for r in steps), "max_approx_kl": max(r["approx_kl"] for r in steps),
            "ratio_spread": max(abs(r["mean_ratio"] - 1) for r in steps)}
