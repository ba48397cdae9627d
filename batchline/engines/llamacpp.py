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

Model options (``model.options``), all part of the job version: `OPTIONS`
below. Its stop option ends unconstrained outputs only; the job's
decoding.stop ends constrained and unconstrained outputs alike. A chat_template
is for a GGUF file that has none, as base models' files often do.

Calibrated choices: a small base model carries strong priors over the values
of an enum (Gemma 3 270M answers "Storage" for nearly every ticket, whatever
the prompt), which leaves its classifications below the majority class. With
calibrate_choices, each prefix is first run with content-free records (the
record text replaced by "", "n/a", "[empty]"); at every step of those runs where
the schema leaves only a few tokens open (an enum, a boolean) the engine keeps
the model's log-probabilities, and a real record whose output reaches the same
step chooses by the difference to them (contextual calibration, Zhao et al.
2021), scaled by calibration_strength. On the ticket sample this lifts
accuracy from ~11% to ~34% (the majority class is 28%).

The decoding knobs (decoding.repetition_penalty, frequency_penalty,
presence_penalty) are applied to the logits in the loop before each choice
(batchline.engines.decoding), so they hold under the schema's mask too.

Conversations (openai-batch input) are rendered with the chat_template option,
else the GGUF's own (``tokenizer.chat_template``), generation prompt included;
without either, in the plain role-tagged form. Their choices are calibrated
against the conversation's system messages followed by a content-free user
turn: once per distinct system prompt, and the same for every record that
shares it, whatever order records arrive in.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchline.engines.base import (
    EngineConfig,
    EngineOutcome,
    EngineRequest,
    RequestSource,
    loaded,
    one_at_a_time,
    plain_chat_prompt,
)
from batchline.engines.decoding import TokenPenalties, cut_at_stop, stop_window
from batchline.engines.grammar import GrammarSession, json_schema_grammar, pick_token, record_rng
from batchline.engines.models import GEMMA_PACKAGE, resolve_model_path
from batchline.errors import EngineFatal
from batchline.registry import EngineOption, EngineOptions
from batchline.spec import ModelSpec

# Measured on the 2-core machine (bench/prefix_cache.py, Gemma 3 270M Q4_K_M):
# 2 threads decode ~1.6x faster than 1 and prefill ~1.9x; more threads than
# cores slows llama.cpp down sharply, so the default is the core count, capped.
_MAX_DEFAULT_THREADS = 8

# Content-free stand-ins for a record's text, for calibrated choices.
CONTENT_FREE = ("", "n/a", "[empty]")
# A step where the schema leaves at most this many tokens open is a choice.
CHOICE_LIMIT = 512
PRIOR_FLOOR = -8.0
# Full calibration (1.0) makes every label equally likely on content-free input,
# which also removes the real imbalance of the classes; on the ticket sample 0.8
# classified best (bench/triage_quality.py).
DEFAULT_STRENGTH = 0.8


OPTIONS = EngineOptions(
    EngineOption("n_ctx", "integer", "The context's size in tokens", 4096),
    EngineOption("n_threads", "integer", "Threads that decode", default_text=f"the machine's cores, at most {_MAX_DEFAULT_THREADS}"),
    EngineOption("n_threads_batch", "integer", "Threads that evaluate prompts", default_text="n_threads"),
    EngineOption("n_batch", "integer", "Prompt tokens evaluated per call", 512),
    EngineOption("constrained", "boolean", "Hold every output to the job's schema (llguidance)", True),
    EngineOption("stop", "strings", "Strings that end an unconstrained output", ["\n\n"]),
    EngineOption("calibrate_choices", "boolean", "Subtract the model's lean on content-free records when it "
                 "chooses an enum value", True),
    EngineOption("calibration_strength", "number", "How much of that lean is subtracted", DEFAULT_STRENGTH),
    EngineOption("chat_template", "string", "A Jinja chat template used instead of the GGUF's own"),
)


def default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_DEFAULT_THREADS))


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """What a worker computed on: the CPU, since this engine offloads no layer to a GPU."""
    return "the CPU"


class LlamaCppEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = dict(config.model.options)
        self.n_ctx = int(OPTIONS.of(opts, "n_ctx"))
        self.n_threads = int(opts.get("n_threads", default_threads()))
        self.n_threads_batch = int(opts.get("n_threads_batch", self.n_threads))
        self.n_batch = int(OPTIONS.of(opts, "n_batch"))
        self.constrained = bool(OPTIONS.of(opts, "constrained"))
        self.stop: list[str] = [str(s) for s in OPTIONS.of(opts, "stop")]
        self.calibrate = bool(OPTIONS.of(opts, "calibrate_choices")) and self.constrained
        self.calibration_strength = float(OPTIONS.of(opts, "calibration_strength"))
        self.chat_template: str | None = OPTIONS.of(opts, "chat_template")
        self._llm: Any = None
        self._lltokenizer: Any = None
        self._grammar: str | None = None
        self._eog: set[int] = set()
        self._chat_formatter: Any = None  # the option's chat template, else the GGUF's, if any
        # Per prefix: output-token path -> content-free log-probabilities of the choices there.
        self._calibration: dict[str, dict[tuple[int, ...], dict[int, float]]] = {}
        # Tokens whose keys and values are in the context now, in order.
        self._cached: list[int] = []
        # Counters for benchmarks: prompt tokens evaluated versus reused from the cache.
        self.stats: dict[str, float] = {
            "prompt_tokens": 0, "prompt_tokens_evaluated": 0, "prompt_seconds": 0.0,
            "output_tokens": 0, "forced_tokens": 0, "masked_steps": 0, "decode_steps": 0,
            "decode_seconds": 0.0,
        }

    # --- Engine protocol ---------------------------------------------------

    @staticmethod
    def local_weights(model: ModelSpec) -> Path:
        """The weights it loads, on this machine (the planner checks their digest where it can)."""
        return resolve_model_path(model.path, GEMMA_PACKAGE)

    def load(self) -> None:
        path = self.local_weights(self.config.model)
        [llama_cpp] = loaded(path, self.config.model.digest, "llama_cpp",
                             missing="the llamacpp engine needs llama-cpp-python (install batchline's 'llamacpp' extra)")
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
        self._chat_formatter = self._load_chat_template()
        vocab = llama_cpp.llama_model_get_vocab(self._llm._model.model)
        self._eog = {
            t for t in range(self._llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)
        }
        if self.constrained:
            self._grammar = json_schema_grammar(self.config.output_schema)
            import llguidance.llamacpp

            with warnings.catch_warnings():
                # It reads each token's attributes through a binding llama-cpp-python
                # deprecates: one warning per token, 262k of them for Gemma.
                warnings.simplefilter("ignore", DeprecationWarning)
                self._lltokenizer = llguidance.llamacpp.lltokenizer_from_vocab(
                    vocab, n_vocab=self._llm.n_vocab(), eos_token=sorted(self._eog)
                )

    def _load_chat_template(self) -> Any:
        template = self.chat_template or self._llm.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        # The special tokens' texts, as llama-cpp-python's own chat handlers pass them.
        eos, bos = self._llm.token_eos(), self._llm.token_bos()
        return Jinja2ChatFormatter(
            template=template,
            eos_token=self._llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=self._llm._model.token_get_text(bos) if bos != -1 else "",
            add_generation_prompt=True,
        )

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        if self._chat_formatter is None:
            return plain_chat_prompt(messages)
        prompt: str = self._chat_formatter(messages=[dict(m) for m in messages]).prompt
        return prompt

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        for request in one_at_a_time(requests):
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
        prompt = self._tokenize(request.prompt, templated=self._templated(request))
        budget = min(decoding.max_tokens, self.n_ctx - len(prompt))
        if budget <= 0:
            return EngineOutcome(
                record_id=request.record_id,
                error=f"prompt has {len(prompt)} tokens, the context holds {self.n_ctx}",
                error_kind="engine_error",
                input_tokens=len(prompt),
            )
        calibration = self._calibration_for(request) if self.calibrate else {}
        started = time.perf_counter()
        self._eval_prompt(prompt)
        prompt_done = time.perf_counter()
        self.stats["prompt_seconds"] += prompt_done - started
        session = (
            GrammarSession(self._lltokenizer, self._grammar, self._llm.n_vocab())
            if self._grammar is not None
            else None
        )
        rng = record_rng(decoding.seed, request.record_id)
        penalties = TokenPenalties(decoding, prompt)
        stops = self._stops(session is not None)
        out: list[int] = []
        n_vocab = self._llm.n_vocab()
        finished = stopped = False
        while len(out) < budget:
            logits = penalties.apply(
                np.ctypeslib.as_array(self._llm._ctx.get_logits_ith(-1), shape=(n_vocab,)))
            prior = calibration.get(tuple(out))
            if prior is not None and session is not None:
                token = _calibrated_choice(logits, session, prior, self.calibration_strength)
                masked = True
            else:
                token, masked = pick_token(
                    logits, session, decoding.temperature, decoding.top_p, rng
                )
            self.stats["masked_steps"] += masked
            self.stats["decode_steps"] += 1
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
            penalties.add(step)
            if self._hit_stop(out, stops):
                finished = stopped = True
                break
            if session is not None and session.done():
                finished = True
                break
            self._eval(step)
        self.stats["output_tokens"] += len(out)
        self.stats["decode_seconds"] += time.perf_counter() - prompt_done
        text, cut = cut_at_stop(self._llm.detokenize(out).decode("utf-8", errors="replace"), stops)
        stopped = stopped or cut
        finish = "stop" if finished else "length"
        constrained = session is not None
        # Under the schema, a cut output is no longer the complete JSON the grammar held.
        if not finished or (session is not None and (stopped or not session.complete())):
            why = (f"a stop sequence ({', '.join(map(repr, stops))}) ended the output" if stopped
                   else f"output reached max_tokens={decoding.max_tokens}")
            return EngineOutcome(
                record_id=request.record_id,
                error=f"{why} before it was complete: {text[:80]!r}...",
                error_kind="engine_error",
                input_tokens=len(prompt),
                output_tokens=len(out),
                finish_reason=finish,
                constrained=constrained,
            )
        return EngineOutcome(
            record_id=request.record_id,
            output=text.strip(),
            input_tokens=len(prompt),
            output_tokens=len(out),
            finish_reason=finish,
            constrained=constrained,
        )

    def _stops(self, constrained: bool) -> list[str]:
        """The job's stop sequences, and for an unconstrained output the option's too."""
        return [*([] if constrained else self.stop), *self.config.decoding.stop]

    # --- calibration of choices -----------------------------------------------

    def _calibration_for(self, request: EngineRequest) -> dict[tuple[int, ...], dict[int, float]]:
        if request.messages is not None:
            return self._chat_calibration(request.messages)
        known = self._calibration.get(request.prefix)
        if known is not None:
            return known
        head, sep, tail = request.prompt[len(request.prefix):].partition(request.text)
        table: dict[tuple[int, ...], dict[int, float]] = {}
        if request.prompt.startswith(request.prefix) and sep and request.text:
            table = _common_choices([self._choice_log_probs(request.prefix + head + filler + tail)
                                     for filler in CONTENT_FREE])
            self._calibration[request.prefix] = table
        # Otherwise this record's text cannot be located in its prompt (say, it was
        # neutralised); it goes uncalibrated and the next record tries again.
        return table

    def _chat_calibration(self, messages: Sequence[Mapping[str, Any]]) -> dict[tuple[int, ...], dict[int, float]]:
        system = [dict(m) for m in messages if m.get("role") == "system"]
        # Keyed apart from every text prefix: a NUL never starts a prompt file.
        key = "\0chat\0" + json.dumps(system, sort_keys=True)
        known = self._calibration.get(key)
        if known is None:
            try:
                prompts = [self.chat_prompt([*system, {"role": "user", "content": filler}])
                           for filler in CONTENT_FREE]
            except Exception:
                # A template that refuses the bare form leaves every record of this system
                # prompt uncalibrated alike, rather than failing records it renders fine.
                prompts = []
            templated = self._chat_formatter is not None
            known = _common_choices([self._choice_log_probs(p, templated=templated) for p in prompts])
            self._calibration[key] = known
        return known

    def _choice_log_probs(self, text: str, templated: bool = False) -> dict[tuple[int, ...], dict[int, float]]:
        """Log-probabilities at each choice step of a greedy constrained run on `text`."""
        assert self._grammar is not None
        prompt = self._tokenize(text, templated=templated)
        self._eval_prompt(prompt)
        session = GrammarSession(self._lltokenizer, self._grammar, self._llm.n_vocab())
        n_vocab = self._llm.n_vocab()
        out: list[int] = []
        found: dict[tuple[int, ...], dict[int, float]] = {}
        while len(out) < min(self.config.decoding.max_tokens, self.n_ctx - len(prompt)):
            logits = np.ctypeslib.as_array(self._llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            allowed = np.flatnonzero(session.allowed())
            if len(allowed) > CHOICE_LIMIT:
                # Free text begins: calibrating there would bend the wording, not a choice.
                break
            chosen = logits[allowed].astype(np.float64)
            log_probs = chosen - chosen.max()
            log_probs -= np.log(np.exp(log_probs).sum())
            if len(allowed) > 1:
                found[tuple(out)] = dict(zip(allowed.tolist(), log_probs.tolist(), strict=True))
            step = [int(allowed[int(np.argmax(chosen))])]
            if step[0] in self._eog:
                break
            session.consume(step)
            if session.done():
                break
            forced = session.forced()
            session.consume(forced)
            step += forced
            out += step
            self._eval(step)
        return found

    # --- the context and its cache ---------------------------------------------

    def _templated(self, request: EngineRequest) -> bool:
        return request.messages is not None and self._chat_formatter is not None

    def _tokenize(self, text: str, templated: bool = False) -> list[int]:
        if self._llm is None:
            raise EngineFatal("engine used before load()")
        # A chat template writes its own BOS and turn markers, which must become the
        # special tokens they name, as llama-cpp-python's chat handlers tokenize them.
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=not templated, special=templated)
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

    def _hit_stop(self, out: list[int], stops: list[str]) -> bool:
        if not stops:
            return False
        tail = self._llm.detokenize(out[-stop_window(stops):]).decode("utf-8", errors="replace")
        return any(s in tail for s in stops)


def _common_choices(runs: list[dict[tuple[int, ...], dict[int, float]]]) -> dict[tuple[int, ...], dict[int, float]]:
    """The mean log-probabilities at the choice steps all content-free runs reached."""
    table: dict[tuple[int, ...], dict[int, float]] = {}
    if not runs:
        return table
    for path in set(runs[0]).intersection(*runs[1:]):
        tokens = set(runs[0][path]).intersection(*(r[path] for r in runs[1:]))
        table[path] = {t: sum(r[path][t] for r in runs) / len(runs) for t in tokens}
    return table


def _calibrated_choice(
    logits: np.ndarray[Any, Any], session: GrammarSession, prior: dict[int, float], strength: float
) -> int:
    allowed = np.flatnonzero(session.allowed())
    chosen = logits[allowed].astype(np.float64)
    log_probs = chosen - chosen.max()
    log_probs -= np.log(np.exp(log_probs).sum())
    # Tokens the content-free runs found unlikely keep a floor, so a rare partial
    # token (say "H" of "Hardware") cannot win by being slightly less rare.
    base = np.array([max(prior.get(int(t), PRIOR_FLOOR), PRIOR_FLOOR) for t in allowed])
    return int(allowed[int(np.argmax(log_probs - strength * base))])

