"""Start vLLM offline with compilation on and the `weightcache` load format, generate greedily, print one line.

    python tests_engines/compile_run.py MODEL COMPILATION_CONFIG_JSON

With VLLM_CACHE_ROOT and WEIGHTCACHE_ENGINE_CACHE set to one directory (the pod's engine-cache volume), the
plugin's engine report lands there (weightcache_vllm.telemetry). On the CPU build vLLM compiles with one Dynamo
trace and inductor, whose FX-graph cache is its compile cache (TORCHINDUCTOR_CACHE_DIR, under that directory).
The stdout line is WEIGHTCACHE_ENGINE_RESULT {"tokens": [...], "engine_up_s": ...}.
"""

from __future__ import annotations

import json
import sys
import time

RESULT = "WEIGHTCACHE_ENGINE_RESULT "


def main() -> None:
    from make_tiny_llama import PROMPT  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams

    model, compilation = sys.argv[1], json.loads(sys.argv[2])
    started = time.perf_counter()
    llm = LLM(model=model, load_format="weightcache", dtype="float32", max_model_len=128, max_num_seqs=4, seed=0,
              enforce_eager=False, compilation_config=compilation or None)
    up = time.perf_counter() - started
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    result = {"tokens": list(out[0].outputs[0].token_ids), "engine_up_s": round(up, 2)}
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
