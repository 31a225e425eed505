"""weightcache end to end on this machine alone (run through scripts/demo.sh).

1. starts a real S3 server (moto) on 127.0.0.1, port chosen by the kernel;
2. makes a small Llama-shaped safetensors model (2 shards + index, config.json, tokenizer files) and uploads it;
3. `weightcache prefetch s3://models/demo-llama/` into a store under a temp root (the real CLI, a subprocess);
4. prefetches it again (a cache hit), `weightcache ls`, `weightcache verify`;
5. loads every tensor back from the read-only snapshot with safetensors and compares with the originals;
6. prints a short report.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
from botocore.config import Config
from moto.server import ThreadedMotoServer
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.sample
from tests.sample import make_model


def run(cmd: list[str], env: dict[str, str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "weightcache", *cmd], env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"weightcache {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout, took


def main() -> int:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="weightcache-demo-"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo",
           "AWS_DEFAULT_REGION": "us-east-1", "WEIGHTCACHE_ROOT": str(tmp / "store")}
    try:
        src = tmp / "model"
        files = make_model(src, layers=args.layers, hidden=args.hidden, shards=2)
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo", aws_secret_access_key="demo",
                          region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
        s3.create_bucket(Bucket="models")
        for f in files:
            s3.upload_file(str(f), "models", f"demo-llama/{f.relative_to(src).as_posix()}")
        size = sum(f.stat().st_size for f in files)
        print(f"S3 server   {endpoint}  (moto, 127.0.0.1)")
        print(f"model       s3://models/demo-llama/  {len(files)} files, {size / 1e6:.1f} MB")

        out, cold = run(["prefetch", "s3://models/demo-llama/", "-o", "json", "--no-daemon"], env)
        snap = json.loads(out.strip().splitlines()[-1])
        _, warm = run(["prefetch", "s3://models/demo-llama/", "-o", "json", "--no-daemon"], env)
        listing, _ = run(["ls"], env)
        verify, _ = run(["verify"], env)

        path = Path(snap["path"])
        tensors = 0
        for shard in sorted(path.glob("*.safetensors")):
            got, want = load_file(str(shard)), load_file(str(src / shard.name))
            assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got), shard
            tensors += len(got)
        modes = {oct(p.stat().st_mode & 0o777) for p in path.rglob("*")} | {oct(path.stat().st_mode & 0o777)}
        writable = f"modes {', '.join(sorted(modes))}: files 0444, directories 0555, hard links to blobs"
        print(f"prefetch    cold {cold:.2f}s ({size / cold / 1e6:.0f} MB/s incl. CLI start), cache hit {warm:.2f}s")
        print(f"snapshot    {snap['id'][:12]} at {path} ({writable})")
        print("ls:\n" + "".join("  " + line + "\n" for line in listing.splitlines()))
        print("verify:\n" + "".join("  " + line + "\n" for line in verify.splitlines()))
        print(f"loaded      {tensors} tensors back with safetensors: bit-exact with the originals")
        print("demo OK")
        return 0
    finally:
        server.stop()
        if not args.keep:
            subprocess.run(["chmod", "-R", "u+w", str(tmp)], check=False)
            subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    raise SystemExit(main())
