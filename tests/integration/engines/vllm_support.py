"""What the real-vLLM tests share: the options that run the tiny Llama on vLLM's CPU build
quickly, and a schema a random model's answers end inside (enums and a short string: in a
free-text field a random model loops until max_tokens)."""

from __future__ import annotations

from typing import Any

ENDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "category": {"enum": ["Hardware", "Access", "Storage", "Purchase", "Miscellaneous"]},
        "urgent": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["category", "urgent", "tag"],
    "additionalProperties": False,
}

# float32 and eager as the CPU build wants, and a tenth of the memory for the KV cache (the
# default asks for more than the test machine has). The example's instructions are about
# 2,500 tokens of the tiny tokenizer. (The CPU build runs the model in a worker process of its
# engine core whatever distributed_executor_backend says.)
CPU_OPTIONS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.1, "max_model_len": 4096,
    "max_num_seqs": 8,
    # Without it a random model wanders through the grammar's free whitespace to max_tokens.
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}


def engine_core_pids() -> set[int]:
    """Live processes vLLM started as its engine core (they name themselves VLLM::EngineCore;
    the kernel keeps 15 characters of it). A zombie is gone: it holds no memory."""
    from pathlib import Path

    from batchline.ops.drill.run import gone

    found: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            named = "EngineCor" in (proc / "comm").read_text() or b"EngineCore" in (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if named and not gone(int(proc.name)):
            found.add(int(proc.name))
    return found


def no_engine_core_but(before: set[int]) -> None:
    """Waits until no vLLM engine core is alive but those in `before` (a killed process
    group's members take a moment to be reaped), failing the test if one stays."""
    from tests.helpers import wait_for

    wait_for(lambda: engine_core_pids() <= before, timeout=30, what="no vLLM engine core left behind")
