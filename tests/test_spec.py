"""Job spec loading: validation, ${ENV} interpolation, --set overrides, redaction and the digest."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from batchgen.pipeline.executors.ray_extra import RAY_EXTRA_HINT, ray_available
from batchgen.pipeline.render import required_columns
from batchgen.pipeline.spec import JobSpec, SpecError, load_spec, spec_from_dict

JOBS = Path(__file__).resolve().parent.parent / "jobs"

MINIMAL = textwrap.dedent("""\
    model:
      path: smollm2-135m-instruct
    input:
      path: data/in.jsonl
    prompt:
      template: |
        Summarize: {{ text }}
    output:
      path: out/x/
""")


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def errors_of(fn, *args, **kwargs) -> list[str]:
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def test_minimal_spec_defaults(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL, "my-job.yaml"), env={})
    assert spec.name == "my-job"
    assert spec.input.path == ["data/in.jsonl"]  # relative paths are kept as written
    assert spec.output.path == "out/x/"
    assert spec.prompt.template == "Summarize: {{ text }}\n"
    assert spec.engine.dtype == "auto" and spec.engine.device == "auto" and spec.engine.max_model_len is None
    assert (spec.engine.max_num_batched_tokens, spec.engine.max_num_seqs, spec.engine.kv_cache_memory) == (
        16384, 256, None)
    assert spec.sampling.max_tokens == 128 and spec.sampling.temperature == 0.0 and spec.sampling.seed == 0
    b = spec.batching
    assert (b.sort_window, b.max_prompt_tokens, b.truncate, b.sort) == (4096, 4096, "error", True)
    assert spec.output.format == "parquet" and spec.output.carry_columns == []
    assert spec.storage_options == {} and spec.max_error_rate == 1.0


def test_every_error_reported_with_its_path(tmp_path):
    text = textwrap.dedent("""\
        name: bad
        model: {path: m, flavour: x}
        engine: {dtype: fp8}
        input: {path: [in.jsonl, 3], format: csv}
        prompt: {template: "{{ text }", chat: maybe}
        sampling: {max_tokens: 0, top_p: 1.5, stop: [""]}
        batching: {sort_windw: 10, truncate: middle}
        output: {path: out/, format: xml}
        max_error_rate: 2
        extra_top: 1
    """)
    errs = errors_of(load_spec, write(tmp_path, text), overrides=["sampling.nope=1", "engine.max_num_seqs=-1"],
                     env={})
    expected_prefixes = [
        "--set sampling.nope: unknown key",
        "model.flavour: unknown key", "engine.dtype: ", "engine.max_num_seqs: ",
        "input.path[1]: ", "input.format: ",
        "prompt.template: template syntax error at line 1", "prompt.chat: ",
        "sampling.max_tokens: ", "sampling.top_p: ", "sampling.stop[0]: String should have at least 1 character",
        "batching.sort_windw: unknown key", "batching.truncate: ",
        "output.format: ", "max_error_rate: ", "extra_top: unknown key",
    ]
    for prefix in expected_prefixes:
        assert any(e.startswith(prefix) for e in errs), (prefix, errs)
    assert len(errs) == len(expected_prefixes), errs
    assert "(got 'fp8')" in next(e for e in errs if e.startswith("engine.dtype"))


def test_unknown_keys_name_the_nearest_key_of_their_section():
    errs = errors_of(spec_from_dict, {
        "name": "x", "model": {"path": "m"}, "input": {"path": "a.jsonl"}, "prompt": {"template": "{{ text }}"},
        "output": {"path": "out/"}, "sampling": {"max_token": 8, "zzz": 1}, "outptu_extra": 1}, env={})
    assert "sampling.max_token: unknown key; did you mean `max_tokens`?" in errs
    assert "sampling.zzz: unknown key" in errs  # nothing close: no guess
    errs = errors_of(spec_from_dict, {"name": "x", "model": {"path": "m"}, "input": {"path": "a.jsonl"},
                                      "prompt": {"template": "{{ text }}"}, "output": {"path": "out/"}},
                     overrides=["sampling.temprature=0.5", "batchin.sort=false"], env={})
    assert errs == ["--set sampling.temprature: unknown key; did you mean `temperature`?",
                    "--set batchin.sort: unknown key; did you mean `batching`?"]


def test_missing_required_keys_and_wrong_shapes():
    errs = errors_of(spec_from_dict, {"name": "x", "model": "just-a-string", "prompt": {}}, env={})
    assert "model: expected a mapping" in errs
    assert "input: required key is missing" in errs
    assert "output: required key is missing" in errs
    assert "prompt.template: required key is missing" in errs
    assert errors_of(spec_from_dict, ["a", "list"]) == [
        "<spec>: expected a mapping at the top level, got list"]


def test_a_storage_scheme_without_its_slashes_is_an_error_not_a_local_folder(tmp_path):
    base = {"name": "x", **yaml.safe_load(MINIMAL)}
    errs = errors_of(spec_from_dict, {**base, "output": {"path": "s3:/bkt/out/"},
                                      "input": {"path": ["data/in.jsonl", "gs:bkt/in.jsonl"]},
                                      "model": {"path": "hf:/org/model"}}, env={})
    assert sorted(errs) == ["input.path: 'gs:bkt/in.jsonl' is not a URL: gs locations are written gs://...",
                            "model.path: 'hf:/org/model' is not a URL: hf locations are written hf://...",
                            "output.path: 's3:/bkt/out/' is not a URL: s3 locations are written s3://..."]
    for fine in ("s3://bkt/out/", "file:/tmp/out", "out:2024/x", str(tmp_path / "out")):
        assert spec_from_dict({**base, "output": {"path": fine}}, env={}).output.path == fine


def test_unreadable_and_malformed_files(tmp_path):
    assert "cannot read spec" in errors_of(load_spec, str(tmp_path / "nope.yaml"))[0]
    assert "invalid YAML" in errors_of(load_spec, write(tmp_path, "model: [unclosed\n"))[0]
    # safe_load only: python tags are refused, not executed
    assert "invalid YAML" in errors_of(load_spec, write(tmp_path, "name: !!python/object/apply:os.getcwd []\n"))[0]


def test_env_interpolation(tmp_path):
    text = MINIMAL.replace("data/in.jsonl", "${DATA_DIR}/in.jsonl").replace(
        "out/x/", "${OUT:-out/default}/${NAME_SUFFIX:-}").replace(
        "Summarize:", "Cost in $$ and $${LITERAL}:") + "sampling: {max_tokens: '${MAXTOK:-8}'}\n"
    spec = load_spec(write(tmp_path, text), env={"DATA_DIR": "s3://bucket/data", "OUT": ""})
    assert spec.input.path == ["s3://bucket/data/in.jsonl"]
    assert spec.output.path == "out/default/"  # ':-' also replaces an empty value, like the shell
    assert spec.prompt.template.startswith("Cost in $$ and ${LITERAL}:")
    assert spec.sampling.max_tokens == 8


def test_unset_env_var_is_an_error_naming_the_key(tmp_path):
    text = MINIMAL.replace("data/in.jsonl", "[a.jsonl, '${MISSING}/b.jsonl']") + \
        "storage_options: {client_kwargs: {endpoint_url: '${ENDPOINT}'}, bad: '${not valid}'}\n"
    errs = errors_of(load_spec, write(tmp_path, text), env={})
    assert errs == [
        "input.path[1]: environment variable MISSING is not set",
        "storage_options.client_kwargs.endpoint_url: environment variable ENDPOINT is not set",
        "storage_options.bad: invalid variable reference ${not valid}",
    ]


def test_os_environ_is_the_default_env(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_TEST_MODEL", "/models/tiny")
    spec = load_spec(write(tmp_path, MINIMAL.replace("smollm2-135m-instruct", "${BATCHGEN_TEST_MODEL}")))
    assert spec.model.path == "/models/tiny"


def test_overrides(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL), overrides=[
        "sampling.max_tokens=8",
        "output.carry_columns=[title, author]",
        "batching.sort=false",
        "prompt.system=Be brief: one line.",  # not valid YAML: taken as the plain string
        "input.path=[a.parquet, 'b/*.parquet']",
        "storage_options.client_kwargs.endpoint_url=http://localhost:9000",
        "engine.max_model_len=2048",
        "prompt.template={{ body }}",
    ], env={})
    commented = load_spec(write(tmp_path, MINIMAL), overrides=[  # a '#' YAML would read as a comment: kept
        "prompt.template=Item #{{ id }}: {{ text }}", "prompt.system=# role: reviewer"], env={})
    assert (commented.prompt.template, commented.prompt.system) == ("Item #{{ id }}: {{ text }}", "# role: reviewer")
    assert spec.sampling.max_tokens == 8
    assert spec.output.carry_columns == ["title", "author"]
    assert spec.batching.sort is False
    assert spec.prompt.system == "Be brief: one line."
    assert spec.input.path == ["a.parquet", "b/*.parquet"]
    assert spec.storage_options == {"client_kwargs": {"endpoint_url": "http://localhost:9000"}}
    assert spec.engine.max_model_len == 2048
    assert spec.prompt.template == "{{ body }}"


def test_override_errors(tmp_path):
    path = write(tmp_path, MINIMAL)
    errs = errors_of(load_spec, path, overrides=[
        "batching.sort_windw=5", "sampling.max_tokens.deep=1", "nokey", "=3", "sampling.max_tokens=lots",
        "sampling.top_k=5 # five"], env={})
    assert errs == [
        "--set batching.sort_windw: unknown key; did you mean `sort_window`?",
        "--set sampling.max_tokens.deep: unknown key",
        "--set nokey: expected KEY.PATH=VALUE",
        "--set =3: expected KEY.PATH=VALUE",
        "sampling.max_tokens: Input should be a valid integer, unable to parse string as an integer (got 'lots')",
        "sampling.top_k: Input should be a valid integer, unable to parse string as an integer (got '5 # five')",
    ]


def test_override_then_interpolate_lets_set_replace_an_unset_reference(tmp_path):
    path = write(tmp_path, MINIMAL.replace("out/x/", "${OUT_DIR}"))
    assert load_spec(path, overrides=["output.path=elsewhere/"], env={}).output.path == "elsewhere/"


SECRETS = {
    "key": "AKIA123", "secret": "s3cr3t", "anon": False,
    "client_kwargs": {"endpoint_url": "http://minio:9000", "aws_secret_access_key": "x", "aws_session_token": "t"},
    "token": {"type": "service_account", "private_key": "pem"}, "password": "pw",
}


def spec_with(storage_options: dict, **over) -> JobSpec:
    data = {"name": "j", "model": {"path": "m"}, "input": {"path": "https://user:pw@host/data.jsonl"},
            "prompt": {"template": "{{ text }}"}, "output": {"path": "out/"}, "storage_options": storage_options}
    data.update(over)
    return spec_from_dict(data, env={})


def test_resolved_redacts_credentials():
    spec = spec_with(SECRETS)
    res = spec.resolved()
    assert res["storage_options"] == {
        "key": "***", "secret": "***", "anon": False,
        "client_kwargs": {"endpoint_url": "http://minio:9000", "aws_secret_access_key": "***",
                          "aws_session_token": "***"},
        "token": "***", "password": "***",
    }
    assert res["input"]["path"] == ["https://***:***@host/data.jsonl"]
    assert spec.storage_options["key"] == "AKIA123"  # the spec itself keeps the real values
    assert res["sampling"]["max_tokens"] == 128 and res["batching"]["sort"] is True
    for secret in ("AKIA123", "s3cr3t", "pem", "pw@"):
        assert secret not in str(res) and secret not in spec.digest()


def test_digest_is_stable_and_ignores_only_secrets():
    a = spec_with(SECRETS)
    assert a.digest() == spec_with(dict(SECRETS)).digest()
    assert len(a.digest()) == 64
    assert a.digest() == spec_with({**SECRETS, "secret": "rotated"}).digest()
    assert a.digest() != spec_with(SECRETS, name="other").digest()
    assert a.digest() != spec_with({**SECRETS, "anon": True}).digest()


NEEDS_RAY = pytest.mark.skipif(not ray_available(), reason=RAY_EXTRA_HINT)


@pytest.mark.parametrize("job", ["summarize.yaml", "extract.yaml", pytest.param("summarize-ray.yaml", marks=NEEDS_RAY)])
def test_example_jobs_load_and_fit_their_data(job):
    spec = load_spec(str(JOBS / job), env={})
    if job == "summarize-ray.yaml":  # the same job on Ray
        local = load_spec(str(JOBS / "summarize.yaml"), env={})
        assert spec.executor.kind == "ray" and local.executor.kind == "local" and spec.digest() == local.digest()
    assert spec.model.path == "smollm2-135m-instruct"
    assert spec.input.path == ["jobs/data/articles.jsonl"]
    assert spec.output.path == f"out/{spec.name}/"
    assert spec.sampling.max_tokens <= 128
    rows = [json.loads(line) for line in (JOBS / "data" / "articles.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows) >= 10
    needed = required_columns(spec.prompt.template) | set(spec.output.carry_columns) | {spec.input.id_column}
    for r in rows:
        assert needed <= r.keys()
        assert 150 <= len(r["text"].split()) <= 600, r["id"]
    assert load_spec(str(JOBS / job), env={"BATCHGEN_OUT": "/tmp/o"}).output.path == f"/tmp/o/{spec.name}/"


def test_executor_section(tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.pipeline.spec.ray_available", lambda: True)  # the keys, whether or not it is installed
    assert load_spec(write(tmp_path, MINIMAL), env={}).executor.kind == "local"
    spec = load_spec(write(tmp_path, MINIMAL), ["executor.kind=ray", "executor.num_replicas=2"], env={})
    assert (spec.executor.kind, spec.executor.num_replicas, spec.executor.num_cpus) == ("ray", 2, 1.0)
    assert spec.executor.address is None and spec.executor.num_gpus is None
    # where a job runs is not part of what it computes: a local run resumes a Ray run's output and back
    assert spec.digest() == load_spec(write(tmp_path, MINIMAL), env={}).digest()
    assert errors_of(load_spec, write(tmp_path, MINIMAL), ["executor.num_replicas=2"], env={}) == [
        "executor: num_replicas applies to kind ray only"]
    assert errors_of(load_spec, write(tmp_path, MINIMAL), ["executor.kind=ray", "executor.num_replicas=0"],
                     env={}) == ["executor.num_replicas: Input should be greater than or equal to 1 (got 0)"]
    password = load_spec(write(tmp_path, MINIMAL), ["executor.kind=ray", "executor.address=ray://u:pw@head:10001"],
                         env={})
    assert "pw" not in json.dumps(password.resolved())
    monkeypatch.setattr("batchgen.pipeline.spec.ray_available", lambda: False)  # ray is not installed
    assert errors_of(load_spec, write(tmp_path, MINIMAL), ["executor.kind=ray"], env={}) == [
        "executor.kind: executor kind ray needs Ray Data: pip install 'batchgen[ray]'"]


def test_yaml_error_names_the_line(tmp_path):
    err = errors_of(load_spec, write(tmp_path, MINIMAL + "sampling: {max_tokens: 1\n"))[0]
    assert err.startswith(f"{tmp_path / 'job.yaml'}:11:") and "invalid YAML" in err


def test_unknown_filters_binary_specs_and_out_of_range_seeds_are_spec_errors(tmp_path):
    base = {"name": "j", "model": {"path": "m"}, "input": {"path": "in.jsonl"}, "output": {"path": "out/"}}
    template = errors_of(spec_from_dict, {**base, "prompt": {"template": "{{ text | nosuchfilter }}"}})
    assert template == ["prompt.template: template error at line 1: No filter named 'nosuchfilter'."]
    seed = errors_of(spec_from_dict, {**base, "prompt": {"template": "{{ text }}"}, "sampling": {"seed": 2**64}})
    assert len(seed) == 1 and seed[0].startswith("sampling.seed: Input should be less than or equal to")
    binary = tmp_path / "spec.yaml"
    binary.write_bytes(b"\xff\xfe model: m")
    assert errors_of(load_spec, str(binary)) == [f"{binary}: not a YAML text file: invalid UTF-8 at byte 0"]


def test_numbers_refuse_yaml_booleans_and_values_past_their_range(tmp_path):
    """YAML reads yes/on/true as booleans, which pydantic would take as 1; a huge value failed only mid-run."""
    path = write(tmp_path, MINIMAL)
    errs = errors_of(load_spec, path, overrides=[
        "sampling.max_tokens=yes", "sampling.temperature=on", "batching.sort_window=true", "output.rows_per_part=on",
        "input.max_row_bytes=true", "executor.num_cpus=yes"], env={})
    assert sorted(errs) == sorted(f"{key}: expected a number, got true" for key in (
        "sampling.max_tokens", "sampling.temperature", "batching.sort_window", "output.rows_per_part",
        "input.max_row_bytes", "executor.num_cpus"))
    errs = errors_of(load_spec, path, overrides=[
        "batching.sort_window=99999999999999999999", "sampling.top_k=99999999999999999999",
        "output.lease_timeout_s=1e30"], env={})
    assert [e.split(":")[0] for e in errs] == ["sampling.top_k", "batching.sort_window", "output.lease_timeout_s"]
    assert all("less than or equal to" in e for e in errs)


def test_a_key_given_twice_and_an_alias_that_holds_itself_are_spec_errors(tmp_path):
    twice = MINIMAL + "sampling: {max_tokens: 4}\nsampling: {temperature: 0.5}\n"
    assert errors_of(load_spec, write(tmp_path, twice), env={}) == [
        f"{tmp_path / 'job.yaml'}:{twice.count(chr(10))}:1: invalid YAML: key 'sampling' is given twice"]
    loop = MINIMAL + "storage_options: &a {self: *a}\n"
    assert errors_of(load_spec, write(tmp_path, loop), env={}) == [
        "<spec>: a YAML alias refers to a mapping or list that holds it (a value that contains itself)"]


def test_penalties_with_speculative_decoding_are_a_spec_error(tmp_path):
    path = write(tmp_path, MINIMAL)
    for sampling in ("sampling.repetition_penalty=1.2", "sampling.min_tokens=2"):
        assert errors_of(load_spec, path, overrides=[sampling, "engine.speculative_config={method: ngram}"],
                         env={}) == ["sampling: penalties and min_tokens are not taken with speculative decoding "
                                     "(engine.speculative_config)"]
    assert load_spec(path, overrides=["sampling.repetition_penalty=1.2"], env={}).sampling.repetition_penalty == 1.2


def test_the_spec_takes_vllms_spellings_of_off_as_the_engine_does(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL), overrides=[
        "sampling.top_k=-1", "sampling.stop=null", "sampling.stop_token_ids=null"], env={})
    params = spec.sampling.params()
    assert (params.top_k, params.stop, params.stop_token_ids) == (0, [], [])


def test_yaml_merge_keys_still_load(tmp_path):
    text = MINIMAL + "sampling:\n  <<: {max_tokens: 4, temperature: 0.5}\n  max_tokens: 9\n"
    spec = load_spec(write(tmp_path, text), env={})
    assert (spec.sampling.max_tokens, spec.sampling.temperature) == (9, 0.5)
