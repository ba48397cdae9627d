"""A vLLM logits processor that kills the process it runs in (the model's worker process
under vLLM's engine core, whose death the core dies of) when a request's prompt holds the token ids in BATCHLINE_TEST_POISON_IDS:
a record that crashes vLLM's engine core on every try, as a kernel fault on one input
would. Loaded by vLLM from `model.options.logits_processors`."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


class KillOnPoison(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.poison = [int(x) for x in os.environ.get("BATCHLINE_TEST_POISON_IDS", "").split(",") if x]

    def is_argmax_invariant(self) -> bool:
        return False  # so vLLM calls it under greedy decoding too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not self.poison or batch_update is None:
            return
        for _index, _params, prompt_ids, _output_ids in batch_update.added:
            if prompt_ids is not None and _holds(list(prompt_ids), self.poison):
                os.kill(os.getpid(), signal.SIGKILL)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
