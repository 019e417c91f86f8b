"""LightningModule for language modelling: loss, metrics, optimizer groups, LR schedules."""
from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from attnzoo.layers import aux_loss as hooks

from attnzoo.distributed import context_parallel as parallel
from attnzoo.config.schema import OptimConfig, SchedulerConfig, resolve_model
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.cross_entropy import chunked_cross_entropy
from attnzoo.ops.packing import Documents
from attnzoo.distributed.fsdp import is_sharded, shard_model
from attnzoo.training.fsdp import FSDPStrategy
# param_groups and fused_adamw are imported from here by tests and benchmarks
from attnzoo.training.optimizers import build_optimizer, fused_adamw, param_groups  # noqa: F401
from attnzoo.training.schedules import lr_lambda, schedule_digest

log = logging.getLogger("attnzoo")
# validation metrics are reduced exactly (token-weighted all_gather) in on_validation_epoch_end
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*")


def rng_states() -> dict:
    """The global random generators (python, numpy, torch CPU and CUDA) in types `torch.load(weights_only=True)`
    reads back: tensors, ints, floats."""
    import random

    import numpy as np

    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": {"version": version, "state": torch.tensor(state, dtype=torch.int64), "gauss": gauss},
           "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                     "cached": float(cached)},
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    py = states["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = states["numpy"]
    np.random.set_state(("MT19937", nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["cached"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        # saved: one state per GPU the saving process saw; restored onto the GPUs this one sees (a run saved on 8
        # resumes on 1: the first state goes to cuda:0, the rest are left; GPUs beyond the saved keep their seed)
        for index, state in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN/inf (on_nonfinite=stop)."""


class TrainingModule(L.LightningModule):
    """What every attnzoo LightningModule shares: optimizer + schedule from the run config, the
    non-finite-loss policy, and exact reduction of summed validation statistics across ranks.
    Subclasses set `self.model` (with `cfg.d_model`) and call `_setup_training(cfg)` in `__init__`."""

    def _setup_training(self, cfg: dict, default_scheduler: dict | None = None) -> None:
        self.optim_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), cfg.get("optim", {})))
        sched = cfg.get("scheduler") or default_scheduler or {}
        self.sched_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SchedulerConfig), sched))
        # null with a token / FLOP budget: training/build.resolve_run_length sets the steps once the model is built
        self.max_steps = int(cfg.get("trainer", {}).get("max_steps") or 1000)
        self.on_nonfinite = cfg.get("on_nonfinite", "stop")
        self.skipped_steps = 0
        self._pending = None  # (finite flag, loss, step) of the last step, checked one step later on GPU

    def _guard_loss(self, loss: torch.Tensor) -> bool:
        """Apply `on_nonfinite`; False means: skip this optimizer step (return None from training_step)."""
        if self.on_nonfinite == "stop" and loss.device.type != "cpu":
            # GPU: no host sync in the hot path; check the previous step's flag (its kernels are done by now)
            self._check_deferred()
            self._pending = (torch.isfinite(loss.detach()), loss.detach(), self.global_step)
        elif self.on_nonfinite != "ignore" and not torch.isfinite(loss):  # CPU (free) or skip mode
            if self.on_nonfinite == "skip":
                self.skipped_steps += 1
                log.warning("non-finite training loss at step %d: step skipped", self.global_step)
                return False
            self._raise_nonfinite(loss, self.global_step)
        return True

    def _raise_nonfinite(self, loss: torch.Tensor, step: int) -> None:
        raise NonFiniteLossError(
            f"non-finite training loss ({loss.item()}) at step {step}; "
            f"lower optim.lr, or set on_nonfinite=skip to skip such steps"
        )

    def _check_deferred(self) -> None:
        if self._pending is not None:
            finite, loss, step = self._pending
            self._pending = None
            if not bool(finite):
                self._raise_nonfinite(loss, step)

    def on_train_end(self) -> None:
        self._check_deferred()

    # ------------------------------------------------------------------ stateful submodules (MoE)
    def _with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """Log the model's submodule stats and add their auxiliary losses (MoE balancing) to the training
        loss, for every model family: a routed FFN inside an encoder-decoder balances like one in a decoder."""
        for name, value in hooks.stats(self.model).items():
            self.log(name, value)
        aux = hooks.aux_loss(self.model)
        return loss if aux is None else loss + aux

    def finish_training_step(self, loss: torch.Tensor, logged: torch.Tensor | None = None):
        """The end of every family's training_step: the non-finite-loss policy (None: Lightning skips the
        optimizer step), `train/loss` (`logged` when the value to report differs from the one to backpropagate),
        and the submodules' auxiliary losses."""
        if not self._guard_loss(loss):
            return None
        # the mean over data-parallel ranks (what their averaged gradient descends), not rank 0's share alone
        self.log("train/loss", loss if logged is None else logged, prog_bar=True,
                 sync_dist=self._trainer is not None and self.trainer.world_size > 1)
        return self._with_aux(loss)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Submodules whose training depends on the step (DSA's dense warm-up) learn it before each batch."""
        hooks.set_train_step(self.model, self.global_step)

    def on_before_optimizer_step(self, optimizer) -> None:
        """A step that submodules restrict (DSA's frozen warm-up: layers/aux_loss.trains_only) updates only their
        parameters: every other gradient is dropped (None) before clipping and the step, so AdamW and Muon leave those
        parameters, their weight decay and their optimizer state untouched. The gradients were still computed (and,
        under DDP, reduced): the reducer expects one for every parameter."""
        only = hooks.trains_only(self.model)
        if only is not None:
            keep = {id(p) for p in only}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in keep:
                        p.grad = None
        self._frozen_step = only is not None

    def optimizer_step(self, *args, **kwargs) -> None:
        """After each optimizer step (not each micro-batch), let submodules update their own state (MoE
        aux-loss-free bias). Done here rather than in on_train_batch_end so the update lands *before* the
        checkpoint callbacks of the same step: a checkpoint then holds the bias the next step will use. Not after a
        restricted step (on_before_optimizer_step): a frozen model keeps its state too."""
        self._frozen_step = False
        super().optimizer_step(*args, **kwargs)
        if not self._frozen_step:
            hooks.after_optimizer_step(self.model)

    def configure_model(self) -> None:
        """trainer.strategy=fsdp: shard the model in place (training/fsdp.py), once; nothing for other strategies."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDPStrategy) and not is_sharded(self.model):
            shard_model(self.model, strategy.device_mesh["data_parallel"], strategy.fsdp_cfg)
            self.after_shard()

    def after_shard(self) -> None:
        """After `shard_model`: a subclass re-binds what it holds of the model's methods (FSDP wrapped them)."""

    # ------------------------------------------------------------------ random state
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The random generators go into every checkpoint (Lightning keeps none): dropout masks, MLM masking
        and anything else drawing from the global generators continue after a resume as without it."""
        checkpoint["rng_states"] = rng_states()
        checkpoint["lr_schedule"] = self.schedule_record(int(self.trainer.global_step) if self._trainer else 0)

    def schedule_record(self, steps: int) -> dict:
        """What the learning rates of the steps taken so far were (a resume whose schedule gives those steps other
        rates is refused: training/build.check_schedule_continues)."""
        return {"steps": steps, "max_steps": int(self.max_steps), "scheduler": self.sched_cfg.name,
                "digest": schedule_digest(self.lr_multiplier(), steps)}

    def on_train_start(self) -> None:
        """Each group's learning rate from this run's schedule at the step training starts: a resume gets the rate it
        had, and a cooldown branched from a stable run's checkpoint (whose optimizer state holds the stable run's
        rate) its own decay's from the first step on."""
        for sched in self.trainer.lr_scheduler_configs:
            scheduler = sched.scheduler
            if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                for group, f, base in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs):
                    group["lr"] = base * f(scheduler.last_epoch)  # LambdaLR's own formula

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_states" in checkpoint:  # checkpoints written before the states were saved: seeded state kept
            set_rng_states(checkpoint["rng_states"])

    def _reduce(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum a vector of validation statistics over all ranks."""
        if self.trainer.world_size > 1:
            # every rank's vector, summed in rank order (the same on all ranks); torch.distributed.all_gather
            # itself, not LightningModule.all_gather, whose torch.distributed.nn.functional.all_gather (autograd
            # through the gather, not needed here) is deprecated
            import torch.distributed as dist

            gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, stats.contiguous())
            return torch.stack(gathered).sum(0)
        return stats

    def configure_optimizers(self) -> Any:
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        opt = build_optimizer(self.model, self.optim_cfg, precision)  # optim.name: adamw | muon (training/optimizers.py)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_multiplier())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """trainer.gradient_clip_val, also with fused AdamW under bf16-mixed (fused_adamw): Lightning's mixed
        precision refuses to clip for an optimizer that unscales inside its step, which only matters with a
        GradScaler (16-mixed); bf16 has none, so its gradients are clipped here as under full precision."""
        plugin = self.trainer.precision_plugin
        if getattr(plugin, "scaler", "none") is None and getattr(optimizer, "_step_supports_amp_scaling", False):
            from lightning.pytorch.plugins.precision import Precision
            from lightning.pytorch.utilities import GradClipAlgorithmType

            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val or 0.0, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def lr_multiplier(self):
        """Optimizer step -> multiplier on optim.lr (scheduler.*; a subclass may shape it differently)."""
        return lr_lambda(self.sched_cfg, self.max_steps, self.model.cfg.d_model)

    def summary_sections(self) -> dict:
        """Extra top-level sections for summary.json (none here)."""
        return {}

    def load_pretrained(self, load, resuming: bool = False) -> None:
        """model.init_from: `load(module)` fills a DecoderLM with the imported weights. Here: the model, unless a
        checkpoint is about to give it its own (a subclass may load more, e.g. a frozen teacher, every time)."""
        if not resuming:
            load(self.model)


class LitLM(TrainingModule):
    """Next-token prediction (teacher forcing) on batches (x, y) or (x, y, loss_mask).

    Args:
        cfg: the whole resolved run config (a plain dict or DictConfig; saved as hyper-parameters so a
            checkpoint rebuilds its model). Reads `model`, `optim`, `scheduler` and `trainer`
            (`context_parallel`, `context_parallel_layout`, `activation_checkpointing`, `ce_chunk_tokens`,
            `on_nonfinite`).
        vocab_size: the data module's vocabulary (the embedding and head size).
        model_cfg: the typed model config `train()` resolved once; None: resolved here from cfg["model"]
            (e.g. by load_from_checkpoint).
    Batches: x, y (B, T) int64 token ids (y is x shifted by one), optional loss_mask (B, T) bool; packed
    batches carry their `Documents`. Refused (ConfigError, one line naming the field): a model section
    `resolve_model` rejects, a context-parallel layout the layers cannot run.
    """

    def __init__(self, cfg: dict, vocab_size: int, model_cfg: Any = None):
        super().__init__()
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        # in the checkpoint (hyper_parameters), not the loggers: training/run.py logs the flattened config to each
        # logger once; Lightning's own copy (the nested cfg again) was written at fit and again at the final
        # validation (~0.06 s each through OmegaConf's YAML on a smoke run: a fifth of its wall time)
        self.save_hyperparameters({"cfg": cfg, "vocab_size": vocab_size}, logger=False)
        self.model = DecoderLM(model_cfg if model_cfg is not None else resolve_model(cfg["model"]), vocab_size=vocab_size)
        self._setup_training(cfg)
        self._val = None
        self._val_has_mask = False
        trainer_cfg = cfg.get("trainer") or {}
        self.cp_size = int(trainer_cfg.get("context_parallel", 1) or 1)  # trainer.context_parallel
        self._cp_layout = parallel.resolve_layout(trainer_cfg.get("context_parallel_layout", "auto"),
                                                  [m.name for m in self.model.layer_mixers])
        self._cp_group, self._cp = None, {}  # the group (setup) and one ContextParallel per sequence length
        # memory (docs/benchmarks.md#memory-activation-checkpointing-and-chunked-cross-entropy): blocks recomputed in
        # backward; the training loss from the hidden states, ce_chunk_tokens tokens at a time (0: full logits)
        self.model.activation_checkpointing = bool(trainer_cfg.get("activation_checkpointing", False))
        self.ce_chunk_tokens = int(trainer_cfg.get("ce_chunk_tokens", 0) or 0)
        # the (optionally compiled) callables used by the training/validation steps (logits; final hidden states);
        # not submodules
        object.__setattr__(self, "_fwd", self.model)
        object.__setattr__(self, "_hidden", self.model.hidden_states)

    def after_shard(self) -> None:
        """FSDP registered `hidden_states` as a forward method (distributed/fsdp.py): the training callables bound
        before must call the wrapped one (compiled again when they were compiled)."""
        if self._fwd is not self.model:
            self.compile_model()
        else:
            object.__setattr__(self, "_hidden", self.model.hidden_states)

    def compile_model(self, **kwargs) -> None:
        """torch.compile the training forward; generation and caches keep the eager model. The compiled
        wrapper is not registered as a submodule, so checkpoints hold the plain `model.*` weights."""
        object.__setattr__(self, "_fwd", torch.compile(self.model, **kwargs))
        object.__setattr__(self, "_hidden", torch.compile(self.model.hidden_states, **kwargs))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # ------------------------------------------------------------------ context parallelism (parallel.py)
    def setup(self, stage: str) -> None:
        """trainer.context_parallel > 1: split the world into DP x CP groups (after the process group exists)."""
        if self.cp_size > 1 and self._cp_group is None:
            self._cp_group = parallel.init_groups(self.cp_size)

    def context(self, seq_len: int):
        """This rank's ContextParallel for sequences of `seq_len` tokens (None without context parallelism)."""
        if self._cp_group is None:
            return None
        if seq_len not in self._cp:
            self._cp[seq_len] = parallel.ContextParallel(self._cp_group, parallel.check_layout(
                seq_len, self.cp_size, self._cp_layout))
        return self._cp[seq_len]

    def tokens_in_batch(self, batch) -> int:
        """Real tokens this rank processed (its shard of each sequence; padding not counted: a batch's token_mask),
        for perf/tokens_per_sec."""
        if len(batch) > 3:
            return int(batch[3].sum()) // self.cp_size
        return batch[0].numel() // self.cp_size

    def _loss(self, batch, return_logits: bool = False, logits: torch.Tensor | None = None):
        """Mean cross-entropy over counted positions; returns (loss, summed loss, count[, logits]).
        `logits`: computed elsewhere (e.g. through a quantized KV cache) instead of by the training forward.

        A batch is (x, y), (x, y, loss_mask), (x, y, loss_mask, token_mask) or (x, y, loss_mask, token_mask,
        doc_ids): with a loss mask only its True positions count (synthetic tasks: the answer positions);
        token_mask marks real (non-padding) tokens for routed FFNs' balancing (default: all tokens are real);
        doc_ids (B, T) mark packed documents (data.packing: each computed as if alone, packing.py).
        With trainer.ce_chunk_tokens > 0 and no logits asked for (the training step), the loss comes from the final
        hidden states chunk by chunk (ops/cross_entropy.py) and the (B, T, V) logits are never made."""
        cp = self.context(batch[0].shape[1]) if logits is None else None
        if cp is not None:
            batch = self.shard_batch(batch)
        x, y = batch[0], batch[1]
        mask = batch[2] if len(batch) > 2 else None
        token_mask = batch[3] if len(batch) > 3 else None
        chunked = self.ce_chunk_tokens > 0 and logits is None and not return_logits
        run = self._hidden if chunked else self._fwd
        if cp is not None:  # this rank's shard of every sequence; the loss is normalised by the group's count
            with parallel.sharded(cp):
                out = run(x, positions=cp.layout.positions(cp.rank, x.device), token_mask=token_mask)
        elif logits is None:
            out = run(x, token_mask=token_mask, documents=Documents(batch[4]) if len(batch) > 4 else None)
        if chunked:
            total = chunked_cross_entropy(out, self.model.lm_head.weight, y, mask, chunk_tokens=self.ce_chunk_tokens)
            count = torch.as_tensor(y.numel() if mask is None else mask.sum(), device=y.device).to(total.dtype)
        else:
            logits = out if logits is None else logits
            ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
            if mask is not None:
                m = mask.reshape(-1).to(ce.dtype)
                total, count = (ce * m).sum(), m.sum()
            else:
                total, count = ce.sum(), torch.tensor(float(ce.numel()), device=ce.device)
        if cp is None:
            loss = total / count.clamp_min(1)
        else:
            # DDP averages gradients over all DP x CP ranks: (1/CP) sum_r CP * grad(total_r) / count_group is the
            # gradient of the group's mean loss, whatever share of the counted positions each rank holds
            counts = torch.stack([total.detach(), count]).double()
            torch.distributed.all_reduce(counts, group=cp.group)
            loss = total / counts[1].clamp_min(1).to(total.dtype) * cp.size
            self._group_loss = (counts[0] / counts[1].clamp_min(1)).float()
        return (loss, total.detach(), count, logits) if return_logits else (loss, total.detach(), count)

    def shard_batch(self, batch):
        """The batch as this rank sees it (its shard of each sequence under context parallelism): what
        per-position metrics compare the logits with."""
        cp = self.context(batch[0].shape[1])
        if cp is None:
            return batch
        return tuple(cp.layout.shard(t, cp.rank) if torch.is_tensor(t) and t.dim() >= 2 else t for t in batch)

    def training_step(self, batch, batch_idx: int):
        loss, _, _ = self._loss(batch)
        # under context parallelism `loss` is this rank's share (scaled for the gradient); log the group's mean
        return self.finish_training_step(loss, None if self._cp_group is None else self._group_loss)

    def on_validation_epoch_start(self) -> None:
        # [summed loss, counted positions, correct predictions]; reduced over ranks at epoch end
        self._val = torch.zeros(3, device=self.device, dtype=torch.float64)
        self._val_has_mask = False

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        """Accumulates the batch's loss sums; returns its logits (a subclass compares them, e.g. linearize)."""
        _, total, count, logits = self._loss(batch, return_logits=True)
        batch = self.shard_batch(batch)  # the positions these logits are for
        correct = logits.argmax(-1) == batch[1]
        if len(batch) > 2:
            self._val_has_mask = True
            correct = correct & batch[2]
        self._val += torch.stack([total.double(), count.double(), correct.sum().double()])
        return logits

    def on_validation_epoch_end(self) -> None:
        stats = self._reduce(self._val)
        total, count, correct = stats[0], stats[1].clamp_min(1), stats[2]
        val_loss = (total / count).float()
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=50)), sync_dist=False)
        if self._val_has_mask:  # synthetic tasks: accuracy on the answer positions only
            self.log("val/acc", (correct / count).float(), prog_bar=True, sync_dist=False)

