"""Start vLLM offline on one model with one load format, generate greedily, print one JSON line.

    python tests_engines/engine_run.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]

One stdout line is WEIGHTCACHE_ENGINE_RESULT {"tokens": [...], "engine_up_s": ..., "first_token_s": ...}.
A __main__ guard because vLLM spawns its engine and worker processes, which import this file again.
"""

from __future__ import annotations

import json
import sys
import time

MAX_TOKENS = 12
RESULT = "WEIGHTCACHE_ENGINE_RESULT "  # vLLM prints its shutdown lines to stdout after ours


def main() -> None:
    from make_tiny_llama import PROMPT  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams

    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    started = time.perf_counter()
    kwargs = {"model_loader_extra_config": extra} if extra is not None else {}
    llm = LLM(model=model, load_format=load_format, dtype="float32", max_model_len=128, max_num_seqs=4,
              seed=0, enforce_eager=True, **kwargs)  # eager: no inductor warm-up (minutes on 2 cores)
    up = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first_started = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - first_started
    out = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    result = {"tokens": list(out.token_ids), "engine_up_s": round(up, 2), "first_token_s": round(first, 3)}
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
