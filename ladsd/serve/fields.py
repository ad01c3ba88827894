"""The chat body's fields that ladsd does not take: refused or ignored, never silently.

Fields of OpenAI or vLLM that ladsd cannot honour (:data:`REFUSED`: ``n`` > 1,
``logprobs``, audio, beam search, ...) are a 400 unless absent, null or their
"off" value; fields that change nothing here (:data:`IGNORED`: OpenAI's
bookkeeping, hints for other models) are ignored, and so are fields neither
defines, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ladsd.serve.errors import bad

# Fields OpenAI or vLLM define that ladsd does not honour: refused unless absent, null or
# one of these values (which mean "off").
REFUSED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),  # needs logprobs
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "functions": (),  # the deprecated form of tools
    "function_call": (),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "prompt_logprobs": (0,),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "chat_template_kwargs": (),
    "documents": (),
    "mm_processor_kwargs": (),
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "priority": (0,),  # the delivery policy orders requests
    "cache_salt": (),  # a client asking for cache isolation must not be silently shared
    "kv_transfer_params": (),
    "vllm_xargs": (),
}
# Fields that change nothing here (OpenAI's bookkeeping, hints for other models): ignored.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",  # the model does not reason
        "verbosity",
        "request_id",
    }
)


def refuse(body: Mapping[str, Any]) -> None:
    """400 for the first :data:`REFUSED` field that is on."""
    for key, off in REFUSED.items():
        v = body.get(key)
        if v is not None and v not in off:
            only = f" (only {json.dumps(off[0])})" if off else ""
            raise bad(f"'{key}' is not supported{only}", key)
