"""Redaction of credentials in dicts and strings before they reach logs, errors or output files.

The only place that knows what a credential looks like: option names of s3fs, gcsfs and adlfs (and
HTTP headers), URL passwords, signed-URL parameters, connection strings, bearer tokens, PEM keys, AWS
access key ids, and every value registered with :func:`remember_secret`.
"""

from __future__ import annotations

import re
import threading
from typing import Any

MASK = "***"

# Option and header names that hold a credential, matched after normalize_key().
SECRET_KEYS = frozenset({
    # generic
    "key", "secret", "token", "password", "passwd", "pwd", "auth", "authorization", "cookie",
    "credential", "credentials", "private_key", "private_key_id", "api_key", "apikey", "api_token",
    "access_token", "refresh_token", "id_token", "auth_token", "bearer_token", "session_token",
    "security_token", "client_secret", "hf_token", "use_auth_token",
    # s3fs / botocore (storage_options, client_kwargs, s3_additional_kwargs) and AWS env names; s3fs takes
    # the access key id as ``key`` or ``username`` (MinIO-style ids match no AWS pattern)
    "username", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "aws_security_token",
    "access_key", "access_key_id", "secret_key", "secret_access_key", "sse_customer_key",
    "x_amz_signature", "x_amz_credential", "x_amz_security_token",
    # adlfs (Azure): account key, SAS, connection string, service principal secret
    "account_key", "sas_token", "connection_string", "shared_access_signature", "sig",
})
_SECRET_SUFFIXES = ("_secret", "_password", "_secret_key", "_access_key", "_api_key", "_private_key")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def normalize_key(name: str) -> str:
    """``SSECustomerKey``, ``x-amz-signature``, ``AccountKey`` -> ``sse_customer_key`` style."""
    return _CAMEL.sub("_", name).lower().replace("-", "_")


def is_secret_key(name: Any) -> bool:
    """True when a mapping key, header or ``name=value`` name holds a credential."""
    if not isinstance(name, str):
        return False
    norm = normalize_key(name)
    return norm in SECRET_KEYS or norm.endswith(_SECRET_SUFFIXES)


_NAME = r"[A-Za-z_][\w\-]*"
_QUOTED = re.compile(r"(?P<head>(?P<q>['\"]?)(?<![\w\-])(?P<name>" + _NAME + r")(?P=q)\s*[:=]\s*)"  # word starts only
                     r"(?P<v>['\"])(?P<val>(?:(?!(?P=v)).)*)(?P=v)")
_BARE = re.compile(r"(?P<head>(?<![\w\-])(?P<name>" + _NAME + r")=)(?P<val>[^\s'\",&;]+)")
# scheme://user:password@host, the password up to the token's last "@": a pasted secret key may hold "/", "+" and
# "@" unescaped (a port, host:8080/, is not a password).
_URL_USERINFO = (r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^/\s:@]{1,256}):"
                 r"(?P<password>(?!\d{1,5}(?:[/?#]|\s|$))\S{1,256})@")  # bounded: no quadratic backtracking
_FIXED = [
    (re.compile(_URL_USERINFO), r"\g<scheme>" + MASK + ":" + MASK + "@"),
    (re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=\-]{8,}"), r"\1 " + MASK),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.DOTALL),
     MASK),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
]

_known: set[str] = set()
_lock = threading.Lock()


def remember_secret(value: Any) -> None:
    """Register a credential value so that it is masked wherever it later appears in a string."""
    if isinstance(value, str) and len(value) >= 6:
        with _lock:
            _known.add(value)


_USERINFO = re.compile(_URL_USERINFO)
_KEY_ID_MIN_CHARS = 16  # a URL's user part this long is an access key id (s3://KEY:SECRET@bucket), not a name


def remember_url_credentials(url: str) -> None:
    """Register the password of ``scheme://user:password@...`` (and a user part long enough to be an access
    key id), so that a library quoting the URL without its scheme (botocore's bucket-name errors) is masked."""
    for m in _USERINFO.finditer(url):
        remember_secret(m.group("password"))
        for piece in re.split(r"[/@]", m.group("password")):  # a parser that stops at "/" or "@" quotes a piece
            if len(piece) >= 8:
                remember_secret(piece)
        if len(m.group("user")) >= _KEY_ID_MIN_CHARS:
            remember_secret(m.group("user"))


def _mask_named(m: re.Match) -> str:
    if not is_secret_key(m.group("name")):
        return m.group(0)
    quote = m.groupdict().get("v") or ""
    return f"{m.group('head')}{quote}{MASK}{quote}"


def _redact_str(text: str) -> str:
    with _lock:
        known = sorted(_known, key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, MASK)
    for pattern, repl in _FIXED:
        text = pattern.sub(repl, text)
    return _BARE.sub(_mask_named, _QUOTED.sub(_mask_named, text))


def redact(obj: Any) -> Any:
    """A copy of obj with credentials replaced by "***" (dicts, lists, tuples, strings, exceptions).

    A value under a secret key is masked whole, whatever its type (gcsfs takes a service-account
    dict as ``token``, adlfs a credential object as ``credential``).
    """
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
        if is_secret_key(k):
            _remember_all(v)
        elif isinstance(v, dict):
            remember_secrets_in(v)


def _remember_all(value: Any) -> None:
    if isinstance(value, dict):
        for v in value.values():
            _remember_all(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _remember_all(v)
    else:
        remember_secret(value)
