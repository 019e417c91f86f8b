"""Decoding that measures the mixer, not Python: static caches, one compiled decode step, batched generation.

    from attnzoo.models.decoding import Decoder
    dec = Decoder(model, batch=8, max_len=2048, compile=True)      # caches allocated once, the step compiled once
    out = dec.generate([[5, 6, 7], [9]], max_new_tokens=64, temperature=0.8, top_k=40, eos_id=0)
    out.tokens[b]       # row b's new tokens (cut at its eos / stop string)
    dec.generate(...)   # other prompts, other lengths: the same compiled step, no recompile

The cache is `DecoderLM.new_static_cache` (layers/kv_cache.StaticModelCache): every buffer allocated for positions
0 .. max_len - 1 and written in place, each row's position a tensor, so one graph serves every step of every
prompt (and, on a GPU with mode="reduce-overhead", one CUDA graph). Prompts of different lengths are prefilled row
by row (eager: one forward per prompt into its row's views), then decoded together, row b at its own position.

Sampling runs inside the compiled step: the logits filtered as `models.decoder.filtered_logits` does it
(temperature, top-k, then top-p: the same function `sample_next` uses), then a token drawn by the exponential race
argmax(p / E), E ~ Exp(1) (a draw from p, as multinomial's; the noise comes from the caller's generator, so a seed
reproduces a completion). Temperature 0 is argmax. Stop: `eos_id` and stop strings (`stop`, matched on each row's
decoded text) end a row; the batch ends when every row has ended (or after max_new_tokens).

Every mixer in the zoo has a static cache, in every KV format (`kv_format`: bf16 slots or KIVI's int8 / int4 codes
with a ring of R + G full-precision tokens, mixers/kv_quant.py). A mixer without one (`DecoderLM.
static_cache_missing`: a user's mixer that does not implement `new_static_cache`) decodes through its dynamic
cache, eager (`Decoder.path` says which, and why).
"""
from __future__ import annotations

import logging
import statistics
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from attnzoo.config.errors import ConfigError
from attnzoo.models.decoder import filtered_logits

log = logging.getLogger(__name__)
DECODE_WINDOWS = 4  # decode_rate: its timed steps in this many windows, the median window's rate reported


@dataclass
class Generation:
    tokens: list  # per row: the new token ids (up to and including an eos, cut before a stop string's end)
    finished: list  # per row: "eos", "stop" or "length"
    steps: int  # decode steps run (prefill excluded)
    path: str = ""  # Decoder.path
    text: list = field(default_factory=list)  # per row, with decode=: the decoded new text (cut at a stop string)


def draw(logits: torch.Tensor, noise: Optional[torch.Tensor], temperature, top_k, top_p) -> torch.Tensor:
    """Next tokens (B, 1) from logits (B, V): argmax when `noise` is None (greedy), else the exponential race
    argmax(softmax(filtered) / noise) with noise ~ Exp(1) (B, V): a draw from the filtered distribution."""
    if noise is None:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(filtered_logits(logits, temperature, top_k, top_p), dim=-1)
    return (probs / noise).argmax(dim=-1, keepdim=True)


def decode_step(model, cache, tokens: torch.Tensor, noise, temperature, top_k, top_p) -> tuple:
    """tokens (B, 1) at each row's position in `cache` (advanced in place) -> (the next tokens (B, 1) (`draw`), the
    logits (B, V) they were drawn from: one more output of the same graph, for `Decoder.greedy_step`)."""
    logits = model(tokens, cache=cache)[:, -1]
    return draw(logits, noise, temperature, top_k, top_p), logits


class Decoder:
    """Batched decoding of a `DecoderLM` through a static cache of `batch` rows x `max_len` positions.

    compile: torch.compile the decode step (fullgraph; `mode` e.g. "reduce-overhead" for CUDA graphs, the default
        on CUDA; `backend` another torch.compile backend, e.g. a counting one in tests). False: the same step, eager.
    dtype: of the cached values (default: the weights').
    The model must not change (train, load weights) while a Decoder holds it: the compiled step guards on it."""

    def __init__(self, model, batch: int, max_len: int, *, compile: bool = True, dtype=None, mode: Optional[str] = None,
                 backend: str = "inductor", kv_format=None) -> None:
        if batch < 1 or max_len < 2:
            raise ConfigError(f"batch {batch}, max_len {max_len}; allowed: batch >= 1, max_len >= 2", field="decoder")
        self.model, self.batch, self.max_len = model.eval(), batch, max_len
        device = model.embed.weight.device
        self.dtype = dtype or model.embed.weight.dtype
        self.kv_format = None if kv_format is None or kv_format.dtype == "fp32" else kv_format
        missing = model.static_cache_missing()
        self.cache = model.new_static_cache(batch, max_len, self.dtype, device, kv_format=self.kv_format)
        if self.cache is None:
            self.path = f"eager, dynamic cache ({', '.join(missing)}: no static cache yet)"
        elif compile and getattr(getattr(model.cfg, "position", None), "scaling", None) == "dynamic":
            compile = False  # dynamic NTK reads the largest position as a number: no single graph for every step
            self.path = "eager static cache (position.scaling=dynamic cannot be compiled into one step)"
        elif compile:
            if mode is None and device.type == "cuda":
                mode = "reduce-overhead"
            self.path = f"compiled static cache (torch.compile {backend}{', ' + mode if mode else ''})"
        else:
            self.path = "eager static cache"
        self.compiled = self.cache is not None and compile
        # the step every caller runs: the static cache's (compiled below), or one dynamic cache per row, eager
        self._step = self.step if self.cache is not None else self._eager_rows_step
        if self.compiled:
            # torch.compile keeps its graphs (and the recompile limit, 8) per code object: each decoder compiles its
            # own copy of `decode_step`, so decoders of other models never count as recompiles of this one, and the
            # graphs go with the decoder
            own = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, "decode_step")
            self._compiled = torch.compile(own, fullgraph=True, dynamic=False, mode=mode, backend=backend)
            self._step = self._first_compiled_step
        self.limit = position_table(model)

    def _first_compiled_step(self, *args) -> torch.Tensor:
        """The first call compiles. A compiler failure (torch 2.13's CPU inductor fails on some shapes, e.g. RWKV-7 at
        batch 8: docs/inference.md) happens before the step runs, so nothing is written: the decoder warns, says so
        in `path` and `compiled`, and runs the same step eagerly from then on."""
        try:
            out = self._compiled(self.model, self.cache, *args)
        except Exception as e:  # the compiler's own error types vary by backend
            why = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
            log.warning("attnzoo: the decode step did not compile (%s: %s); decoding eagerly", type(e).__name__, why)
            self.path, self.compiled = f"eager static cache (the compile failed: {type(e).__name__})", False
            self._step = self.step
            return self.step(*args)
        self._step = lambda *a: self._compiled(self.model, self.cache, *a)
        return out

    # ------------------------------------------------------------------ one step
    def step(self, tokens: torch.Tensor, noise: Optional[torch.Tensor], temperature, top_k, top_p) -> tuple:
        """One decode step of every row, eager: tokens (B, 1) at each row's position -> (the next tokens (B, 1),
        their logits (B, V))."""
        return decode_step(self.model, self.cache, tokens, noise, temperature, top_k, top_p)

    @torch.no_grad()
    def greedy_step(self, tokens: torch.Tensor) -> tuple:
        """One greedy step of every row through the decoder's own step (the compiled graph where it compiles, the one
        greedy `generate` runs): tokens (B, 1) -> (the next tokens (B, 1), the logits (B, V) they were taken from)."""
        return self._step(tokens, None, None, None, None)

    @torch.no_grad()
    def prefill(self, prompts: list) -> torch.Tensor:
        """Empty the cache and prefill row b with prompts[b] (eager, one forward per row). Returns the last logits
        (B, V). Rows past len(prompts) repeat the last prompt (their output is dropped): the step's shapes stay."""
        dev = self.model.embed.weight.device
        rows = list(prompts) + [prompts[-1]] * (self.batch - len(prompts))
        if self.cache is None:  # the dynamic cache: one per row (rows of other lengths cannot share one)
            self.rows = [self.model.new_cache(1, self.max_len, self.dtype, kv_format=self.kv_format) for _ in rows]
            return torch.cat([self.model(torch.tensor([p], device=dev), cache=c)[:, -1] for p, c in zip(rows, self.rows)])
        self.cache.reset()
        return torch.cat([self.model(torch.tensor([p], device=dev), cache=self.cache.row(b))[:, -1]
                          for b, p in enumerate(rows)])

    def _eager_rows_step(self, tokens, noise, temperature, top_k, top_p) -> tuple:
        logits = torch.cat([self.model(tokens[b:b + 1], cache=c)[:, -1] for b, c in enumerate(self.rows)])
        return draw(logits, noise, temperature, top_k, top_p), logits

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts: list, max_new_tokens: int, *, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_id: Optional[int] = None, stop: Optional[list] = None,
                 decode: Optional[Callable[[list], str]] = None, generator: Optional[torch.Generator] = None,
                 on_tokens: Optional[Callable[[list], None]] = None) -> Generation:
        """New tokens for each prompt (lists of token ids, at most `batch`, any lengths). temperature 0: greedy;
        top_k / top_p as `sample_next`; eos_id: a row ends after producing it; stop: strings that end a row once
        its decoded new text (`decode` is required with them) contains one (the text is cut before it, the tokens
        after the token that completed it); on_tokens(list of B ints): called after each step (streaming)."""
        self.check(prompts, max_new_tokens, stop, decode)
        dev = self.model.embed.weight.device
        B, V = self.batch, self.model.lm_head.out_features
        greedy = temperature <= 0
        temp = None if greedy else torch.tensor(float(temperature), device=dev)
        k = torch.tensor(int(top_k) if top_k else V, device=dev)
        p = torch.tensor(float(top_p) if top_p is not None else 1.0, device=dev)

        def noise():
            return None if greedy else torch.empty(B, V, device=dev).exponential_(generator=generator)

        nxt = draw(self.prefill(prompts), noise(), temp, k, p)
        n = len(prompts)
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)
        watch = eos_id is not None or bool(stop) or on_tokens is not None
        finished, ended_at, text = ["length"] * n, [max_new_tokens] * n, [""] * n
        steps = 0
        for t in range(max_new_tokens):
            out[:, t] = nxt[:, 0]
            if watch:
                row = nxt[:, 0].tolist()
                if on_tokens is not None:
                    on_tokens(row[:n])
                for b in range(n):
                    if finished[b] != "length" or ended_at[b] < max_new_tokens:
                        continue
                    if eos_id is not None and row[b] == eos_id:
                        finished[b], ended_at[b] = "eos", t + 1
                    elif stop:
                        s = decode(out[b, :t + 1].tolist())
                        hit = [s.index(x) for x in stop if x in s]
                        if hit:
                            finished[b], ended_at[b], text[b] = "stop", t + 1, s[:min(hit)]
                if all(e < max_new_tokens for e in ended_at):
                    break
            if t + 1 == max_new_tokens:
                break
            nxt = self._step(nxt, noise(), temp, k, p)[0]
            steps += 1
        tokens = out[:n].tolist()
        tokens = [r[:e] for r, e in zip(tokens, ended_at)]
        if decode is not None:
            text = [text[b] if finished[b] == "stop" else decode(tokens[b]) for b in range(n)]
        return Generation(tokens, finished, steps, self.path, text)

    @torch.no_grad()
    def decode_rate(self, prompt: list, steps: int) -> dict:
        """Greedy decode timing: prefill `prompt` into every row, `untimed_steps` untimed steps (the compile on the
        first; on CUDA also the second, which records the CUDA graph under mode="reduce-overhead"), then `steps`
        timed steps of all rows (max_len must hold len(prompt) + steps + 2), in DECODE_WINDOWS consecutive windows
        (fewer when steps are fewer). Returns tokens/s, the median of the windows' rates (rows x window steps /
        window seconds: one stall of the machine in a ~0.1 s measurement halved a run's figure, 2026-12-07), and the
        cache bytes after the prefill: filled (= the analytic cache_bytes) and allocated (a static cache's buffers)."""
        nxt = self.prefill([prompt] * self.batch).argmax(-1, keepdim=True)
        if self.cache is None:
            filled = allocated = sum(c.nbytes() for c in self.rows)
        else:
            filled, allocated = self.cache.nbytes(), self.cache.allocated_bytes()
        for _ in range(untimed_steps(nxt.device.type)):
            nxt = self._step(nxt, None, None, None, None)[0]
        sync = torch.cuda.synchronize if nxt.is_cuda else (lambda: None)
        sync()
        rates = []
        k = min(DECODE_WINDOWS, steps)
        for w in range(k):  # window sizes differ by at most one step; a sync at each window's end only
            n = steps // k + (w < steps % k)
            t0 = time.perf_counter()
            for _ in range(n):
                nxt = self._step(nxt, None, None, None, None)[0]
            sync()
            rates.append(self.batch * n / (time.perf_counter() - t0))
        return {"tokens_per_sec": statistics.median(rates) if rates else 0.0,  # steps=0: nothing timed, as before
                "filled_bytes": filled, "allocated_bytes": allocated}

    def check(self, prompts: list, max_new_tokens: int, stop, decode) -> None:
        """Before any work: 1 .. batch prompts, none empty, each with its new tokens inside max_len (and a learned
        position table); stop strings need `decode`."""
        if not 1 <= len(prompts) <= self.batch:
            raise ConfigError(f"{len(prompts)} prompts; allowed: 1 .. {self.batch} (the decoder's batch)",
                              field="prompts")
        if max_new_tokens < 1:
            raise ConfigError(f"must be >= 1, got {max_new_tokens}", field="max_new_tokens")
        if stop and decode is None:
            raise ConfigError("stop strings are matched on decoded text; pass decode=", field="stop")
        limit = self.max_len if self.limit is None else min(self.max_len, self.limit)
        for i, p in enumerate(prompts):
            if not len(p):
                raise ConfigError(f"prompt {i + 1} is empty; allowed: at least one token", field="prompts")
            if len(p) + max_new_tokens > limit:
                raise ConfigError(f"prompt {i + 1} ({len(p)} tokens) + {max_new_tokens} new tokens exceed the "
                                  f"decoder's {limit} positions; allowed: <= {limit - len(p)} new tokens",
                                  field="max_new_tokens")


def untimed_steps(device_type: str) -> int:
    """Steps a timing runs before its clock starts: 1 on a CPU (the compile, when compiled); 2 on CUDA, where
    torch.compile's mode="reduce-overhead" (CUDA graphs) runs its first call as a warm-up and records the graph on
    the second, so only the third call on is a replay (an eager step's first calls load cuBLAS)."""
    return 2 if device_type == "cuda" else 1


def position_table(model) -> Optional[int]:
    """The most positions `model` can embed (a learned table), or None where positions are computed."""
    cfg = getattr(model, "cfg", None)
    return cfg.max_seq_len if getattr(getattr(cfg, "position", None), "name", None) == "learned" else None
