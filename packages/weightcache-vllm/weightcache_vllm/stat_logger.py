"""vLLM stat logger plugin `weightcache` (entry point group `vllm.stat_logger_plugins`): the engine's readiness
and its first generated token, into the pod's engine report (weightcache_vllm.telemetry, docs/telemetry.md).

vLLM loads it in the front-end process of `vllm serve` (vllm/v1/engine/async_llm.py), beside its own loggers; it
imports vLLM, so only that entry point imports this module.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from weightcache.vocabulary import STAGE_ENGINE_READY, STAGE_FIRST_TOKEN
from weightcache_vllm.telemetry import stage


class WeightcacheStages(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self._first_token = False

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if not self._first_token and iteration_stats is not None and \
                getattr(iteration_stats, "num_generation_tokens", 0) > 0:
            self._first_token = True
            stage(STAGE_FIRST_TOKEN)

    def log_engine_initialized(self) -> None:
        stage(STAGE_ENGINE_READY)
