"""Hugging Face transformers: batched generation on the CPU or a CUDA GPU.

Records are decoded step by step with our own loop over the model (not
``model.generate``), for four reasons: a record's outcome is yielded the moment
its row finishes; finished rows can be replaced by new records while the
others decode; the schema's token mask (llguidance) is computed only for the
rows whose greedy choice breaks the schema, not for every row at every step;
and a batch that fails is retried in halves, so a poison record fails alone and
its batch-mates are not charged for it.

The shared instruction prefix is computed once. Its keys and values are kept
per prefix, and each record runs only its own tokens on top of a copy of them.
A record whose tokenization merges across the prefix's end reuses the prefix's
tokens up to the first one that differs, so every record sees exactly the
tokens of its whole prompt, at the same positions, as without the cache.

Continuous refill (greedy decoding): once an eighth of the batch is free the
engine takes more records from the source, runs their prompts, and rebuilds
the batch's keys and values without the finished rows and with the new ones,
so the batch stays full while output lengths differ; a finished row costs at
most one more step, fed padding, before it goes. The cache grows in place
(transformers' own concatenates it at every step). transformers 5's own
continuous batching (``generate_batch`` and its manager, paged attention) was
not used: its logits processors take one scalar per token (a temperature, a
top-p), with no place for a record's grammar state. A greedy choice depends only on the record's own tokens, so refill and
prefix reuse give the tokens of static batches, up to the floating-point
rounding that batch size and padding already vary (no engine revision change).
Sampled decoding (temperature > 0) keeps static batches: its draws come from
one generator per batch, seeded with decoding.seed, as they always have.

Constrained decoding works the same way on both paths, and costs host time
per step: one llguidance check of each row's greedy choice, and for the rows
whose choice the schema refuses, a mask over the vocabulary, copied to the
device, and a second argmax of those rows. Each step also waits for the chosen
tokens on the host (end of sequence and the grammar are checked there), so the
device idles while the host works. ``counts.grammar_seconds`` and
``counts.masked_rows`` say how much of that a run spent.

vLLM (paged attention, prefix caching without copies) is the engine for
throughput on GPUs; this one is the portable one.

Model options (``model.options``), all part of the job version: `OPTIONS`
below.

The decoding knobs: the penalties (decoding.repetition_penalty as
transformers' RepetitionPenaltyLogitsProcessor computes it, frequency_penalty
and presence_penalty as vLLM and the OpenAI API do; batchline.engines.decoding)
are applied to each row's logits before its choice, under the schema's mask
too; decoding.stop ends a row once its output holds a stop sequence, the text
cut before it.

Conversations (openai-batch input) are rendered with the chat template
(``apply_chat_template``, generation prompt added), or in the plain
role-tagged form when there is none.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchline.engines.base import (
    EngineConfig,
    EngineOutcome,
    EngineRequest,
    RequestSource,
    batches,
    hf_chat_prompt,
    hf_templated,
    loaded,
    torch_device_computes_on,
)
from batchline.engines.decoding import TokenPenalties, cut_at_stop, stop_window
from batchline.engines.grammar import GrammarSession, import_llguidance, json_schema_grammar
from batchline.engines.models import resolve_model_path
from batchline.errors import EngineFatal
from batchline.registry import EngineOption, EngineOptions
from batchline.spec import ModelSpec

OPTIONS = EngineOptions(
    EngineOption("device", "string", "A torch device, or auto: cuda when a GPU is visible, else cpu", "auto"),
    EngineOption("dtype", "string", "A torch dtype, or auto: bfloat16 on cuda, float32 on cpu", "auto"),
    EngineOption("batch_size", "integer", "Records decoded together", default_text="8 on cpu, 64 on cuda"),
    EngineOption("constrained", "boolean", "Hold every output to the job's schema (llguidance)", True),
    EngineOption("ignore_eos", "boolean", "Decode past the end of sequence to max_tokens (benchmarks)", False),
    EngineOption("attn_implementation", "string", "Passed to from_pretrained (e.g. sdpa)"),
    EngineOption("chat_template", "string", "A Jinja chat template used instead of the tokenizer's own"),
    EngineOption("prefix_cache", "boolean", "Compute the shared prefix once and reuse its keys and values", True),
    EngineOption("refill", "boolean", "Replace finished rows with new records while greedy decoding goes on "
                 "(false: static batches)", True),
)

# A running batch takes new records once this share of its rows is free: each
# admission runs a prefill and copies the batch's keys and values once, so it
# waits for a group rather than paying that for every single free row.
REFILL_FRACTION = 8
# Columns a cache layer grows by at least when it runs out of room.
GROW_COLUMNS = 64
# Prefixes whose keys and values are kept; a job has one, a worker a few at most.
KEPT_PREFIXES = 4


def _import_torch(weights: Path | None = None, digest: str | None = None) -> tuple[Any, Any]:
    """torch and transformers, after the weights (where given) are checked."""
    torch, transformers = loaded(weights, digest, "torch", "transformers", missing=(
        "the transformers engine needs torch and transformers (install batchline's 'transformers' extra)"))
    return torch, transformers


@dataclass
class DecodeCounts:
    """What the engine's forwards were spent on, summed over its life."""

    decode_steps: int = 0  # decode forwards
    decode_rows: int = 0  # rows in those forwards, summed: the decode slots used
    idle_rows: int = 0  # of those, rows whose record had already finished
    prefill_tokens: int = 0  # prompt tokens run through the model (each prefix once, then records)
    reused_tokens: int = 0  # prompt tokens read from a prefix's keys and values instead
    prefill_padding: int = 0  # padding positions run in prefill forwards
    admissions: int = 0  # groups of records merged into a running batch
    masked_rows: int = 0  # row-steps where the schema refused the greedy choice
    grammar_seconds: float = 0.0  # host time in llguidance


@dataclass
class _Row:
    request: EngineRequest
    prompt: list[int]
    session: GrammarSession | None
    budget: int  # tokens this record may generate
    penalties: TokenPenalties
    out: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once the record is done
    stopped: bool = False  # a stop sequence (decoding.stop) ended it


@dataclass
class _Prefix:
    ids: list[int]
    layers: list[tuple[Any, Any]]  # per layer (keys, values), batch of one


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """What a worker computed on: the torch device the options name."""
    return torch_device_computes_on(str(OPTIONS.of(options, "device")))


class TransformersEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = dict(config.model.options)
        self.device_option = str(OPTIONS.of(opts, "device"))
        self.dtype_option = str(OPTIONS.of(opts, "dtype"))
        self.batch_size_option = OPTIONS.of(opts, "batch_size")
        self.constrained = bool(OPTIONS.of(opts, "constrained"))
        self.ignore_eos = bool(OPTIONS.of(opts, "ignore_eos"))
        self.attn_implementation = OPTIONS.of(opts, "attn_implementation")
        self.chat_template: str | None = OPTIONS.of(opts, "chat_template")
        self.prefix_cache = bool(OPTIONS.of(opts, "prefix_cache"))
        self.refill = bool(OPTIONS.of(opts, "refill"))
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.batch_size = 1
        self.counts = DecodeCounts()
        self._torch: Any = None
        self._grammar: str | None = None
        self._lltokenizer: Any = None
        self._eos: set[int] = set()
        self._vocab = 0
        self._max_positions: int | None = None
        self._cache_arg = "past_key_values"
        self._prefixes: dict[tuple[str, bool], _Prefix] = {}

    # --- loading -------------------------------------------------------------

    @staticmethod
    def local_weights(model: ModelSpec) -> Path:
        """The weights it loads, on this machine (the planner checks their digest where it can)."""
        return resolve_model_path(model.path, None)

    def load(self) -> None:
        path = self.local_weights(self.config.model)
        torch, transformers = _import_torch(path, self.config.model.digest)
        device = self._pick_device(torch)
        dtype = self._pick_dtype(torch, device)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if self.attn_implementation:
            kwargs["attn_implementation"] = str(self.attn_implementation)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        except (OSError, ValueError) as exc:
            raise EngineFatal(f"transformers cannot load {path}: {_one_line(exc)}") from None
        self.attach(model.to(device), tokenizer)

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Uses a model already in memory (benchmarks build random weights on the GPU).

        `load` is the only route that verifies pinned weights; a caller of
        `attach` owns the identity of what it passes.
        """
        torch, _ = _import_torch()
        self._torch = torch
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._eos = _eos_ids(model, tokenizer)
        self._max_positions = getattr(model.config, "max_position_embeddings", None)
        # transformers 5.24 renamed the argument (the old name goes in 5.40).
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._prefixes.clear()
        default_batch = 64 if self.device.type == "cuda" else 8
        self.batch_size = int(self.batch_size_option or default_batch)
        if self.constrained:
            self._grammar = json_schema_grammar(self.config.output_schema)
            import_llguidance()
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self._vocab, eos_token=sorted(self._eos)
            )

    def _pick_device(self, torch: Any) -> Any:
        if self.device_option == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device_option)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise EngineFatal(f"model.options.device is {self.device_option!r} but no CUDA GPU is visible")
        return device

    def _pick_dtype(self, torch: Any, device: Any) -> Any:
        if self.dtype_option == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = getattr(torch, self.dtype_option, None)
        if not isinstance(dtype, torch.dtype):
            raise EngineFatal(f"model.options.dtype {self.dtype_option!r} is not a torch dtype")
        return dtype

    # --- Engine protocol -----------------------------------------------------

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            raise EngineFatal("engine used before load()")
        return len(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self.tokenizer is None:
            raise EngineFatal("engine used before load()")
        return hf_chat_prompt(self.tokenizer, messages, self.chat_template)

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self.model is None:
            raise EngineFatal("engine used before load()")
        if self.refill and self.config.decoding.temperature <= 0:
            yield from self._continuous(requests)
            return
        for batch in batches(requests, self.batch_size):
            yield from self.run_batch(batch)

    def close(self) -> None:
        self.model = None
        self._prefixes.clear()
        if self._torch is not None and self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()

    # --- batches -------------------------------------------------------------

    def _continuous(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        """One running batch, refilled from the source as its rows finish. A failure
        retries what was in flight in halves; the source's remaining records then go on
        in a new running batch."""
        while True:
            running = _Running(self, compact_at=max(1, self.batch_size // REFILL_FRACTION))
            if (yield from self._guarded(running, running.refill(requests))):
                return

    def run_batch(self, batch: list[EngineRequest]) -> Iterator[EngineOutcome]:
        """Decodes a static batch; on failure retries it in halves so one bad record fails alone."""
        running = _Running(self, compact_at=None)
        yield from self._guarded(running, running.drain(batch))

    def _guarded(self, running: _Running, work: Iterator[EngineOutcome]) -> Generator[EngineOutcome, None, bool]:
        """Yields what `work` yields; if it fails, answers what the running batch had not
        answered by halves. Returns whether the work ended without failing."""
        try:
            yield from work
        except EngineFatal:
            raise
        except Exception as exc:
            self._check_fatal(exc)
            yield from self._split(running.unanswered(), exc)
            return False
        return True

    def _check_fatal(self, exc: Exception) -> None:
        message = str(exc)
        if "CUDA error" in message or "device-side assert" in message:
            # The CUDA context is unusable after such an error; only a new process helps.
            raise EngineFatal(f"CUDA error: {_one_line(exc)}") from None
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()

    def _split(self, rest: list[EngineRequest], exc: Exception) -> Iterator[EngineOutcome]:
        if not rest:
            return
        if len(rest) == 1:
            yield EngineOutcome(
                record_id=rest[0].record_id,
                error=f"{type(exc).__name__}: {_one_line(exc)}",
                error_kind="engine_error",
                constrained=self._grammar is not None,
            )
            return
        half = (len(rest) + 1) // 2
        yield from self.run_batch(rest[:half])
        yield from self.run_batch(rest[half:])

    def _prompt_ids(self, request: EngineRequest) -> tuple[list[int], bool]:
        templated = hf_templated(self.tokenizer, request, self.chat_template)
        ids: list[int] = self.tokenizer(request.prompt, add_special_tokens=not templated)["input_ids"]
        return ids, templated

    def _prefix(self, request: EngineRequest, templated: bool) -> _Prefix | None:
        """The shared prefix's keys and values, computed on first use."""
        if not self.prefix_cache or not request.prefix:
            return None
        key = (request.prefix, templated)
        prefix = self._prefixes.get(key)
        if prefix is None:
            torch = self._torch
            ids = self.tokenizer(request.prefix, add_special_tokens=not templated)["input_ids"]
            if not ids:
                return None
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                result = self.forward(input_ids, torch.ones_like(input_ids),
                                      torch.arange(len(ids), device=self.device)[None, :], _cache_of([]))
            self.counts.prefill_tokens += len(ids)
            prefix = _Prefix(list(ids), _cache_layers(_returned_cache(result)))
            if len(self._prefixes) >= KEPT_PREFIXES:
                del self._prefixes[next(iter(self._prefixes))]
            self._prefixes[key] = prefix
        return prefix

    def forward(self, input_ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        """One call of the model; the cache grows in place, logits only for the last column."""
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                          use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})

    def _choose(self, logits: Any, sessions: list[GrammarSession | None], active: list[bool],
                generator: Any) -> list[int]:
        """Next token per row: the model's choice, masked only for rows where the schema refuses it."""
        torch = self._torch
        temperature = self.config.decoding.temperature
        if temperature <= 0:
            picked = logits.argmax(-1).tolist()
        else:
            probs = self._probs(logits, temperature)
            picked = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        started = time.perf_counter()
        refused = [
            j for j, (token, session) in enumerate(zip(picked, sessions, strict=True))
            if active[j] and session is not None and not session.accepts(int(token))
        ]
        if refused:
            masks = np.stack([s.allowed() for s in (sessions[j] for j in refused) if s is not None])
            self.counts.masked_rows += len(refused)
            self.counts.grammar_seconds += time.perf_counter() - started
            allowed = torch.from_numpy(masks).to(self.device)
            sub = logits[refused].masked_fill(~allowed, float("-inf"))
            if temperature <= 0:
                again = sub.argmax(-1).tolist()
            else:
                again = torch.multinomial(self._probs(sub, temperature), 1, generator=generator)[:, 0].tolist()
            for j, token in zip(refused, again, strict=True):
                picked[j] = token
        else:
            self.counts.grammar_seconds += time.perf_counter() - started
        return [int(t) for t in picked]

    def _probs(self, logits: Any, temperature: float) -> Any:
        torch = self._torch
        probs = torch.softmax(logits / temperature, dim=-1)
        top_p = self.config.decoding.top_p
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def _penalised(self, logits: Any, rows: list[_Row], live: list[bool]) -> Any:
        """The logits with each live row's penalties applied (a copy), or as they are."""
        if not any(row.penalties.active for row in rows):
            return logits
        torch = self._torch
        with torch.inference_mode():
            logits = logits.clone()
            for j, row in enumerate(rows):
                if not live[j]:
                    continue
                repeated = row.penalties.repeated()
                if repeated:
                    index = torch.tensor(repeated, dtype=torch.long, device=self.device)
                    values = logits[j, index]
                    penalty = row.penalties.repetition
                    logits[j, index] = torch.where(values > 0, values / penalty, values * penalty)
                tokens, amounts = row.penalties.subtracted()
                if tokens:
                    index = torch.tensor(tokens, dtype=torch.long, device=self.device)
                    logits[j, index] -= torch.tensor(amounts, dtype=logits.dtype, device=self.device)
        return logits

    def _outcome(self, row: _Row) -> EngineOutcome:
        stops = self.config.decoding.stop
        text, cut = cut_at_stop(self.tokenizer.decode(row.out, skip_special_tokens=True), stops)
        stopped = row.stopped or cut
        constrained = row.session is not None
        truncated = row.finish == "length" and not self.ignore_eos
        # Under the schema, a cut output is no longer the complete JSON the grammar held.
        if truncated or (row.session is not None and (stopped or not row.session.complete())):
            why = (f"a stop sequence ({', '.join(map(repr, stops))}) ended the output" if stopped
                   else f"output reached max_tokens={self.config.decoding.max_tokens}")
            return EngineOutcome(
                record_id=row.request.record_id,
                error=f"{why} before it was complete: {text[:80]!r}...",
                error_kind="engine_error",
                input_tokens=len(row.prompt),
                output_tokens=len(row.out),
                finish_reason=row.finish,
                constrained=constrained,
            )
        return EngineOutcome(record_id=row.request.record_id, output=text.strip(),
                             input_tokens=len(row.prompt), output_tokens=len(row.out),
                             finish_reason=row.finish, constrained=constrained)


class _Running:
    """Rows decoded together: their keys and values, attention mask, next positions and logits.

    Each row's tokens sit right-aligned in the cache with padding on the left
    only, as in a left-padded batch, so a column's distance is a token's
    distance (sliding-window attention stays right). With continuous refill
    (`compact_at` set) finished rows are dropped when new records are admitted
    or, with none waiting, once `compact_at` of them have finished; either way
    in one copy of the keys and values. With `compact_at` None rows stay until
    the whole batch is done (static batches, whose sampled draws depend on
    every row being there).
    """

    def __init__(self, engine: TransformersEngine, compact_at: int | None) -> None:
        self.engine = engine
        self.torch = engine._torch
        self.compact_at = compact_at
        self.rows: list[_Row] = []
        self.inflight: dict[str, EngineRequest] = {}  # taken and not yet answered
        self.cache: Any = None
        self.mask: Any = None  # (rows, columns), 1 where a column holds one of the row's tokens
        self.positions: Any = None  # (rows,) the position of the token each row is fed next
        self.logits: Any = None  # (rows, vocabulary) each row's next-token logits
        decoding = engine.config.decoding
        self.generator = self.torch.Generator(device=engine.device).manual_seed(decoding.seed)

    def active(self) -> int:
        return sum(row.finish is None for row in self.rows)

    def drain(self, batch: Sequence[EngineRequest]) -> Iterator[EngineOutcome]:
        """Decodes `batch` to its end, taking nothing else (a static batch)."""
        yield from self.admit(batch)
        while self.active():
            yield from self.decide()
            if self.active():
                self.forward()

    def refill(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        """Decodes the source's records until it runs dry, admitting new ones as rows free.

        New records are admitted after the step's forward, in the same rebuild of
        the cache that drops the finished rows: a row that finished is run once
        more, fed padding, which costs a row of the forward, where dropping it
        first would cost a second copy of the whole cache.
        """
        size = self.engine.batch_size
        threshold = self.compact_at or 1
        while True:
            if not self.active():
                new = requests.next_batch(size)
                if not new:
                    return
                yield from self.admit(new)
                continue
            yield from self.decide()
            free = size - self.active()
            if self.active():
                self.forward()
            if free >= threshold:
                new = requests.poll(free)
                if new:
                    yield from self.admit(new)
                elif self.active() and len(self.rows) - self.active() >= threshold:
                    self._compact()

    def unanswered(self) -> list[EngineRequest]:
        """The requests taken but not yet answered, in the order they came."""
        return list(self.inflight.values())

    # --- admission -------------------------------------------------------------

    def admit(self, requests: Sequence[EngineRequest]) -> Iterator[EngineOutcome]:
        """Runs the new records' prompts and merges them into the batch."""
        engine = self.engine
        self.inflight.update((r.record_id, r) for r in requests)
        fresh: list[tuple[_Row, _Prefix | None]] = []
        for request in requests:
            ids, templated = engine._prompt_ids(request)
            limit = engine._max_positions
            if limit is not None and len(ids) >= limit:
                del self.inflight[request.record_id]
                yield EngineOutcome(
                    record_id=request.record_id,
                    error=f"prompt has {len(ids)} tokens, the model holds {limit}",
                    error_kind="engine_error",
                    input_tokens=len(ids),
                    constrained=engine._grammar is not None,
                )
                continue
            budget = engine.config.decoding.max_tokens
            if limit is not None:
                budget = min(budget, limit - len(ids))
            session = (GrammarSession(engine._lltokenizer, engine._grammar, engine._vocab)
                       if engine._grammar is not None else None)
            row = _Row(request, ids, session, budget, TokenPenalties(engine.config.decoding, ids))
            fresh.append((row, engine._prefix(request, templated)))
        if not fresh:
            return
        with self.torch.inference_mode():
            layers, mask, logits = self._prefill(fresh)
            self._merge(layers, mask, logits, [len(row.prompt) for row, _ in fresh])
        self.rows.extend(row for row, _ in fresh)
        engine.counts.admissions += 1

    def _prefill(self, fresh: list[tuple[_Row, _Prefix | None]]) -> tuple[list[tuple[Any, Any]], Any, Any]:
        """Runs each new row's tokens past its shared prefix; returns the rows' keys and
        values (right-aligned), their mask and their next-token logits."""
        engine = self.engine
        torch = self.torch
        device = engine.device
        shared = [_shared_length(row.prompt, prefix) for row, prefix in fresh]
        width_past = max(shared)
        own = [len(row.prompt) - k for (row, _), k in zip(fresh, shared, strict=True)]
        width = max(own)
        n = len(fresh)
        pad = int(engine.tokenizer.pad_token_id)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width_past + width), dtype=torch.long)
        for i, ((row, _), k, m) in enumerate(zip(fresh, shared, own, strict=True)):
            input_ids[i, width - m:] = torch.tensor(row.prompt[k:], dtype=torch.long)
            positions[i, width - m:] = torch.arange(k, k + m)
            mask[i, width_past - k:width_past] = 1
            mask[i, width_past + width - m:] = 1
        if width_past:
            # Room for the rows' own tokens, so the forward writes them in place.
            past = _cache_of(_past_from_prefixes(torch, [p for _, p in fresh], shared, width_past, width, device),
                             used=width_past)
        else:
            past = _cache_of([])
        mask = mask.to(device)
        result = engine.forward(input_ids.to(device), mask, positions.to(device), past)
        counts = engine.counts
        counts.prefill_tokens += sum(own)
        counts.reused_tokens += sum(shared)
        counts.prefill_padding += n * width - sum(own)
        layers = _cache_layers(_returned_cache(result))
        if width_past:
            layers, mask = _right_align(torch, layers, mask)
        return layers, mask, result.logits[:, -1, :].float()

    def _merge(self, layers: list[tuple[Any, Any]], mask: Any, logits: Any, lengths: list[int]) -> None:
        """Joins new rows to the live ones, dropping the finished."""
        torch = self.torch
        positions = torch.tensor(lengths, dtype=torch.long, device=self.engine.device)
        keep = [i for i, row in enumerate(self.rows) if row.finish is None]
        if keep:
            index = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
            logits = torch.cat([self.logits.index_select(0, index), logits])
            positions = torch.cat([self.positions.index_select(0, index), positions])
        self._restack(keep, [(layers, mask)])
        self.logits, self.positions = logits, positions

    def _compact(self) -> None:
        """Drops the finished rows, and the columns only they used."""
        torch = self.torch
        keep = [i for i, row in enumerate(self.rows) if row.finish is None]
        with torch.inference_mode():
            index = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
            self.logits = self.logits.index_select(0, index)
            self.positions = self.positions.index_select(0, index)
            self._restack(keep, [])

    def _restack(self, keep: list[int], new: list[tuple[list[tuple[Any, Any]], Any]]) -> None:
        """Rebuilds the cache from the kept rows and the new ones, right-aligned to the
        widest, with room to grow. Layer by layer, each old layer's buffers freed once
        copied, so the device holds one extra layer at a time, not a second cache."""
        torch = self.torch
        masks = [mask for _, mask in new]
        old: list[Any] = []
        first = 0
        if keep and self.cache is not None:
            index = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
            mask = self.mask.index_select(0, index)
            first = _first_used(torch, mask)
            masks.insert(0, mask[:, first:])
            old = self.cache.layers
        self.rows = [self.rows[i] for i in keep]
        width = max(mask.shape[1] for mask in masks)
        room = max(GROW_COLUMNS, width // 4)
        layers = []
        for i in range(len(old) or len(new[0][0])):
            keys = [group[i][0] for group, _ in new]
            values = [group[i][1] for group, _ in new]
            if old:
                keys.insert(0, old[i].keys[:, :, first:].index_select(0, index))
                values.insert(0, old[i].values[:, :, first:].index_select(0, index))
                old[i].release()
            layers.append((_stack(torch, keys, width, room), _stack(torch, values, width, room)))
        self.mask = torch.cat([_left_pad(torch, mask, width) for mask in masks])
        self.cache = _cache_of(layers, used=width)

    # --- decoding ------------------------------------------------------------------

    def decide(self) -> Iterator[EngineOutcome]:
        """Chooses each live row's next token and yields the records that finished."""
        engine = self.engine
        live = [row.finish is None for row in self.rows]
        logits = engine._penalised(self.logits, self.rows, live)
        chosen = engine._choose(logits, [row.session for row in self.rows], live, self.generator)
        finished = []
        started = time.perf_counter()
        for row, token, was_live in zip(self.rows, chosen, live, strict=True):
            if was_live:
                row.finish = self._advance(row, token)
                if row.finish is not None:
                    finished.append(row)
        engine.counts.grammar_seconds += time.perf_counter() - started
        for row in finished:
            del self.inflight[row.request.record_id]
            yield engine._outcome(row)

    def forward(self) -> None:
        """One decode step: each live row is fed its last token, a finished row padding."""
        engine = self.engine
        torch = self.torch
        live = [row.finish is None for row in self.rows]
        pad = int(engine.tokenizer.pad_token_id)
        feed = [[row.out[-1] if on else pad] for row, on in zip(self.rows, live, strict=True)]
        device = engine.device
        with torch.inference_mode():
            column = torch.tensor([[int(on)] for on in live], dtype=torch.long, device=device)
            self.mask = torch.cat([self.mask, column], dim=1)
            result = engine.forward(torch.tensor(feed, dtype=torch.long, device=device), self.mask,
                                    self.positions[:, None], self.cache)
            self.cache = _returned_cache(result)
            self.logits = result.logits[:, -1, :].float()
            self.positions = self.positions + 1
        counts = engine.counts
        counts.decode_steps += 1
        counts.decode_rows += len(live)
        counts.idle_rows += live.count(False)

    def _advance(self, row: _Row, token: int) -> str | None:
        """Takes the row's chosen token; returns why the record ended, if it did."""
        if token in self.engine._eos and not self.engine.ignore_eos:
            return "stop"
        row.out.append(token)
        row.penalties.add([token])
        if row.session is not None:
            row.session.consume([token])
            if row.session.done():
                return "stop"
        stops = self.engine.config.decoding.stop
        if stops:
            tail = self.engine.tokenizer.decode(row.out[-stop_window(stops):], skip_special_tokens=True)
            if any(s in tail for s in stops):
                row.stopped = True
                return "stop"
        return "length" if len(row.out) >= row.budget else None


def _shared_length(prompt: list[int], prefix: _Prefix | None) -> int:
    """How many of the prompt's first tokens are the prefix's: the prefix's own
    tokenization may end differently where a token merges across its end. At least
    one token is left to run, since its logits choose the first output token."""
    if prefix is None:
        return 0
    limit = min(len(prefix.ids), len(prompt) - 1)
    k = 0
    while k < limit and prompt[k] == prefix.ids[k]:
        k += 1
    return k


def _past_from_prefixes(torch: Any, prefixes: list[_Prefix | None], shared: list[int], width: int, room: int,
                        device: Any) -> list[tuple[Any, Any]]:
    """Per layer, each row's first `shared` prefix keys and values, right-aligned in `width`
    columns, with `room` columns after them."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (prefix, k) in enumerate(zip(prefixes, shared, strict=True)):
        if prefix is not None and k:
            groups.setdefault((id(prefix), k), []).append(i)
    first = next(p for p in prefixes if p is not None)
    past = []
    for layer, (k0, v0) in enumerate(first.layers):
        keys = k0.new_zeros((len(prefixes), k0.shape[1], width + room, k0.shape[3]))
        values = v0.new_zeros((len(prefixes), v0.shape[1], width + room, v0.shape[3]))
        for (_, k), rows in groups.items():
            prefix = prefixes[rows[0]]
            assert prefix is not None
            pk, pv = prefix.layers[layer]
            index = torch.tensor(rows, dtype=torch.long, device=device)
            keys[index, :, width - k:width] = pk[:, :, :k]
            values[index, :, width - k:width] = pv[:, :, :k]
        past.append((keys, values))
    return past


def _right_align(torch: Any, layers: list[tuple[Any, Any]], mask: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """Moves each row's used columns to the right end, padding only on the left."""
    width = mask.shape[1]
    used = mask.sum(1)
    # A stable sort puts unused columns first and keeps the used ones in order.
    order = torch.sort(mask, dim=1, stable=True).indices
    aligned = (torch.arange(width, device=mask.device)[None, :] >= (width - used)[:, None]).to(mask.dtype)
    out = []
    for keys, values in layers:
        index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        out.append((keys.gather(2, index), values.gather(2, index)))
    return out, aligned


def _first_used(torch: Any, mask: Any) -> int:
    """The first column any row uses: those before it are padding for every row."""
    return int(mask.any(0).nonzero()[0])


def _left_pad(torch: Any, mask: Any, width: int) -> Any:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


def _stack(torch: Any, parts: list[Any], width: int, room: int) -> Any:
    """Keys or values (rows, heads, columns, dim) of several groups of rows, one group
    under another, right-aligned in `width` columns, with `room` free columns after."""
    first = parts[0]
    # Zeros, not garbage, left of each row's tokens: a masked column still meets the
    # attention's matmul, and NaN times a zero weight is NaN.
    out = first.new_zeros((sum(p.shape[0] for p in parts), first.shape[1], width + room, first.shape[3]))
    row = 0
    for part in parts:
        out[row:row + part.shape[0], :, width - part.shape[2]:width] = part
        row += part.shape[0]
    return out


def _cache_of(layers: list[tuple[Any, Any]], used: int | None = None) -> Any:
    """A cache over these keys and values, taken as they are; `used` columns of them
    are filled (all when None), the rest is room to grow in place."""
    from transformers import DynamicCache

    # Without the model's config every layer keeps all its columns, which the
    # merging and dropping of rows rely on (a sliding-window layer would crop them).
    cache = DynamicCache()
    grow = _growing_layer()
    cache.layers = [grow(keys, values, keys.shape[2] if used is None else used) for keys, values in layers]
    return cache


@functools.cache
def _growing_layer() -> Any:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """A full layer that writes new columns into spare room at the end of its buffers.

        transformers' DynamicLayer concatenates at every step, copying the whole
        cache once per token; here the buffers grow by a quarter at a time, so a
        step writes one column and a copy happens once in many steps.
        """

        def __init__(self, keys: Any, values: Any, used: int) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            # What lazy_initialization sets, whose arguments differ between releases.
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self._keys, self._values, self._used = keys, values, used
            self.keys = keys[:, :, :used]
            self.values = values[:, :, :used]

        def release(self) -> None:
            self._keys = self._values = self.keys = self.values = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            used, new = self._used, key_states.shape[-2]
            if used + new > self._keys.shape[-2]:
                room = used + new + max(GROW_COLUMNS, (used + new) // 4)
                self._keys = _with_room(self._keys, used, room)
                self._values = _with_room(self._values, used, room)
            self._keys[:, :, used:used + new] = key_states
            self._values[:, :, used:used + new] = value_states
            self._used = used + new
            self.keys = self._keys[:, :, :self._used]
            self.values = self._values[:, :, :self._used]
            return self.keys, self.values

    return GrowingLayer


def _with_room(old: Any, used: int, columns: int) -> Any:
    shape = list(old.shape)
    shape[2] = columns
    buffer = old.new_empty(shape)
    buffer[:, :, :used] = old[:, :, :used]
    return buffer


def _returned_cache(result: Any) -> Any:
    cache = getattr(result, "cache", None)
    return cache if cache is not None else result.past_key_values


def _cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:300]
