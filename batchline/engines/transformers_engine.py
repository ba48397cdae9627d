"""Hugging Face transformers: batched generation on the CPU or a CUDA GPU.

Each batch of records is left-padded and decoded step by step with our own
loop over the model (not ``model.generate``), for three reasons: a record's
outcome is yielded the moment its row finishes instead of when the batch does;
the schema's token mask (llguidance) is computed only for the rows whose
greedy choice breaks the schema, not for every row at every step; and a batch
that fails is retried in halves, so a poison record fails alone and its
batch-mates are not charged for it.

Static batching: rows that finish early idle until the batch ends, and the
shared prefix is recomputed for every row. vLLM (continuous batching, prefix
caching) is the engine for throughput on GPUs; this one is the portable one.

Model options (``model.options``), all part of the job version:
  device ("auto": cuda when available, else cpu), dtype ("auto": bfloat16 on
  cuda, float32 on cpu), batch_size (8 on cpu, 64 on cuda), constrained (true),
  ignore_eos (false; benchmarks set it to decode exactly max_tokens),
  attn_implementation (passed to from_pretrained, e.g. "sdpa"), chat_template
  (a Jinja chat template used instead of the tokenizer's own).

Conversations (openai-batch input) are rendered with the chat template
(``apply_chat_template``, generation prompt added), or in the plain
role-tagged form when there is none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from batchline.digests import verify_weights
from batchline.engines.base import (
    EngineConfig,
    EngineOutcome,
    EngineRequest,
    RequestSource,
    batches,
    hf_chat_prompt,
    hf_templated,
)
from batchline.engines.grammar import GrammarSession, import_llguidance, json_schema_grammar
from batchline.engines.models import resolve_model_path
from batchline.errors import EngineFatal


def _import_torch() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        raise EngineFatal(
            "the transformers engine needs torch and transformers "
            "(install batchline's 'transformers' extra)"
        ) from None
    return torch, transformers


class TransformersEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        opts = dict(config.model.options)
        self.device_option = str(opts.get("device", "auto"))
        self.dtype_option = str(opts.get("dtype", "auto"))
        self.batch_size_option = opts.get("batch_size")
        self.constrained = bool(opts.get("constrained", True))
        self.ignore_eos = bool(opts.get("ignore_eos", False))
        self.attn_implementation = opts.get("attn_implementation")
        self.chat_template: str | None = opts.get("chat_template")
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.batch_size = 1
        self._torch: Any = None
        self._grammar: str | None = None
        self._lltokenizer: Any = None
        self._eos: set[int] = set()
        self._vocab = 0
        self._max_positions: int | None = None

    # --- loading -------------------------------------------------------------

    def load(self) -> None:
        path = resolve_model_path(self.config.model.path, None)
        verify_weights(path, self.config.model.digest)
        torch, transformers = _import_torch()
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
        for batch in batches(requests, self.batch_size):
            yield from self.run_batch(batch)

    def close(self) -> None:
        self.model = None
        if self._torch is not None and self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()

    # --- batches -------------------------------------------------------------

    def run_batch(self, batch: list[EngineRequest]) -> Iterator[EngineOutcome]:
        """Decodes a batch; on failure retries it in halves so one bad record fails alone."""
        done: set[str] = set()
        try:
            for outcome in self._decode(batch):
                done.add(outcome.record_id)
                yield outcome
        except EngineFatal:
            raise
        except Exception as exc:
            message = str(exc)
            if "CUDA error" in message or "device-side assert" in message:
                # The CUDA context is unusable after such an error; only a new process helps.
                raise EngineFatal(f"CUDA error: {_one_line(exc)}") from None
            rest = [r for r in batch if r.record_id not in done]
            if self._torch.cuda.is_available():
                self._torch.cuda.empty_cache()
            if len(rest) == 1:
                yield EngineOutcome(
                    record_id=rest[0].record_id,
                    error=f"{type(exc).__name__}: {_one_line(exc)}",
                    error_kind="engine_error",
                )
                return
            half = (len(rest) + 1) // 2
            yield from self.run_batch(rest[:half])
            yield from self.run_batch(rest[half:])

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        templated = hf_templated(self.tokenizer, request, self.chat_template)
        ids: list[int] = self.tokenizer(request.prompt, add_special_tokens=not templated)["input_ids"]
        return ids

    def _decode(self, batch: list[EngineRequest]) -> Iterator[EngineOutcome]:
        torch = self._torch
        decoding = self.config.decoding
        encoded = [self._prompt_ids(r) for r in batch]
        rows: list[int] = []
        for i, (request, ids) in enumerate(zip(batch, encoded, strict=True)):
            if self._max_positions is not None and len(ids) >= self._max_positions:
                yield EngineOutcome(
                    record_id=request.record_id,
                    error=f"prompt has {len(ids)} tokens, the model holds {self._max_positions}",
                    error_kind="engine_error",
                    input_tokens=len(ids),
                )
            else:
                rows.append(i)
        if not rows:
            return
        width = max(len(encoded[i]) for i in rows)
        pad = int(self.tokenizer.pad_token_id)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            ids = encoded[i]
            input_ids[j, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention[j, width - len(ids):] = 1
        input_ids = input_ids.to(self.device)
        attention = attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        budget = decoding.max_tokens
        if self._max_positions is not None:
            budget = min(budget, self._max_positions - width)
        sessions: list[GrammarSession | None] = [
            GrammarSession(self._lltokenizer, self._grammar, self._vocab)
            if self._grammar is not None else None
            for _ in rows
        ]
        generator = torch.Generator(device=self.device).manual_seed(decoding.seed)
        outputs: list[list[int]] = [[] for _ in rows]
        active = [True] * len(rows)
        # Inference mode only around the model's calls: this generator yields
        # between steps, and the consumer's code must not run in inference mode.
        with torch.inference_mode():
            result = self.model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions,
                use_cache=True, logits_to_keep=1,
            )
        cache = result.past_key_values
        last_pos = positions[:, -1]
        for step_number in range(budget):
            logits = result.logits[:, -1, :].float()
            chosen = self._choose(logits, sessions, active, generator)
            for j, token in enumerate(chosen):
                if not active[j]:
                    continue
                session = sessions[j]
                if token in self._eos and not self.ignore_eos:
                    active[j] = False
                else:
                    outputs[j].append(token)
                    if session is not None:
                        session.consume([token])
                        active[j] = not session.done()
                if not active[j]:
                    yield self._outcome(batch[rows[j]], encoded[rows[j]], outputs[j], session)
            if not any(active):
                return
            if step_number == budget - 1:
                break
            step = torch.tensor(
                [[t if a else pad] for t, a in zip(chosen, active, strict=True)],
                dtype=torch.long, device=self.device,
            )
            attention = torch.cat(
                [attention, torch.tensor([[int(a)] for a in active], device=self.device)], dim=1
            )
            last_pos = last_pos + 1
            with torch.inference_mode():
                result = self.model(
                    input_ids=step, attention_mask=attention, position_ids=last_pos[:, None],
                    past_key_values=cache, use_cache=True,
                )
            cache = result.past_key_values
        for j in range(len(rows)):
            if active[j]:
                yield self._outcome(batch[rows[j]], encoded[rows[j]], outputs[j], sessions[j],
                                    truncated=not self.ignore_eos)

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
        refused = [
            j for j, (token, session) in enumerate(zip(picked, sessions, strict=True))
            if active[j] and session is not None and not session.accepts(int(token))
        ]
        if refused:
            masks = np.stack([s.allowed() for s in (sessions[j] for j in refused) if s is not None])
            allowed = torch.from_numpy(masks).to(self.device)
            sub = logits[refused].masked_fill(~allowed, float("-inf"))
            if temperature <= 0:
                again = sub.argmax(-1).tolist()
            else:
                again = torch.multinomial(self._probs(sub, temperature), 1, generator=generator)[:, 0].tolist()
            for j, token in zip(refused, again, strict=True):
                picked[j] = token
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

    def _outcome(self, request: EngineRequest, prompt: list[int], out: list[int],
                 session: GrammarSession | None, truncated: bool = False) -> EngineOutcome:
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        incomplete = truncated or (session is not None and not session.complete())
        if incomplete:
            return EngineOutcome(
                record_id=request.record_id,
                error=f"output reached max_tokens={self.config.decoding.max_tokens} before it "
                      f"was complete: {text[:80]!r}...",
                error_kind="engine_error",
                input_tokens=len(prompt),
                output_tokens=len(out),
            )
        return EngineOutcome(record_id=request.record_id, output=text.strip(),
                             input_tokens=len(prompt), output_tokens=len(out))


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
