"""OpenAI Batch request lines as engine requests: chat messages or a completion prompt, and the line's sampling."""
from __future__ import annotations

from typing import Any, Mapping

from batchgen.engine import SamplingParams
from batchgen.io.openai_batch import CHAT_URL, COMPLETIONS_URL, BatchRequestError, parse_request
from batchgen.pipeline.render import PromptTokenizer, RenderError
from batchgen.pipeline.sampling import SamplingSpec, row_seed, schema_problem

CARRY_COLUMNS = ["url"]  # what the OpenAI Batch writer needs besides the row id (the custom_id)


def default_url(chat: bool) -> str:
    """The endpoint a templated prompt stands for, when its results are written as OpenAI Batch lines."""
    return CHAT_URL if chat else COMPLETIONS_URL


def prompt_chars(messages: list[dict[str, str]] | None, prompt: str | list[int] | None) -> int:
    """Characters of a request's text: its messages' contents, or its prompt string (token ids: 0)."""
    if messages is not None:
        return sum(len(m.get("content") or "") for m in messages)
    return len(prompt) if isinstance(prompt, str) else 0


class OpenAIPrompts:
    """Each line's messages (through the chat template) or prompt, with its settings over the spec's sampling."""

    def __init__(self, tokenizer: PromptTokenizer, sampling: SamplingSpec, max_chars: int) -> None:
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_chars = max_chars  # longer prompts are refused before they are tokenized

    def build(self, values: Mapping[str, Any], row_id: str) -> tuple[list[int], SamplingParams]:
        """A line without a ``seed`` samples with the row's own (``row_seed``), not the spec's: repeated lines
        are independent samples, as the API's unseeded requests are."""
        try:
            request = parse_request(dict(values))
        except BatchRequestError as e:
            raise RenderError(e.code, e.message) from None
        schema = request.sampling.get("json_schema")
        problem = schema_problem(schema) if schema is not None else None
        if problem:
            where = f"body.response_format.json_schema.schema{problem[0]}"
            raise RenderError("invalid_request", f"{where}: {problem[1]}")
        seed = {} if "seed" in request.sampling else {"seed": row_seed(self.sampling.seed, row_id)}
        try:
            params = self.sampling.params(**request.sampling, **seed)
        except ValueError as e:
            raise RenderError("invalid_request", str(e)) from None
        size = prompt_chars(request.messages, request.prompt)
        if size > self.max_chars:
            raise RenderError("prompt_too_long", f"prompt has {size} characters > max {self.max_chars} "
                                                 f"(batching.max_prompt_chars)")
        try:
            if request.messages is not None:
                ids = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)
            elif isinstance(request.prompt, str):
                ids = self.tokenizer.encode(request.prompt)
            else:
                ids = request.prompt
        except Exception as e:  # noqa: BLE001 - e.g. a template that rejects the roles, or no chat template
            raise RenderError("tokenizer_error", f"{type(e).__name__}: {e}") from None
        return list(ids), params
