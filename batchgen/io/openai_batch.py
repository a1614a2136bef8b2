"""The OpenAI Batch file format: request lines in, result and error lines out (as the Batch API writes them).

Requests are checked against what batchgen supports; anything else raises :class:`BatchRequestError`, which
the pipeline turns into that line's error record. Sampling settings come out under the engine's field names.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
RESULTS_PREFIX, ERRORS_PREFIX = "part", "errors"

# Body fields accepted only with these values (or null): batchgen always returns one plain completion.
_NEUTRAL = {"n": 1, "stream": False, "top_logprobs": 0, "echo": False, "best_of": 1}
_IGNORED = ("model", "user")  # the job's model serves every line; ``user`` is only a label
_COMMON = {"max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "response_format", "frequency_penalty",
           "presence_penalty"} \
    | set(_NEUTRAL) | set(_IGNORED)
_BODY_FIELDS = {CHAT_URL: _COMMON | {"messages", "max_completion_tokens"}, COMPLETIONS_URL: _COMMON | {"prompt"}}
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
_MESSAGE_FIELDS = {"role", "content", "name"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class BatchRequestError(ValueError):
    """A request line batchgen cannot run; ``code`` goes into its error record."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class BatchRequest:
    """One parsed request line: a chat (``messages``) or a completion (``prompt``), and its own sampling."""

    custom_id: str
    url: str
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # engine field names; absent = the job's default

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


def _fail(message: str) -> None:
    raise BatchRequestError(message)


def _number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        _fail(f"body.{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        _fail(f"body.{name} must be between {low} and {high}, got {value!r}")
    return value


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                _fail(f"body.messages[{index}].content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    _fail(f"body.messages[{index}].content must be a string or a list of text parts")
    raise AssertionError  # unreachable


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        _fail("body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            _fail(f"body.messages[{i}] must be an object")
        unknown = sorted(set(m) - _MESSAGE_FIELDS)
        if unknown:
            _fail(f"body.messages[{i}]: unsupported field {unknown[0]!r}")
        role = _ROLES.get(m.get("role"))
        if role is None:
            _fail(f"body.messages[{i}].role {m.get('role')!r} is not supported; use system, developer, user "
                  f"or assistant")
        out.append({"role": role, "content": _content(m, i)})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    _fail("body.prompt must be a non-empty string or a list of token ids (one prompt per line)")
    raise AssertionError  # unreachable


def _response_format(value: Any) -> dict[str, Any]:
    """The constraint a ``response_format`` asks for, replacing any the job set."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {"json_schema": None, "regex": None, "choice": None}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}, "regex": None, "choice": None}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            _fail("body.response_format.json_schema.schema must be a JSON Schema object")
        return {"json_schema": schema, "regex": None, "choice": None}
    _fail(f"body.response_format.type must be text, json_object or json_schema, got {kind!r}")
    raise AssertionError  # unreachable


def _sampling(body: dict, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins when both are given
        if body.get(name) is not None:
            out["max_tokens"] = _number(body, name, int, 1)
            break
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1), ("frequency_penalty", -2, 2),
                            ("presence_penalty", -2, 2)):
        value = _number(body, name, float, low, high)
        if value is not None:
            out[name] = float(value)
    if body.get("seed") is not None:
        out["seed"] = _number(body, "seed", int, -(2**63), 2**63 - 1)  # an int64, as the API takes
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            _fail("body.stop must be a non-empty string or a list of up to 4 of them")
        out["stop"] = stops
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if chat and not isinstance(logprobs, bool):
            _fail(f"body.logprobs must be true or false, got {logprobs!r}")
        if not chat and (isinstance(logprobs, bool) or logprobs != 0):
            _fail(f"body.logprobs: only 0 (the sampled tokens' log-probabilities) is supported, got {logprobs!r}")
        out["logprobs"] = True if not chat else logprobs
    if body.get("response_format") is not None:
        out.update(_response_format(body["response_format"]))
    return out


def parse_request(line: dict[str, Any]) -> BatchRequest:
    """Checks one request line; raises :class:`BatchRequestError` naming the first unsupported field or value."""
    unknown = sorted(set(line) - _LINE_FIELDS)
    if unknown:
        _fail(f"unsupported field {unknown[0]!r}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        _fail("custom_id must be a non-empty string")
    if line.get("method", "POST") != "POST":
        _fail(f"method must be POST, got {line.get('method')!r}")
    url = line.get("url")
    if url not in URLS:
        _fail(f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
    body = line.get("body")
    if not isinstance(body, dict):
        _fail("body must be an object")
    unknown = sorted(set(body) - _BODY_FIELDS[url])
    if unknown:
        _fail(f"body.{unknown[0]} is not supported for {url}")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            _fail(f"body.{name}={body[name]!r} is not supported (only {json.dumps(neutral)})")
    chat = url == CHAT_URL
    return BatchRequest(custom_id, url, messages=_messages(body) if chat else None,
                        prompt=None if chat else _prompt(body), sampling=_sampling(body, chat))


# -- output ------------------------------------------------------------------------------------------

def _ids(custom_id: str) -> str:
    """A stable suffix for the line's ids, so a rerun names the same request the same way."""
    return hashlib.sha256(custom_id.encode("utf-8")).hexdigest()[:24]


def _logprobs(tokens: list[dict[str, Any]] | None, chat: bool) -> dict[str, Any] | None:
    if tokens is None:
        return None
    pieces = [bytes(t["bytes"]) if "bytes" in t else t["token"].encode() for t in tokens]
    if chat:
        return {"content": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(b), "top_logprobs": []}
                            for t, b in zip(tokens, pieces)], "refusal": None}
    offsets, at, text = [], 0, codecs.getincrementaldecoder("utf-8")("replace")
    for b in pieces:  # the characters before each token: one split across tokens counts once, where it ends
        offsets.append(at)
        at += len(text.decode(b))
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": None, "text_offset": offsets}


def result_line(row: dict[str, Any], created: int) -> dict[str, Any]:
    """The output-file line of a finished request: ``row`` has custom_id, url, model, output, finish_reason,
    prompt_tokens, completion_tokens and optionally logprobs (``[{token, bytes, logprob}]``)."""
    suffix, chat = _ids(row["custom_id"]), row["url"] == CHAT_URL
    usage = _usage(row)
    logprobs = _logprobs(row.get("logprobs"), chat)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": row["output"], "refusal": None},
                  "logprobs": logprobs, "finish_reason": row["finish_reason"]}
        body = {"id": f"chatcmpl-{suffix}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": row["output"], "logprobs": logprobs, "finish_reason": row["finish_reason"]}
        body = {"id": f"cmpl-{suffix}", "object": "text_completion"}
    body.update(created=created, model=row["model"], choices=[choice], usage=usage)
    return {"id": f"batch_req_{suffix}", "custom_id": row["custom_id"],
            "response": {"status_code": 200, "request_id": f"req_{suffix}", "body": body}, "error": None}


def _usage(row: dict[str, Any]) -> dict[str, int]:
    prompt, completion = row.get("prompt_tokens") or 0, row.get("completion_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def error_line(row: dict[str, Any]) -> dict[str, Any]:
    """The error-file line of a request that failed: ``row`` has custom_id and error ``{code, message}``, and the
    tokens the request spent before it failed (``usage``, beside the API's fields; 0 for one never run)."""
    return {"id": f"batch_req_{_ids(row['custom_id'])}", "custom_id": row["custom_id"], "response": None,
            "error": {"code": row["error"]["code"], "message": row["error"]["message"]}, "usage": _usage(row)}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n" for line in lines)


def serialize_part(rows: list[dict[str, Any]], key: str) -> dict[str, bytes]:
    """A part's files: ``part-<key>.jsonl`` with the result lines, ``errors-<key>.jsonl`` when some rows failed."""
    created = int(time.time())
    ok = [result_line(r, created) for r in rows if r.get("error") is None]
    failed = [error_line(r) for r in rows if r.get("error") is not None]
    files = {f"{RESULTS_PREFIX}-{key}.jsonl": _jsonl(ok)}
    if failed:
        files[f"{ERRORS_PREFIX}-{key}.jsonl"] = _jsonl(failed)
    return files
