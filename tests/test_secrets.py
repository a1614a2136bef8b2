"""No credential reaches any output surface: every option name s3fs, gcsfs and adlfs take a credential
under, URL passwords and session tokens, checked in stdout, stderr (logs at -v, tracebacks), stats.json,
_SUCCESS, the manifest, the lease and error rows, for `validate` and for succeeding and failing runs."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.io import read_output
from batchgen.io.redaction import MASK, is_secret_key, redact, remember_secrets_in
from batchgen.pipeline import preflight
from batchgen.pipeline.spec import spec_from_dict
from tests.job_helpers import records, spec_dict, tiny_llm, write_jsonl  # noqa: F401  (fixture)
from tests.s3_server import BUCKET, moto_server, s3  # noqa: F401  (fixtures)

PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC-pem-body-7731\n-----END PRIVATE KEY-----\n"
AZURE_KEY = "azAccountKey7731+base64/padding=="

# storage_options as each filesystem takes them; every value containing "7731" is a credential
FAMILIES: dict[str, dict[str, Any]] = {
    "s3fs": {
        "key": "AKIAIOSFODNN7EXAMPLE", "secret": "s3fs-secret-7731", "token": "s3fs-session-token-7731",
        "username": "s3fs-username-7731", "password": "s3fs-password-7731", "anon": False,
        "client_kwargs": {"region_name": "us-east-1", "aws_access_key_id": "ASIAIOSFODNN7EXAMPLE",
                          "aws_secret_access_key": "boto-secret-7731", "aws_session_token": "boto-session-7731"},
        "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "sse-c-key-7731"},
    },
    # MinIO-style: the access key id matches no AWS pattern, under either of the names s3fs takes it by
    "s3fs-minio": {"key": "minio-access-key-7731", "secret": "minio-secret-7731",
                   "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}},
    "s3fs-minio-username": {"username": "minio-user-key-7731", "password": "minio-password-7731"},
    "gcsfs-dict": {
        "project": "my-project",
        "token": {"type": "service_account", "client_email": "sa@my-project.iam.gserviceaccount.com",
                  "private_key_id": "gcs-private-key-id-7731", "private_key": PEM,
                  "client_secret": "gcs-client-secret-7731", "refresh_token": "gcs-refresh-7731"},
    },
    "gcsfs-str": {"project": "my-project", "token": "/var/run/secrets/gcs-sa-7731.json"},
    "adlfs": {
        "account_name": "myaccount", "account_key": AZURE_KEY, "sas_token": "sv=2022-11-02&ss=b&sig=sas-sig-7731",
        "connection_string": ("DefaultEndpointsProtocol=https;AccountName=myaccount;"
                              f"AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net"),
        "client_id": "00000000-client-id", "tenant_id": "tenant-id", "client_secret": "adlfs-client-secret-7731",
        "credential": "adlfs-credential-7731",
    },
    "http-headers": {"client_kwargs": {"headers": {"X-Api-Key": "api-key-header-7731",
                                                   "Cookie": "session=cookie-7731"}}},
}
URL_PASSWORD = "url-password-7731"
CREDENTIAL_MARK = "7731"


def secrets_of(value: Any) -> set[str]:
    """Every credential in a fixture, by construction and not by key name: each string leaf that holds the
    marker "7731" or is an AWS access key id, and the account key inside a connection string."""
    found = {s for s in _leaves(value) if CREDENTIAL_MARK in s or s.startswith(("AKIA", "ASIA"))}
    return found | ({AZURE_KEY} if any(AZURE_KEY in s for s in found) else set())


def _leaves(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value] if isinstance(value, str) else []


def surfaces(out: Path) -> str:
    """Everything a run left in its output folder, Parquet rows decoded."""
    text = [p.read_bytes().decode("latin-1") for p in out.rglob("*") if p.is_file()]
    text.append(json.dumps(read_output(str(out)), default=str))
    return "\n".join(text)


def assert_hidden(where: str, text: str, secrets: set[str]) -> None:
    leaked = sorted(s for s in secrets if s in text)
    assert not leaked, f"{where} shows {leaked}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_credential_option_is_masked(family):
    opts = FAMILIES[family]
    secrets = secrets_of(opts)
    assert secrets
    masked = redact(opts)
    assert_hidden("redact(options)", json.dumps(masked), secrets)
    assert_hidden("redact(str(options))", redact(str(opts)), secrets)
    for name in ("anon", "project", "account_name", "client_id", "region_name", "SSECustomerAlgorithm"):
        assert not is_secret_key(name), name
    remember_secrets_in(opts)  # what storage_options_for does: values echoed by a library are masked too
    for secret in secrets:
        assert redact(f"botocore said: bad value {secret}!") == f"botocore said: bad value {MASK}!"


def _rotated(value: Any) -> Any:
    """value with every credential replaced by another one."""
    if isinstance(value, dict):
        return {k: _rotated(v) for k, v in value.items()}
    return value + "-rotated" if isinstance(value, str) and value in secrets_of(value) else value


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spec_digest_ignores_credentials_only(family, tmp_path):
    def digest(opts: dict[str, Any], model: str = "m", **over: Any) -> str:
        return spec_from_dict(spec_dict(model, "in.jsonl", "out/", storage_options=opts, **over), env={}).digest()

    opts = FAMILIES[family]
    assert digest(opts) == digest(_rotated(opts)) == digest(json.loads(json.dumps(opts)))
    assert digest(opts) != digest({**opts, "endpoint_url": "http://elsewhere:9000"})
    assert digest(opts) != digest(opts, model="other")
    assert digest(opts, input={"path": f"https://u:{URL_PASSWORD}@h/in.jsonl"}) == \
        digest(opts, input={"path": "https://u:another-password@h/in.jsonl"})


def test_a_mistyped_set_shows_no_value(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict("m", tmp_path / "in.jsonl", tmp_path / "out")))
    res = invoke("validate", str(job), "--set", "storage_options.secret:SuperSecretValue987",
                 "--set", "storage_options.key SuperSecretValue987")
    assert res.exit_code == 2 and "SuperSecretValue987" not in res.output
    assert "--set storage_options.secret:...: expected KEY.PATH=VALUE" in res.output


def test_text_forms_are_masked():
    cases = {
        f"s3://AKIAIOSFODNN7EXAMPLE:{URL_PASSWORD}@bucket/x": "s3://***:***@bucket/x",
        f"abfs://c/x?sv=1&sig=sig-value-7731&se=2": "abfs://c/x?sv=1&sig=***&se=2",
        f"DefaultEndpointsProtocol=https;AccountKey={AZURE_KEY};EndpointSuffix=x": 
            "DefaultEndpointsProtocol=https;AccountKey=***;EndpointSuffix=x",
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload-7731": "Authorization: Bearer ***",
        "AWS_SESSION_TOKEN=env-session-7731 next": "AWS_SESSION_TOKEN=*** next",
        '{"client_secret": "cs-7731", "name": "job"}': '{"client_secret": "***", "name": "job"}',
        "--set storage_options.account_key=key-7731": "--set storage_options.account_key=***",
        f"pem: {PEM.strip()}": "pem: ***",  # (stripped: alone or after a test that remembered PEM, the same)
        # a pasted secret key holding "/" and "@" unescaped; a port is no password
        "s3://AKIDSECRETKEYID12345:wJalrXUtn/K7MDENG/bPx+EXAMPLE@bkt/o/": "s3://***:***@bkt/o/",
        "s3://u:Sup3r@Secret/987@bkt/x, then x@y": "s3://***:***@bkt/x, then x@y",
        "http://host:8080/a@b": "http://host:8080/a@b",
    }
    for text, expected in cases.items():
        assert redact(text) == expected


@pytest.fixture
def shared_engine(monkeypatch, tiny_llm, tiny_model):
    """The module's engine for the tiny model; any other model path is really loaded (and may fail)."""
    real = preflight.load_model
    monkeypatch.setattr(preflight, "load_model",
                        lambda spec: tiny_llm if spec.model.path == str(tiny_model) else real(spec))


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def bad_rows() -> list[bytes]:
    recs = records(6)
    lines = [json.dumps(r).encode() for r in recs]
    return lines[:3] + [b"{broken json", json.dumps(recs[0]).encode()] + lines[3:]  # malformed + duplicate id


@pytest.fixture
def http_input(s3) -> str:  # noqa: F811
    """An input file served over HTTP by the moto server, with a password in its URL."""
    s3.client().put_object(Bucket=BUCKET, Key="in.jsonl", Body=b"\n".join(bad_rows()) + b"\n")
    host = s3.moto_url.split("://", 1)[1]
    return f"http://reader:{URL_PASSWORD}@{host}/{BUCKET}/in.jsonl"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_surface_shows_a_credential(family, tmp_path, tiny_model, shared_engine, request, caplog):
    opts = FAMILIES[family]
    secrets = secrets_of(opts) | {URL_PASSWORD}
    if family == "http-headers":  # the input itself is remote, so its URL is in error rows and messages
        inp = request.getfixturevalue("http_input")
    else:
        inp = tmp_path / "in.jsonl"
        inp.write_bytes(b"\n".join(bad_rows()) + b"\n")
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict(tiny_model, str(inp), out, storage_options=opts,
                                            output={"format": "jsonl", "rows_per_part": 3})))

    shown = [invoke("validate", str(job))]
    assert shown[0].exit_code == 0 and MASK in shown[0].stdout
    with caplog.at_level(logging.DEBUG):
        shown.append(invoke("run", str(job), "-v"))
        assert shown[-1].exit_code == 0, shown[-1].output
        rows = read_output(str(out))
        errors = [r["error"]["message"] for r in rows if r["error"]]
        assert len(errors) == 2 and any("malformed JSON" in e for e in errors)
        if family == "http-headers":
            assert all("http://***:***@" in e for e in errors)
        assert json.loads((out / "stats.json").read_text())["spec"]["storage_options"] == redact(opts)
        assert_hidden("the output folder", surfaces(out), secrets)
        shown.append(invoke("report", str(out), "-o", str(tmp_path / "report.html")))
        assert shown[-1].exit_code == 0, shown[-1].output
        assert_hidden("the report", (tmp_path / "report.html").read_text(), secrets)
        # failures: a model URL with a password, an input URL with a password that cannot be reached
        shown.append(invoke("run", str(job), "-v", "--overwrite", "--set",
                            f"model.path=s3://AKIAIOSFODNN7EXAMPLE:{URL_PASSWORD}@no-such-bucket/model"))
        shown.append(invoke("run", str(job), "-v", "--set",
                            f"input.path=http://user:{URL_PASSWORD}@127.0.0.1:9/in.jsonl"))
    assert [r.exit_code for r in shown[3:]] == [1, 1]
    assert "cannot download" in shown[3].stderr or "cannot load model" in shown[3].stderr
    for i, res in enumerate(shown):
        assert_hidden(f"stdout of command {i}", res.stdout, secrets)
        assert_hidden(f"stderr of command {i}", res.stderr, secrets)
    assert_hidden("batchgen's log records", "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith("batchgen")), secrets)
    assert_hidden("the output folder after failed runs", surfaces(out), secrets)


def test_s3_env_credentials_and_session_token(s3, tmp_path, tiny_model, shared_engine, monkeypatch):  # noqa: F811
    secrets = {"env-secret-key-7731", "env-session-token-7731", "AKIAIOSFODNN7EXAMPLE"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.moto_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-key-7731")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-session-token-7731")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3.client().put_object(Bucket=BUCKET, Key="in.jsonl", Body=b"\n".join(bad_rows()) + b"\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict(tiny_model, s3.url("in.jsonl"), s3.url("out"))))
    shown = [invoke("run", str(job), "-v"),
             invoke("run", str(job), "-v", "--overwrite", "--set", f"model.path={s3.url('no-model')}"),
             invoke("run", str(job), "-v", "--set", "output.path=s3://no-such-bucket/out")]
    assert [r.exit_code for r in shown] == [0, 1, 1], [r.output for r in shown]
    for i, res in enumerate(shown):
        assert_hidden(f"output of command {i}", res.output, secrets)
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        body = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read().decode("latin-1")
        assert_hidden(obj["Key"], body, secrets)


@pytest.mark.timeout(60)
def test_redaction_is_linear_on_long_tokens():
    """A 200k-character token (an echoed bad value) took minutes when patterns backtracked from every position."""
    for text in ("a" * 200_000, "s3://x:" + "y" * 200_000, "s3://a:b" * 25_000, "x" * 200_000 + "://"):
        assert redact(text).endswith(text[-5:]) or MASK in redact(text)
