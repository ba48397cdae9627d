"""The embedded default engine: llama.cpp (llama-cpp-python) with a GGUF model on the CPU.

Records run one after another through a single llama.cpp context. The context
keeps the key/value cache of the previous prompt, and each new prompt is
evaluated only from the first token where it differs, so the shared
instruction prefix is computed once per engine instead of once per record.

Decoding is our own loop over llama.cpp's logits rather than llama-cpp-python's
sampler chain: its custom-sampler hook (the route for an external token mask)
did not apply masked logits in our tests, and its GBNF grammar sampler is four
times slower on Gemma's 262k vocabulary. The loop asks llguidance for the mask
only when the model's own choice breaks the schema, and feeds tokens the schema
forces (keys, quotes, separators) in one batch, as cheap as prompt tokens.

Model options (``model.options``), all part of the job version:
  n_ctx (4096), n_threads, n_threads_batch, n_batch (512), constrained (true),
  stop (strings that end an unconstrained output; default a blank line),
  batch_items (records taken from the supervisor at a time, 8).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from batchline.digests import verify_weights
from batchline.engines.base import EngineConfig, EngineOutcome, EngineRequest, RequestSource
from batchline.engines.grammar import GrammarSession, json_schema_grammar, pick_token, record_rng
from batchline.engines.models import GEMMA_PACKAGE, resolve_model_path
from batchline.errors import EngineFatal

# Measured on the 2-core machine (bench/prefix_cache.py, Gemma 3 270M Q4_K_M):
# 2 threads decode ~1.6x faster than 1 and prefill ~1.9x; more threads than
# cores slows llama.cpp down sharply, so the default is the core count, capped.
_MAX_DEFAULT_THREADS = 8


def default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_DEFAULT_THREADS))


class LlamaCppEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = dict(config.model.options)
        self.n_ctx = int(opts.get("n_ctx", 4096))
        self.n_threads = int(opts.get("n_threads", default_threads()))
        self.n_threads_batch = int(opts.get("n_threads_batch", self.n_threads))
        self.n_batch = int(opts.get("n_batch", 512))
        self.constrained = bool(opts.get("constrained", True))
        self.stop: list[str] = [str(s) for s in opts.get("stop", ["\n\n"])]
        self.batch_items = int(opts.get("batch_items", 8))
        self._llm: Any = None
        self._lltokenizer: Any = None
        self._grammar: str | None = None
        self._eog: set[int] = set()
        # Tokens whose keys and values are in the context now, in order.
        self._cached: list[int] = []
        # Counters for benchmarks: prompt tokens evaluated versus reused from the cache.
        self.stats = {"prompt_tokens": 0, "prompt_tokens_evaluated": 0, "output_tokens": 0,
                      "forced_tokens": 0, "masked_steps": 0}

    # --- Engine protocol ---------------------------------------------------

    def load(self) -> None:
        path = resolve_model_path(self.config.model.path, GEMMA_PACKAGE)
        verify_weights(path, self.config.model.digest)
        try:
            import llama_cpp
        except ImportError:
            raise EngineFatal(
                "the llamacpp engine needs llama-cpp-python (install batchline's 'llamacpp' extra)"
            ) from None
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads_batch,
                seed=self.config.decoding.seed,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise EngineFatal(f"llama.cpp cannot load {path}: {exc}") from None
        vocab = llama_cpp.llama_model_get_vocab(self._llm._model.model)
        self._eog = {
            t for t in range(self._llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)
        }
        if self.constrained:
            self._grammar = json_schema_grammar(self.config.output_schema)
            import llguidance.llamacpp

            self._lltokenizer = llguidance.llamacpp.lltokenizer_from_vocab(
                vocab, n_vocab=self._llm.n_vocab(), eos_token=sorted(self._eog)
            )

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        while True:
            batch = requests.next_batch(self.batch_items)
            if not batch:
                return
            for request in batch:
                yield self.run_one(request)

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    # --- one record ----------------------------------------------------------

    def run_one(self, request: EngineRequest) -> EngineOutcome:
        try:
            return self._run(request)
        except EngineFatal:
            raise
        except Exception as exc:  # per-record: the context is rebuilt for the next record
            self._forget_cache()
            return EngineOutcome(
                record_id=request.record_id,
                error=f"{type(exc).__name__}: {exc}",
                error_kind="engine_error",
            )

    def _run(self, request: EngineRequest) -> EngineOutcome:
        decoding = self.config.decoding
        prompt = self._tokenize(request.prompt)
        budget = min(decoding.max_tokens, self.n_ctx - len(prompt))
        if budget <= 0:
            return EngineOutcome(
                record_id=request.record_id,
                error=f"prompt has {len(prompt)} tokens, the context holds {self.n_ctx}",
                error_kind="engine_error",
                input_tokens=len(prompt),
            )
        self._eval_prompt(prompt)
        session = (
            GrammarSession(self._lltokenizer, self._grammar, self._llm.n_vocab())
            if self._grammar is not None
            else None
        )
        rng = record_rng(decoding.seed, request.record_id)
        out: list[int] = []
        n_vocab = self._llm.n_vocab()
        finished = False
        while len(out) < budget:
            logits = np.ctypeslib.as_array(self._llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            token, masked = pick_token(logits, session, decoding.temperature, decoding.top_p, rng)
            self.stats["masked_steps"] += masked
            if token in self._eog:
                # Under a grammar an end token is only allowed once the JSON is complete.
                finished = True
                break
            step = [token]
            if session is not None:
                session.consume(step)
                if session.done():
                    out += step
                    finished = True
                    break
                forced = session.forced()[: budget - len(out) - 1]
                if forced:
                    session.consume(forced)
                    step += forced
                    self.stats["forced_tokens"] += len(forced)
            out += step
            if session is None and self._hit_stop(out):
                finished = True
                break
            if session is not None and session.done():
                finished = True
                break
            self._eval(step)
        self.stats["output_tokens"] += len(out)
        text = self._llm.detokenize(out).decode("utf-8", errors="replace")
        if session is None:
            text = _cut_at_stop(text, self.stop)
        if not finished or (session is not None and not session.complete()):
            return EngineOutcome(
                record_id=request.record_id,
                error=f"output reached max_tokens={decoding.max_tokens} before it was complete: "
                      f"{text[:80]!r}...",
                error_kind="engine_error",
                input_tokens=len(prompt),
                output_tokens=len(out),
            )
        return EngineOutcome(
            record_id=request.record_id,
            output=text.strip(),
            input_tokens=len(prompt),
            output_tokens=len(out),
        )

    # --- the context and its cache ---------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        return tokens

    def _eval_prompt(self, prompt: list[int]) -> None:
        # Reuse the longest cached prefix, but evaluate at least the prompt's last
        # token: its logits are where decoding starts.
        common = 0
        limit = min(len(self._cached), len(prompt) - 1)
        while common < limit and self._cached[common] == prompt[common]:
            common += 1
        if not self._llm._ctx.kv_cache_seq_rm(-1, common, -1):
            # A cache that cannot drop a suffix (some sliding-window layouts) is cleared whole.
            self._llm._ctx.kv_cache_clear()
            common = 0
        self._cached = prompt[:common]
        self._llm.n_tokens = common
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["prompt_tokens_evaluated"] += len(prompt) - common
        self._eval(prompt[common:])

    def _eval(self, tokens: Sequence[int]) -> None:
        self._llm.eval(tokens)
        self._cached += tokens

    def _forget_cache(self) -> None:
        self._cached = []
        if self._llm is not None:
            self._llm.n_tokens = 0
            self._llm._ctx.kv_cache_clear()

    def _hit_stop(self, out: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self._llm.detokenize(out[-8:]).decode("utf-8", errors="replace")
        return any(s in tail for s in self.stop)


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]
