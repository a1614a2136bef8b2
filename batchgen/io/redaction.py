"""Redaction of credentials in dicts and strings before they reach logs, errors or output files."""

from __future__ import annotations

import re
import threading
from typing import Any

MASK = "***"

# Matched against keys lowercased with '-' turned into '_'.
SECRET_KEYS = frozenset({
    "key", "secret", "token", "password", "passwd", "pwd",
    "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "aws_security_token",
    "access_key", "access_key_id", "secret_key", "secret_access_key", "session_token",
    "security_token", "access_token", "refresh_token", "id_token", "auth_token", "bearer_token",
    "api_key", "apikey", "api_token", "hf_token", "client_secret", "private_key",
    "account_key", "sas_token", "credential", "credentials", "authorization", "auth",
    "connection_string",
})
_SECRET_SUFFIXES = ("_secret", "_password", "_secret_key", "_access_key", "_api_key", "_private_key")

_NAMES = (r"(?:aws_secret_access_key|aws_session_token|aws_security_token|aws_access_key_id|"
          r"secret_access_key|session_token|access_token|refresh_token|api_key|client_secret|"
          r"password|secret|token|key)")
_PATTERNS = [
    # scheme://user:password@host
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s:@]+:[^/\s@]+@"), r"\1" + MASK + ":" + MASK + "@"),
    # presigned URL and similar query parameters
    (re.compile(r"([?&](?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|sig|"
                r"token|access_token|key|secret|password)=)[^&\s'\"]+", re.IGNORECASE), r"\1" + MASK),
    # name=value / name: value, quoted as in a dict repr or bare as in env dumps
    (re.compile(r"(['\"]?\b" + _NAMES + r"['\"]?\s*[:=]\s*)(['\"])(?:(?!\2).)*\2", re.IGNORECASE),
     r"\1\2" + MASK + r"\2"),
    (re.compile(r"(\b(?:aws_secret_access_key|aws_session_token|aws_security_token|password)\s*=\s*)"
                r"[^\s'\",&]+", re.IGNORECASE), r"\1" + MASK),
    # AWS access key ids
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
]

_known: set[str] = set()
_lock = threading.Lock()


def remember_secret(value: Any) -> None:
    """Register a credential value so that it is masked wherever it later appears in a string."""
    if isinstance(value, str) and len(value) >= 6:
        with _lock:
            _known.add(value)


def is_secret_key(name: Any) -> bool:
    """True when a mapping key names a credential."""
    if not isinstance(name, str):
        return False
    norm = name.lower().replace("-", "_")
    return norm in SECRET_KEYS or norm.endswith(_SECRET_SUFFIXES)


def _redact_str(text: str) -> str:
    with _lock:
        known = sorted(_known, key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, MASK)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def redact(obj: Any) -> Any:
    """Return a copy of obj with credentials replaced by "***" (dicts, lists, tuples, strings)."""
    if isinstance(obj, str):
        return _redact_str(obj)
    if isinstance(obj, dict):
        return {k: (MASK if is_secret_key(k) and v is not None else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, BaseException):
        return _redact_str(str(obj))
    return obj


def remember_secrets_in(options: dict[str, Any]) -> None:
    """Register every credential value found under secret-named keys of options (recursively)."""
    for k, v in options.items():
        if isinstance(v, dict):
            remember_secrets_in(v)
        elif is_secret_key(k):
            remember_secret(v)
