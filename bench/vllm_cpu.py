"""Whether vLLM as installed runs the tiny test model on this machine's CPU.

The vLLM engine's requests (engine_kwargs, sampling_kwargs) for the random
2-layer Llama of the engine tests, on vLLM's CPU platform (VLLM_TARGET_DEVICE
=cpu), in one process so a failure surfaces here as one line. Prints what it
decoded, or why vLLM could not start; exits 0 either way (it is a finding, not
a test). Run by `make vllm-check` in .venv-vllm.

    .venv-vllm/bin/python bench/vllm_cpu.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchline.engines.base import EngineConfig
from batchline.engines.vllm_engine import (
    _one_line,
    engine_kwargs,
    make_sampling_params,
    sampling_kwargs,
)
from batchline.spec import DecodingSpec, ModelSpec
from tests.integration.engines.support import EXAMPLES, save_tiny_llama, triage_template


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import vllm

    schema = json.loads((EXAMPLES / "triage.schema.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_tiny_llama(path)
        config = EngineConfig(
            model=ModelSpec(engine="vllm", path=str(path), options={
                "max_model_len": 4096, "enforce_eager": True, "dtype": "float32", "max_num_seqs": 4}),
            decoding=DecodingSpec(temperature=0.0, max_tokens=200, seed=0),
            output_schema=schema,
        )
        kwargs = engine_kwargs(config, path)
        # On the CPU there is one worker, in this process.
        kwargs["distributed_executor_backend"] = "uni"
        print(f"vLLM {vllm.__version__} on the CPU platform, the tiny Llama of the engine tests:")
        try:
            engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**kwargs))
        except Exception as exc:
            print(f"vLLM cannot run here: {type(exc).__name__}: {_one_line(exc)}")
            return
        params = make_sampling_params(vllm, sampling_kwargs(config))
        prefix, suffix = triage_template()
        engine.add_request("r0", prefix + "laptop charger broken\n" + suffix, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    completion = output.outputs[0]
                    print(f"{output.request_id}: {completion.finish_reason}, "
                          f"{len(completion.token_ids)} tokens: {completion.text!r}")


if __name__ == "__main__":
    main()
