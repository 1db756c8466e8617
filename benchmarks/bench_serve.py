"""Benchmark: `lockstep serve` throughput and latency at 1, 8 and 32 concurrent clients on the
Qwen3-0.6B-shaped model (bf16, 4 layers), against Engine.generate in process on the same requests;
and the cost of a weight update (POST /update_weights with every weight in the body). CPU.

Usage: python benchmarks/bench_serve.py [--quick]"""

import asyncio
import contextlib
import statistics
import sys
import threading
import time

import httpx
import torch

from lockstep import Engine, SamplingParams
from lockstep.tools.bench import machine
from lockstep.server import Server, create_app

from _realistic import lockstep_model

PROMPT, NEW = 128, 16


@contextlib.contextmanager
def running(server):
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not (srv.started and srv.servers):
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join()


def main():
    quick = "--quick" in sys.argv
    model = lockstep_model(torch.bfloat16)
    server = Server(model, "qwen3-0.6b-shape", dict(max_num_seqs=32, max_num_batched_tokens=4096, block_size=16))
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {machine()}")
    print("| clients | requests | server tok/s | in-process Engine.generate tok/s | ratio (server / engine) | "
          "latency p50 s | p90 s | p99 s |\n|---|---|---|---|---|---|---|---|")
    with running(server) as url:
        for clients in ((1, 8) if quick else (1, 8, 32)):
            per_client = 2
            prompts = [torch.randint(0, 151936, (PROMPT,), generator=gen).tolist() for _ in range(clients * per_client)]
            body = dict(max_tokens=NEW, temperature=0.0, ignore_eos=True)

            async def client(http, mine, latencies):
                for p in mine:
                    t = time.perf_counter()
                    r = await http.post(f"{url}/v1/completions", json={"prompt": p, **body})
                    r.raise_for_status()
                    latencies.append(time.perf_counter() - t)

            async def everyone():
                latencies = []
                async with httpx.AsyncClient(timeout=600) as http:
                    await asyncio.gather(*(client(http, prompts[c::clients], latencies) for c in range(clients)))
                return latencies

            t = time.perf_counter()
            latencies = asyncio.run(everyone())
            served = len(prompts) * NEW / (time.perf_counter() - t)
            engine = Engine(model, max_num_seqs=clients, max_num_batched_tokens=4096, block_size=16)
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW))
            direct = len(prompts) * NEW / (time.perf_counter() - t)
            q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
            print(f"| {clients} | {len(prompts)} | {served:.1f} | {direct:.1f} | {served / direct:.2f} | "
                  f"{statistics.median(latencies):.2f} | {q[89]:.2f} | {q[98]:.2f} |", flush=True)
        from safetensors.torch import save

        raw = save({n: p.detach().contiguous() for n, p in model.named_parameters()})
        t = time.perf_counter()
        httpx.post(f"{url}/update_weights", content=raw, timeout=600).raise_for_status()
        print(f"\nweight update: {len(raw) / 2**20:.0f} MiB of safetensors in the request body, "
              f"{time.perf_counter() - t:.2f} s from request to the new version")


if __name__ == "__main__":
    main()
