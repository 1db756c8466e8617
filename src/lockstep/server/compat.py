"""Fields that SGLang's clients and its router (sglang-router) send, which lockstep accepts at the
values that change nothing here.

SGLang's router re-serializes every request through its own structs, so a request through it carries
fields its client never wrote (`model: null` and `log_metrics: true` on /generate; `echo: false`,
`no_stop_trim: false` and `skip_special_tokens: true` on /v1/completions; ...). Refusing them would
refuse every request through the router; ignoring a value that asks for something lockstep does not
do would silently answer another question. So each such field is accepted only at the values listed
here, and any other value is a 400 that names the field and what is accepted
(state.refuse_unsupported). Fields nobody sends stay unknown fields, refused as before.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from pydantic import BaseModel, create_model

from ..model import gguf

# SGLang 0.5's /generate fields (io_struct.GenerateReqInput) beside those lockstep implements:
# multimodal inputs, LoRA, disaggregation, sessions, ... all at their defaults. Metrics and request
# logs: lockstep keeps neither, so either value changes nothing.
GENERATE: dict[str, tuple] = {
    "log_metrics": (True, False), "no_logs": (False, True), "return_hidden_states": (False,),
    "background": (False,), "return_bytes": (False,), "return_entropy": (False,), "input_embeds": (None,),
    "image_data": (None,), "video_data": (None,), "audio_data": (None,), "modalities": (None,),
    "token_ids_logprob": (None,), "session_params": (None,), "lora_path": (None,), "lora_id": (None,),
    "custom_logit_processor": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
    "bootstrap_room": (None,), "bootstrap_pair_key": (None,), "data_parallel_rank": (None,),
    "conversation_id": (None,), "priority": (None,), "extra_key": (None,), "custom_labels": (None,),
}

# SGLang's sampling_params beside lockstep's: penalties and constraints at their no-op values. Text is
# always decoded without special tokens and stop strings are trimmed, as SGLang does by default.
GENERATE_SAMPLING: dict[str, tuple] = {
    "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "min_new_tokens": (0,), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "stop_regex": (None,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "no_stop_trim": (False,),
    "custom_params": (None,), "stream_interval": (None, 1), "logit_bias": (None,),
}

# OpenAI's and SGLang's extensions of /v1/completions and /v1/chat/completions.
_OPENAI_COMMON: dict[str, tuple] = {
    "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "logit_bias": (None,), "response_format": (None,),
    "min_tokens": (0,), "regex": (None,), "ebnf": (None,), "json_schema": (None,), "no_stop_trim": (False,),
    "skip_special_tokens": (True,), "return_hidden_states": (False,), "lora_path": (None,),
    "session_params": (None,), "rid": (None,), "extra_key": (None,), "cache_salt": (None,), "priority": (None,),
}
COMPLETIONS: dict[str, tuple] = {**_OPENAI_COMMON, "echo": (False,), "best_of": (None, 1), "suffix": (None,)}
# lockstep has no reasoning parser: separating reasoning from the answer finds none, either way.
CHAT: dict[str, tuple] = {
    **_OPENAI_COMMON, "continue_final_message": (False,), "separate_reasoning": (True, False),
    "stream_reasoning": (True, False), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True), "reasoning_effort": (None,), "chat_template_kwargs": (None, {}),
}


# SGLang's /update_weights_from_disk beside model_path: lockstep reads the path as the server read its
# model at start (a checkpoint folder, a GGUF file or a folder holding one), and forgets the prefix
# cache with every update whatever flush_cache says (cached keys and values of the old weights would
# break the guarantee). A load_format that names a format must be the one the path holds
# (load_format_mismatch).
UPDATE_FROM_DISK: dict[str, tuple] = {"load_format": (None, "auto", "safetensors", "gguf"),
                                      "flush_cache": (True, False)}


def load_format_mismatch(load_format: str | None, model_path: str) -> str | None:
    """The refusal of a `load_format` ("safetensors" or "gguf") that is not the format `model_path`
    holds, e.g. 'load_format: "gguf" was asked, but /m is a safetensors checkpoint folder'; None
    if it is, if load_format is null or "auto", or if the path holds no model (the load says why)."""
    if load_format in (None, "auto"):
        return None
    try:
        found = gguf.find_gguf(model_path) if os.path.exists(model_path) else None
    except ValueError:          # several GGUF files in one folder: the load names them
        return None
    if found is not None:
        held, what = "gguf", "a GGUF file" if found == model_path else f"a folder holding a GGUF file ({found})"
    elif os.path.isfile(os.path.join(model_path, "config.json")):
        held, what = "safetensors", "a safetensors checkpoint folder"
    else:
        return None
    if held == load_format:
        return None
    return f"load_format: {_json(load_format)} was asked, but {model_path} is {what}; pass {_json(held)} or \"auto\""


def with_fields(name: str, model: type[BaseModel], accepted: Mapping[str, tuple]) -> type[BaseModel]:
    """`model` named `name`, with every field of `accepted` added, of any type, its first accepted
    value the default: `unsupported` checks them rather than pydantic, so that the refusal
    says what is accepted."""
    fields: dict[str, Any] = {field: (Any, values[0]) for field, values in accepted.items()}
    return create_model(name, __base__=model, __module__=model.__module__, __doc__=model.__doc__, **fields)


def _same(a, b) -> bool:
    # true is not 1, and 0 is 0.0: JSON's values, as a client wrote them
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _json(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def unsupported(body: BaseModel, accepted: Mapping[str, tuple], prefix: str = "") -> tuple[str, str] | None:
    """(param, message) of the first field of `accepted` whose value in `body` (a model of
    `with_fields`) is not one lockstep accepts, e.g. ("echo", "echo: only false is supported, got
    true"); None if every one is."""
    for name, allowed in accepted.items():
        value = getattr(body, name)
        if not any(_same(value, a) for a in allowed):
            param = f"{prefix}.{name}" if prefix else name
            return param, f"{param}: only {' or '.join(_json(a) for a in allowed)} is supported, got {_json(value)}"
    return None
