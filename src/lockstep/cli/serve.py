"""`lockstep serve` (an OpenAI-compatible server with weight updates) and `lockstep convert` (a GGUF
file's model as a Hugging Face folder)."""

from __future__ import annotations

import argparse
import os
import sys

from ..model.checkpoint import DEFAULT_MODEL
from .arguments import backend_name, model_arguments, serve_dtype
from .output import require_extra


def cmd_serve(args: argparse.Namespace) -> int:
    """`lockstep serve`: runs the server until it is stopped."""
    require_extra("serve", "fastapi", "uvicorn")
    from .. import server

    srv = server.build_server(args.model, args.dtype, args.family, args.seed, name=args.served_model_name,
                              backend=args.backend,
                              api_key=args.api_key or os.environ.get("LOCKSTEP_API_KEY"),
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              block_size=args.block_size, num_blocks=args.num_blocks,
                              prefix_caching=not args.no_prefix_caching)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not srv.api_key:
        print(f"lockstep serve: listening on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)
    print(f"lockstep serve: {srv.name} on http://{args.host}:{args.port} (weights version 0)", file=sys.stderr)
    server.serve(srv, args.host, args.port, args.log_level)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """`lockstep convert`: writes the Hugging Face folder."""
    from ..model import convert_gguf

    convert_gguf(args.gguf, args.out)
    print(f"lockstep convert: wrote {args.out} (config.json, model.safetensors in float32, tokenizer.json, "
          "tokenizer_config.json)")
    return 0


def add_serve(sub, formatter) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with weight updates", formatter_class=formatter,
                        description="Serve MODEL over OpenAI's completions and chat completions API. Every "
                                    "answer's logprobs equal the same request sent alone, and lockstep.logprobs "
                                    "on its tokens.")
    model_arguments(sv, default=DEFAULT_MODEL)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (the default is this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--dtype", type=serve_dtype, default="bf16", help="compute dtype")
    sv.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    sv.add_argument("--served-model-name", help="the model name in the API (default: the folder's name)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set LOCKSTEP_API_KEY)")
    sv.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    sv.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    sv.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: max-num-seqs full contexts)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="do not share the blocks of equal prefixes")
    sv.add_argument("--backend", type=backend_name, default="auto", help="op backend (eager: stock PyTorch)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)


def add_convert(sub, formatter) -> None:
    cv = sub.add_parser("convert", help="write a GGUF file's model as a Hugging Face folder (safetensors, "
                                        "tokenizer, chat template) that lockstep and transformers load",
                        formatter_class=formatter)
    cv.add_argument("gguf", help="the .gguf file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K tensors)")
    cv.add_argument("out", help="the folder to write")
    cv.set_defaults(func=cmd_convert)
