"""Kill -9 a job that reads and writes S3 (a local moto server), rerun it, and count the output rows.

    python benchmarks/s3_resume_demo.py [--model smollm2-135m-instruct] [--rows 24] [--kill-after-parts 1]

Starts moto's S3 server on 127.0.0.1, uploads jobs/data/articles.jsonl (repeated to --rows rows) to
s3://demo/in/, runs `batchgen run jobs/summarize.yaml` against it with one row per part, sends SIGKILL
once --kill-after-parts parts are committed, reruns the same command, and prints the row counts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import s3fs
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kill-after-parts", type=int, default=1)
    args = ap.parse_args()

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the S3 server's request log
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "demo-key",
           "AWS_SECRET_ACCESS_KEY": "demo-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    fs = s3fs.S3FileSystem(key="demo-key", secret="demo-secret", client_kwargs={"endpoint_url": endpoint})
    fs.mkdir("demo")
    docs = [json.loads(line) for line in (ROOT / "jobs/data/articles.jsonl").read_text().splitlines() if line]
    rows = [{**docs[i % len(docs)], "id": f"doc-{i:03d}"} for i in range(args.rows)]
    fs.pipe("demo/in/articles.jsonl", "\n".join(json.dumps(r) for r in rows).encode())

    cmd = [sys.executable, "-m", "batchgen.cli", "run", str(ROOT / "jobs/summarize.yaml"), "--quiet",
           "--set", "input.path=s3://demo/in/articles.jsonl", "--set", "output.path=s3://demo/out/",
           "--set", "output.rows_per_part=1", "--set", "batching.sort_window=4",
           "--set", "batching.max_num_seqs=4", "--set", f"sampling.max_tokens={args.max_tokens}",
           "--set", f"model.path={args.model}"]
    print("$", " ".join(cmd[2:]))
    first = subprocess.Popen(cmd, env=env, cwd=ROOT)
    while len(fs.glob("demo/out/_manifest/*")) < args.kill_after_parts and first.poll() is None:
        time.sleep(0.2)
        fs.invalidate_cache()
    first.send_signal(signal.SIGKILL)
    first.wait()
    fs.invalidate_cache()
    parts = fs.glob("demo/out/part-*")
    print(f"after kill -9: exit {first.returncode}, {len(parts)} part objects, "
          f"{len(fs.glob('demo/out/_manifest/*'))} committed, _SUCCESS: {fs.exists('demo/out/_SUCCESS')}")
    second = subprocess.run(cmd, env=env, cwd=ROOT)
    fs.invalidate_cache()
    out = []
    for part in sorted(fs.glob("demo/out/part-*")):
        with fs.open(part, "rb") as f:
            out += pq.read_table(f).to_pylist()
    ids = [r["id"] for r in out]
    stats = json.loads(fs.cat("demo/out/_SUCCESS"))
    print(f"after rerun: exit {second.returncode}; input rows {len(rows)}, output rows {len(out)}, "
          f"unique ids {len(set(ids))}, missing {len(set(r['id'] for r in rows) - set(ids))}; "
          f"_SUCCESS rows={stats['rows']} ok={stats['ok_rows']} errors={stats['error_rows']}, "
          f"rows computed in the rerun: {stats.get('this_run', {}).get('rows')}")
    server.stop()


if __name__ == "__main__":
    main()
