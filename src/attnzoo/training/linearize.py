"""Linearizing a pretrained Transformer (`experiment=linearize`): swap softmax-attention layers of an imported
model for linear-time mixers and distill them from the original, which stays frozen as the teacher.

    attnzoo-train experiment=linearize 'model.init_from="DIR"' linearize.mixer=gated_deltanet linearize.layers=[1,3]

The recipe is LoLCATs' (Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language Models"):

  plan     `apply_linearize` turns the imported model section (the teacher, from config.json) into the
           student's: the same model with the chosen layers' mixer replaced (`linearize.layers` + `mixer`, or
           `model.pattern`, whose entries other than the teacher's mixer name the replacement), `name: linearize`
  init     the student starts as a copy of the teacher; each new mixer takes the attention's q/k/v/o projections
           where the shapes allow (`copy_plan`; k/v heads repeated over their GQA group), its short conv set to
           the identity, everything else (beta, gates, decay, output norm) at the mixer's own init
  stage 1  attention transfer: per replaced layer, MSE between the new mixer's output and the teacher's
           attention output on the teacher's own layer input (teacher-forced, layers independent); only the
           new mixers receive gradients. Logged: linearize/mse_layer<i>, linearize/mse (their mean)
  stage 2  end to end: KL(teacher || student) on the next-token distributions (+ ce_weight x cross-entropy on
           the data); the student's layers all train (stage2_train=all) or the new ones only (linear).
           Logged: linearize/kl, linearize/ce, train/loss
  eval     the student's val/loss and val/ppl as any LM run; linearize/val_kl = KL(teacher || student) per
           token on the validation batches (what the distillation optimises, held out); the teacher's
           val/loss_teacher once (first validation), then repeated beside val/loss in every row and summary.json

The trained run is an ordinary decoder LM (a hybrid `pattern`): attnzoo.load, attnzoo-eval and attnzoo-generate
read it; checkpoints hold the student only (the teacher is re-read from model.init_from on resume).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from attnzoo.config.schema import _merge, parse_pattern, resolve_model
from attnzoo.config.errors import ConfigError, check, check_choice
from attnzoo.config.registry import MIXERS
from attnzoo.training.lit_lm import LitLM
from attnzoo.training.schedules import lr_lambda
from attnzoo.models.decoder import DecoderLM

COPY_MODES = ("required", "where_possible", "none")
PARTS = ("q", "k", "v", "o")


@dataclass
class LinearizeConfig:
    mixer: str = "linear_attention"  # linear_attention | deltanet | gated_deltanet
    mixer_options: Dict[str, Any] = field(default_factory=dict)  # that mixer's config keys (e.g. feature_map)
    layers: Optional[List[int]] = None  # layer indices to replace; null: model.pattern's, else every layer
    copy_weights: str = "required"  # q/k/v/o from the attention: required (refuse if not) | where_possible | none
    stage1_steps: int = 100  # attention transfer (per-layer MSE)
    stage2_steps: int = 100  # end-to-end distillation (KL + ce_weight CE)
    stage1_lr: Optional[float] = None  # null: optim.lr
    stage2_lr: Optional[float] = None  # null: optim.lr
    stage2_train: str = "all"  # all: every student parameter in stage 2 | linear: the new mixers only
    kl_weight: float = 1.0
    ce_weight: float = 0.0

    def validate(self) -> None:
        check(self.mixer in targets(), "linearize.mixer",
              f"unknown target mixer {self.mixer!r}; allowed: {', '.join(targets())}")
        check_choice(self.copy_weights, "linearize.copy_weights", COPY_MODES)
        check_choice(self.stage2_train, "linearize.stage2_train", ("all", "linear"))
        check(self.stage1_steps >= 0 and self.stage2_steps >= 0 and self.stage1_steps + self.stage2_steps > 0,
              "linearize.stage1_steps", f"stage1_steps={self.stage1_steps}, stage2_steps={self.stage2_steps}; "
              f"allowed: both >= 0, at least one > 0")
        for name in ("stage1_lr", "stage2_lr"):
            lr = getattr(self, name)
            check(lr is None or lr > 0, f"linearize.{name}", f"must be positive or null (optim.lr), got {lr}")
        check(self.kl_weight >= 0 and self.ce_weight >= 0 and self.kl_weight + self.ce_weight > 0,
              "linearize.kl_weight", f"kl_weight={self.kl_weight}, ce_weight={self.ce_weight}; allowed: both >= 0, "
              f"one > 0")


def targets() -> list[str]:
    """The mixers an attention layer can become: their class is a `linearize_target` (a fixed-size state)."""
    return [n for n in MIXERS.names() if MIXERS.get(n).cls.linearize_target]


def sources() -> list[str]:
    """The layers whose q/k/v/o can seed a target: their class is a `linearize_source` (softmax attention)."""
    return [n for n in MIXERS.names() if MIXERS.get(n).cls.linearize_source]


def options(node: Any) -> LinearizeConfig:
    """The typed, checked `linearize` section (one-line ConfigError naming the key)."""
    opts = _merge(LinearizeConfig, node, "linearize")
    opts.validate()
    return opts


def teacher_section(model_section: dict) -> dict:
    """The imported model itself: the student's section without its layer plan."""
    return {**model_section, "name": "decoder", "pattern": None, "mixers": {}}


# ----------------------------------------------------------------------------- the plan (config time)


def _student_mixer(name: str, extra: dict, teacher) -> dict:
    """A linear mixer sized like the teacher's attention (heads, head_dim), so q/k/v/o copy over; `extra`
    (linearize.mixer_options or a model.mixers entry) wins."""
    sizes = MIXERS.get(name).cls.linearize_sizes(teacher.n_heads, teacher.head_dim)
    return {**sizes, **extra, "name": name}


def plan_layers(section: dict, opts: LinearizeConfig) -> dict[int, tuple[str, dict]]:
    """{layer index: (pattern key, mixer config)} of the layers to replace, from linearize.layers or
    model.pattern (one-line refusals: out of range, unknown mixer, a layer that is not softmax attention)."""
    teacher = resolve_model(teacher_section(section))
    n, tname = teacher.n_layers, teacher.mixer.name
    pattern, named = parse_pattern(section.get("pattern")), dict(section.get("mixers") or {})
    if opts.layers is not None and pattern is not None:
        raise ConfigError("is set and so is model.pattern, and both choose the layers to replace; allowed: one of them",
                          field="linearize.layers")
    plan: dict[int, tuple[str, dict]] = {}
    if pattern is None:
        layers = range(n) if opts.layers is None else list(opts.layers)
        bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < n)]
        if bad:
            raise ConfigError(f"layer {bad[0]} is out of range; allowed: 0..{n - 1} (the model has {n} layers)",
                              field="linearize.layers")
        plan = {i: (opts.mixer, _student_mixer(opts.mixer, dict(opts.mixer_options), teacher)) for i in sorted(set(layers))}
    else:
        if n % len(pattern):
            raise ConfigError(f"length {len(pattern)} does not divide n_layers={n}", field="model.pattern")
        for i in range(n):
            key = pattern[i % len(pattern)]
            if key == tname:
                continue
            given = dict(named.get(key) or {})
            name = given.pop("name", key)
            if name not in targets():
                raise ConfigError(f"unknown target mixer {key!r} for layer {i}; allowed: {tname} (kept), "
                                  f"{', '.join(targets())}, or a model.mixers entry naming one", field="model.pattern")
            plan[i] = (key, _student_mixer(name, {**dict(opts.mixer_options), **given}, teacher))
    if not plan:
        raise ConfigError(f"replaces no layer (every entry is the teacher's {tname}); allowed: a linear mixer "
                          f"({', '.join(targets())}) somewhere", field="model.pattern")
    if not MIXERS.get(tname).cls.linearize_source:
        raise ConfigError(f"the imported model's layers are {tname}, not softmax attention; allowed: a model with "
                          f"{', '.join(sources())} layers", field="model.init_from")
    return plan


def student_section(section: dict, opts: LinearizeConfig) -> dict:
    """The imported model's section with the planned layers replaced: `name: linearize`, a per-layer pattern."""
    teacher = teacher_section(section)
    tname = resolve_model(teacher).mixer.name
    plan = plan_layers(section, opts)
    n = teacher["n_layers"]
    pattern = [plan[i][0] if i in plan else tname for i in range(n)]
    mixers = {key: mc for key, mc in plan.values()}
    return {**teacher, "name": "linearize", "pattern": pattern, "mixers": mixers}


def apply_linearize(cfg: DictConfig) -> DictConfig:
    """experiment=linearize: the run's model section becomes the student's (a copy of `cfg`; no `linearize`
    section: `cfg` itself). Needs model.init_from (applied first, by attnzoo.interop.hf.apply_init_from); sets
    trainer.max_steps = stage1_steps + stage2_steps (a smaller trainer.max_steps, e.g. debug=smoke's, caps
    the run: see fit_stages); refuses shapes that cannot be copied when
    linearize.copy_weights=required."""
    from omegaconf import open_dict

    node = OmegaConf.select(cfg, "linearize")
    if node is None:
        return cfg
    opts = options(node)
    section = OmegaConf.to_container(cfg.model, resolve=True)
    if not section.get("init_from"):
        raise ConfigError("experiment=linearize needs a pretrained model to linearize; allowed: "
                          "model.init_from=<local transformers model dir>", field="model.init_from")
    if section.get("name") != "linearize":  # not yet planned (a planned one: a DDP worker's, a resumed run's)
        section = student_section(section, opts)
    if opts.copy_weights == "required":
        check_copyable(section)
    s1, s2 = fit_stages(opts.stage1_steps, opts.stage2_steps, OmegaConf.select(cfg, "trainer.max_steps"))
    out = cfg.copy()
    with open_dict(out):
        out.model = OmegaConf.create(section)
        out.linearize.stage1_steps, out.linearize.stage2_steps = s1, s2
        out.trainer.max_steps = s1 + s2
    return out


def fit_stages(stage1: int, stage2: int, max_steps: int | None) -> tuple[int, int]:
    """The two stages' steps in a run of at most `max_steps` (None: no cap, the run is stage1 + stage2 long).
    A cap set after the experiment (debug=smoke's few steps, or trainer.max_steps=N) shortens both stages in
    proportion, each stage that had steps keeping at least one; a cap the stages already fit changes nothing.
    Invalid values are left for validate() to refuse."""
    total = stage1 + stage2
    if max_steps is None or not 0 < max_steps < total or stage1 < 0 or stage2 < 0:
        return stage1, stage2
    s1 = round(max_steps * stage1 / total)
    if stage1 and stage2 and max_steps >= 2:
        s1 = min(max(s1, 1), max_steps - 1)
    return s1, max_steps - s1


# ----------------------------------------------------------------------------- initialising from attention


def replaced_layers(student: DecoderLM, teacher: DecoderLM) -> list[int]:
    return [i for i, (s, t) in enumerate(zip(student.layer_mixers, teacher.layer_mixers)) if s.name != t.name]


def copy_plan(attn, linear) -> tuple[list[str], dict[str, str]]:
    """Which of q, k, v, o an attention layer can hand to a linear mixer as they are (k/v heads repeated over
    their query group): (copied parts, {part: why not})."""
    if not attn.linearize_source:
        return [], {p: f"the layer is {attn.cfg.name}, not softmax attention" for p in PARTS}
    H, D = attn.n_heads, attn.head_dim
    skip: dict[str, str] = {}
    if (linear.n_qk_heads, linear.qk_dim) != (H, D):
        why = f"{linear.n_qk_heads} heads x {linear.qk_dim} vs the attention's {H} x {D}"
        skip.update(q=why, k=why)
    if (linear.n_v_heads, linear.v_dim) != (H, D):
        why = f"{linear.n_v_heads} value heads x {linear.v_dim} vs the attention's {H} x {D}"
        skip.update(v=why, o=why)
    if attn.qkv.bias is not None:
        for p in ("q", "k", "v"):
            skip.setdefault(p, "the attention's q/k/v biases have no place in the bias-free projection")
    if attn.o_proj.bias is not None:
        skip.setdefault("o", "the attention's output bias has no place in the bias-free projection")
    if getattr(attn, "q_norm", None) is not None:  # qk_norm (Qwen3): the copies would lose the norms' weights
        for p in ("q", "k"):
            skip.setdefault(p, "the attention's q/k RMSNorm (qk_norm) has no counterpart in the linear mixer")
    if getattr(attn, "gate_proj", None) is not None:  # output_gate: o_proj reads sigmoid-gated heads there
        skip.setdefault("o", "the attention's sigmoid output gate (output_gate) has no counterpart")
    return [p for p in PARTS if p not in skip], skip


def _meta_layer(mixer_cfg, model_cfg, i: int):
    from attnzoo.config.registry import MIXERS

    with torch.device("meta"):  # shapes only, nothing allocated
        return MIXERS.get(mixer_cfg.name).cls(mixer_cfg, model_cfg, i)


def check_copyable(section: dict) -> None:
    """copy_weights=required: every replaced layer takes all of q, k, v, o (one line naming the first that cannot)."""
    from attnzoo.config.schema import layer_mixer_configs

    student, teacher = resolve_model(section), resolve_model(teacher_section(section))
    for i, (s, t) in enumerate(zip(layer_mixer_configs(student), layer_mixer_configs(teacher))):
        if s.name == t.name:
            continue
        _, skip = copy_plan(_meta_layer(t, teacher, i), _meta_layer(s, student, i))
        if skip:
            part, why = next(iter(skip.items()))
            raise ConfigError(f"layer {i}: {part}_proj cannot be copied into {s.name} ({why}); allowed: "
                              f"linearize.copy_weights=where_possible (copies what fits) or none, or sizes that "
                              f"match (linearize.mixer_options)", field="linearize.copy_weights")


def _repeat_heads(w: torch.Tensor, n_kv: int, group: int) -> torch.Tensor:
    """(n_kv * D, ...) rows -> (n_kv * group * D, ...): each kv head repeated for the query heads it serves."""
    return w.view(n_kv, -1, *w.shape[1:]).repeat_interleave(group, dim=0).reshape(-1, *w.shape[1:])


@torch.no_grad()
def init_from_attention(linear, attn, mode: str) -> list[str]:
    """Copy the attention's projections into the linear mixer (what fits, or nothing for mode=none); its short
    conv becomes the identity (current-token tap 1) so the copied projections reach the recurrence as they
    are. Returns the parts copied."""
    if mode == "none":
        return []
    copied, _ = copy_plan(attn, linear)
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
    full = {"q": q, "k": _repeat_heads(k, Hkv, H // Hkv), "v": _repeat_heads(v, Hkv, H // Hkv)}
    dq, dk, dv = linear.qkv.weight.split(linear.qkv_dims, dim=0)
    for part, dst in (("q", dq), ("k", dk), ("v", dv)):
        if part in copied:
            dst.copy_(full[part])
    if "o" in copied:
        linear.o_proj.weight.copy_(attn.o_proj.weight)
    if copied and linear.conv is not None:
        linear.conv.weight.zero_()
        linear.conv.weight[:, -1] = 1.0
        if linear.conv.bias is not None:
            linear.conv.bias.zero_()
    return copied


# ----------------------------------------------------------------------------- training


class LitLinearize(LitLM):
    """The student (`self.model`, the run's model section) distilled from the frozen teacher (`self.teacher`,
    the imported model, built by `load_pretrained`). Validation and checkpoints are LitLM's, for the student."""

    def __init__(self, cfg: dict, vocab_size: int, model_cfg: Any = None):
        super().__init__(cfg, vocab_size, model_cfg)
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        self.opts = options(cfg.get("linearize") or {})
        self.teacher_cfg = resolve_model(teacher_section(cfg["model"]), vocab_size=vocab_size)
        self.teacher: Optional[DecoderLM] = None  # built and loaded by load_pretrained (training only)
        self.layers: list[int] = []
        self.copied: dict[int, list[str]] = {}
        self._teacher_val: Optional[torch.Tensor] = None  # validation sums (on_validation_epoch_start)
        self._teacher_loss: Optional[torch.Tensor] = None  # the teacher's val/loss, from the first validation

    # ------------------------------------------------------------------ teacher and student weights
    def load_pretrained(self, load, resuming: bool = False) -> None:
        """`load(module)` fills a DecoderLM with the imported weights: the teacher always; the student from it,
        unless a checkpoint is about to give the student its own weights."""
        teacher = DecoderLM(self.teacher_cfg)
        load(teacher)
        self.teacher = teacher.requires_grad_(False).eval()
        self.layers = replaced_layers(self.model, teacher)
        if not resuming:
            self.init_student()
        if self.opts.stage2_train == "linear":  # the optimizer (built at fit start) then holds the new mixers only
            self.model.requires_grad_(False)
            for i in self.layers:
                self.model.blocks[i].mixer.requires_grad_(True)

    @torch.no_grad()
    def init_student(self) -> None:
        """Every tensor the two models share (embedding, norms, FFNs, the layers kept) from the teacher; the
        replaced layers' mixers from their attention (init_from_attention)."""
        t_sd, s_sd = self.teacher.state_dict(), self.model.state_dict()
        for k, v in s_sd.items():
            if k in t_sd and t_sd[k].shape == v.shape and not any(k.startswith(f"blocks.{i}.mixer.") for i in self.layers):
                v.copy_(t_sd[k])
        for i in self.layers:
            self.copied[i] = init_from_attention(self.model.blocks[i].mixer, self.teacher.blocks[i].mixer,
                                                 self.opts.copy_weights)

    def summary_sections(self) -> dict:
        """What was linearized (summary.json's `linearize`)."""
        return {"linearize": {"layers": self.layers, "mixers": [self.model.layer_mixers[i].name for i in self.layers],
                "copied": {str(i): parts for i, parts in self.copied.items()},
                "stage1_steps": self.opts.stage1_steps, "stage2_steps": self.opts.stage2_steps,
                "teacher_params": None if self.teacher is None else self.teacher.num_params()}}

    def train(self, mode: bool = True):
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()  # frozen: no dropout, whatever Lightning asks of the student
        return self

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The student only: the teacher is model.init_from's, read again on resume."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("teacher.")}

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        if self.teacher is not None:  # a resumed run: the teacher is already loaded, checkpoints leave it out
            state_dict = {**{f"teacher.{k}": v for k, v in self.teacher.state_dict().items()}, **state_dict}
        return super().load_state_dict(state_dict, strict=strict, **kwargs)

    # ------------------------------------------------------------------ losses
    def _teacher_mixer_io(self, x: torch.Tensor) -> dict[int, tuple]:
        """Teacher forward with hooks: {layer: (mixer input, positions, mixer output)} of the replaced layers."""
        seen: dict[int, tuple] = {}

        def hook(i):
            return lambda mod, args, kwargs, out: seen.__setitem__(i, (args[0], kwargs["positions"], out))

        handles = [self.teacher.blocks[i].mixer.register_forward_hook(hook(i), with_kwargs=True) for i in self.layers]
        try:
            with torch.no_grad():
                self.teacher(x)
        finally:
            for h in handles:
                h.remove()
        return seen

    def attention_transfer(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Stage 1: mean over replaced layers of MSE(student mixer(teacher's layer input), teacher's attention
        output); returns (loss, {layer: mse})."""
        mse = {}
        for i, (inp, positions, out) in self._teacher_mixer_io(x).items():
            y = self.model.blocks[i].mixer(inp, positions=positions)
            mse[i] = F.mse_loss(y.float(), out.float())
        return torch.stack(list(mse.values())).mean(), mse

    def distillation(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 2: kl_weight KL(teacher || student) per token + ce_weight CE; returns (loss, kl, ce)."""
        x = batch[0]
        ce, _, _, logits = self._loss(batch, return_logits=True)
        with torch.no_grad():
            t_logp = F.log_softmax(self.teacher(x).float(), dim=-1)
        s_logp = F.log_softmax(logits.float(), dim=-1)
        kl = F.kl_div(s_logp.flatten(0, -2), t_logp.flatten(0, -2), log_target=True, reduction="batchmean")
        return self.opts.kl_weight * kl + self.opts.ce_weight * ce, kl, ce

    def training_step(self, batch, batch_idx: int):
        if self.global_step < self.opts.stage1_steps:
            loss, mse = self.attention_transfer(batch[0])
            for i, v in mse.items():
                self.log(f"linearize/mse_layer{i}", v)
            self.log("linearize/mse", loss)
            stage2 = False
        else:
            loss, kl, ce = self.distillation(batch)
            self.log("linearize/kl", kl)
            self.log("linearize/ce", ce)
            stage2 = True
        if not self._guard_loss(loss):
            return None
        self.log("train/loss", loss, prog_bar=True)
        return self._with_aux(loss) if stage2 else loss  # a routed FFN balances when the student runs whole

    # ------------------------------------------------------------------ validation: KL to the teacher; its loss once
    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        # [KL summed over tokens, tokens, teacher's summed loss, its counted positions]
        self._teacher_val = torch.zeros(4, device=self.device, dtype=torch.float64)

    def validation_step(self, batch, batch_idx: int):
        logits = super().validation_step(batch, batch_idx)
        if self.teacher is None:  # a loaded run (attnzoo.load): the student alone
            return logits
        with torch.no_grad():
            t_logits = self.teacher(batch[0])
        t_logp, s_logp = F.log_softmax(t_logits.float(), -1), F.log_softmax(logits.float(), -1)
        sums = [(t_logp.exp() * (t_logp - s_logp)).sum(), batch[1].numel(), 0.0, 0.0]
        if self._teacher_loss is None:  # the teacher's loss: first validation only
            _, sums[2], sums[3] = self._loss(batch, logits=t_logits)
        self._teacher_val += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in sums])
        return logits

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.teacher is None:
            return
        kl, tokens, total, count = self._reduce(self._teacher_val)
        self.log("linearize/val_kl", (kl / tokens.clamp_min(1)).float(), sync_dist=False)
        if self._teacher_loss is None:
            self._teacher_loss = (total / count.clamp_min(1)).float()
        self.log("val/loss_teacher", self._teacher_loss, sync_dist=False)

    # ------------------------------------------------------------------ one schedule per stage
    def lr_multiplier(self):
        """The schedule restarts at stage 2 (warmup, then decay over each stage's own steps), scaled to
        linearize.stage1_lr / stage2_lr where set (the optimizer's lr is optim.lr)."""
        base, s1, s2, d = self.optim_cfg.lr, self.opts.stage1_steps, self.opts.stage2_steps, self.model.cfg.d_model
        f1, f2 = lr_lambda(self.sched_cfg, s1, d), lr_lambda(self.sched_cfg, s2, d)
        m1, m2 = (self.opts.stage1_lr or base) / base, (self.opts.stage2_lr or base) / base
        return lambda s: m1 * f1(s) if s < s1 else m2 * f2(s - s1)
