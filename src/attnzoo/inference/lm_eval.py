"""lm-evaluation-harness adapter: `--model attnzoo --model_args path=RUN_DIR|CKPT` (docs/lm_eval.md).

    attnzoo-lm-eval --model attnzoo --model_args path=outputs/train/<run> --tasks lambada_openai,hellaswag
    python -m attnzoo.inference.lm_eval --model attnzoo --model_args path=<run>,max_length=1024 --tasks ...

    import attnzoo.inference.lm_eval, lm_eval                       # the import registers "attnzoo"
    lm_eval.simple_evaluate(model="attnzoo", model_args={"path": run_dir}, tasks=[...])

lm_eval 0.4 finds only its own models (its registry is filled from a fixed table; it reads no plugin entry
points), so a plain `lm_eval --model attnzoo` cannot see this class. `attnzoo-lm-eval` imports this module,
which registers "attnzoo", then runs lm_eval's own command line with the same arguments.

model_args: `path` (run dir or .ckpt), `best` (best.ckpt), `device`, `batch_size` (loglikelihood rows per
forward), `max_length` (tokens per forward; default `model.max_seq_len`), `max_gen_toks` (default 256),
`seed` (sampling), `compile` (generate_until's decode step compiled once: auto, the default, compiles on CUDA
only; true / false). Decoder LMs trained on text only (they have a tokenizer). generate_until decodes up to
batch_size requests together (attnzoo.models.decoding.Decoder: prompts of any lengths, one row each).

Tokenization is the run's own (byte-level BPE or char). A (context, continuation) pair is encoded as lm_eval's
HFLM does: the whole string once, the context alone, and the continuation is the whole's tokens after the
context's (TemplateLM._encode_pair). An empty context is replaced by <|endoftext|>.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

# lm_eval's own models register (lazily) when lm_eval.models is imported, and its get_model() imports it only
# into an empty registry: without this import, registering "attnzoo" would hide them (`--model hf`).
import lm_eval.models  # noqa: F401
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from attnzoo.config.errors import ConfigError
from attnzoo.inference.generate import load
from attnzoo.models.decoding import Decoder
from attnzoo.training.families import family_of

log = logging.getLogger(__name__)
EOT = "<|endoftext|>"  # attnzoo.data.tokenizer.SPECIALS[0], in both tokenizers' vocabularies


def _eot_id(tokenizer) -> int:
    return tokenizer.stoi[EOT] if tokenizer.kind == "char" else tokenizer.tok.token_to_id(EOT)


def _batch_size(value) -> int:
    """lm_eval passes `--batch_size` as a string ('8', 'auto', 'auto:4'); 'auto' is not searched: 16."""
    if isinstance(value, str) and value.startswith("auto"):
        return 16
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"got {value!r}; allowed: a positive integer or auto", field="model_args.batch_size") from None
    if n < 1:
        raise ConfigError(f"must be >= 1, got {n}", field="model_args.batch_size")
    return n


@register_model("attnzoo")
class AttnzooLM(TemplateLM):
    """An attnzoo decoder LM behind lm_eval's three request types: loglikelihood (+ is_greedy),
    loglikelihood_rolling (disjoint max_length windows) and generate_until (batched, through a static cache)."""

    def __init__(self, path: Optional[str] = None, best: bool = False, device: Optional[str] = None,
                 batch_size: int | str = 8, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 seed: int = 1234, max_batch_size: Optional[int] = None, compile: bool | str = "auto", **unknown):
        super().__init__()
        if unknown:
            raise ConfigError(f"unknown {', '.join(sorted(unknown))}; allowed: path, best, device, batch_size, "
                              f"max_length, max_gen_toks, seed, compile", field="model_args")
        if not path:
            raise ConfigError("missing; give --model_args path=RUN_DIR (or a .ckpt)", field="model_args.path")
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device:  # lm_eval's CLI passes cuda:0 unless told otherwise
                log.warning("attnzoo: device %s is not available; using cpu", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        run = load(path, best=best in (True, "true", "True", 1), device=device)
        family = family_of(run.config["model"])
        if not family.decoder_only:
            raise ConfigError(f"{run.checkpoint} is a {family.name} model; allowed with lm_eval: a decoder LM",
                              field="model_args.path")
        if not hasattr(run.datamodule, "tokenizer"):
            raise ConfigError(f"{run.checkpoint} trained on data={run.config['data'].get('name')}; allowed with "
                              f"lm_eval: a text run (it has a tokenizer)", field="model_args.path")
        self.run, self.model = run, run.model
        cfg = self.model.cfg
        self._device = torch.device(device)
        self._max_length = cfg.max_seq_len if max_length is None else int(max_length)
        if self._max_length < 2:
            raise ConfigError(f"must be >= 2, got {self._max_length}", field="model_args.max_length")
        if cfg.position.name == "learned" and self._max_length > cfg.max_seq_len:
            raise ConfigError(f"{self._max_length} exceeds the learned position table (model.max_seq_len="
                              f"{cfg.max_seq_len}); allowed: <= {cfg.max_seq_len}", field="model_args.max_length")
        self.max_gen_toks = int(max_gen_toks)
        # A capacity-limited MoE drops tokens per batch: padding rows would take expert slots and change the
        # scores, so such a model scores one sequence per forward.
        capped = any(getattr(getattr(b.ffn, "cfg", None), "capacity_factor", None) for b in self.model.blocks)
        self.batch_size = 1 if capped else _batch_size(batch_size)
        self._eot = _eot_id(run.datamodule.tokenizer)
        self._generator = torch.Generator(device=self._device).manual_seed(int(seed))
        # auto: compiled on CUDA; on a CPU, inductor's first compile (C++ kernels, ~20 s a graph) outweighs a
        # small evaluation's decode
        self._compile = self._device.type == "cuda" if compile == "auto" else compile in (True, "true", "True", 1, "1")
        self._decoder: Optional[Decoder] = None

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "AttnzooLM":
        """model_args win over the CLI's own --batch_size / --device (which it always passes, with defaults
        1 and cuda:0), where lm_eval would fail on the duplicate keyword."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "AttnzooLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ what lm_eval reads
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"attnzoo-{self.run.datamodule.tokenizer.kind}"

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.run.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.run.decode(tokens)

    # ------------------------------------------------------------------ loglikelihood
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) | None, context_ids, continuation_ids). Each row's input is the
        last max_length tokens of context + continuation minus its final token; the continuation's tokens are
        scored at the positions that predict them. Rows are batched longest first, right-padded (causal: the
        padding is never seen by a real position)."""
        out: list = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="attnzoo loglikelihood")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows = []
            for i in batch:
                _, ctx, cont = requests[i]
                if len(cont) > self.max_length:
                    raise ConfigError(f"a continuation of {len(cont)} tokens does not fit max_length="
                                      f"{self.max_length}", field="model_args.max_length")
                rows.append(((ctx + cont)[-(self.max_length + 1):][:-1], cont))
            T = max(len(inp) for inp, _ in rows)
            x = torch.zeros(len(rows), T, dtype=torch.long)
            real = torch.zeros(len(rows), T, dtype=torch.bool)
            for r, (inp, _) in enumerate(rows):
                x[r, :len(inp)] = torch.tensor(inp)
                real[r, :len(inp)] = True
            logp = F.log_softmax(self.model(x.to(self.device), token_mask=real.to(self.device)).float(), dim=-1)
            for r, (i, (inp, cont)) in enumerate(zip(batch, rows)):
                lp = logp[r, len(inp) - len(cont):len(inp)]  # (n_cont, V)
                target = torch.tensor(cont, device=lp.device)
                score = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
                out[i] = score
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            bar.update(len(batch))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole document's log-likelihood: lm_eval's disjoint windows of max_length predicted tokens,
        each conditioned on the max_length tokens before its last one (the first on <|endoftext|>)."""
        windows, owner = [], []
        for j, req in enumerate(requests):
            (string,) = req.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(j)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for j, (ll, _) in zip(owner, scores):
            totals[j] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generate_until
    def _gen_kwargs(self, kwargs: dict):
        """until (list), max_gen_toks, temperature (0 = greedy), top_k, top_p, as lm_eval means them:
        do_sample=False is greedy; do_sample unset samples iff temperature > 0; do_sample=True without a
        temperature samples at 1.0."""
        kw = dict(kwargs or {})
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        n = next((kw.pop(k) for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if kw.get(k) is not None),
                 self.max_gen_toks)
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 1.0 if do_sample else 0.0) or 0.0)
        if do_sample is False:
            temperature = 0.0
        return [s for s in until if s], int(n), temperature, kw.pop("top_k", None), kw.pop("top_p", None)

    def decoder(self) -> Decoder:
        """One batched decoder for every generate_until request (models/decoding.py: static cache, the step
        compiled once with model_args compile, on CUDA by default), max_length positions x batch_size rows."""
        if self._decoder is None:
            self._decoder = Decoder(self.model, self.batch_size, self.max_length, compile=self._compile)
        return self._decoder

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batches of up to batch_size requests with the same generation settings, decoded together (prompts of
        any lengths, each row at its own position); the context is left-truncated to max_length - max_gen_toks
        tokens. A row stops at <|endoftext|>, a stop string (its text cut before the first one, as lm_eval's
        HFLM) or max_gen_toks tokens."""
        todo = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            until, max_new, temperature, top_k, top_p = self._gen_kwargs(gen_kwargs)
            if not 0 < max_new < self.max_length:
                raise ConfigError(f"max_gen_toks={max_new}; allowed: 1 .. max_length - 1 = {self.max_length - 1}",
                                  field="gen_kwargs.max_gen_toks")
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            todo.append((i, ids, (tuple(until), max_new, temperature, top_k, top_p)))
        out: list = [None] * len(todo)
        groups: dict = {}
        for i, ids, settings in todo:
            groups.setdefault(settings, []).append((i, ids))
        bar = tqdm(total=len(todo), disable=disable_tqdm, desc="attnzoo generate_until")
        for (until, max_new, temperature, top_k, top_p), reqs in groups.items():
            for start in range(0, len(reqs), self.batch_size):
                chunk = reqs[start:start + self.batch_size]
                gen = self.decoder().generate([ids for _, ids in chunk], max_new, temperature=temperature,
                                              top_k=top_k, top_p=top_p, eos_id=self._eot, stop=list(until),
                                              decode=self.tok_decode, generator=self._generator)
                for (i, _), toks, how, text in zip(chunk, gen.tokens, gen.finished, gen.text):
                    if how == "eos":  # the end-of-text token is not part of the text
                        text = self.tok_decode(toks[:-1])
                    for stop in until:
                        text = text.split(stop)[0]
                    out[i] = text
                    context, gen_kwargs = requests[i].args
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(len(chunk))
        bar.close()
        return out


def main(argv: list[str] | None = None) -> None:
    """`attnzoo-lm-eval ...` (inference/lm_eval_cli.py; the class is registered already by this import)."""
    from attnzoo.inference.lm_eval_cli import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
