"""LightningModules for the encoder-decoder (`LitSeq2Seq`) and the encoder-only masked LM (`LitMLM`).

`attnzoo.training.families` builds them for `model.name` encdec | encoder; `train()` does not know the difference.

LitSeq2Seq: teacher forcing with label-smoothed cross-entropy (Szegedy et al. 2016; the paper's eps_ls = 0.1,
`model.encdec.label_smoothing`) over the real target tokens (EOS included, padding never); validation logs
`val/loss` and `val/ppl` (plain cross-entropy, teacher forced), `val/token_acc` (teacher-forced next-token
accuracy) and `val/acc` = exact match of the whole greedy-decoded output (every token and the EOS right).
LitMLM: BERT's 15% masking with the 80/10/10 rule on the text blocks; loss, `val/acc` on the chosen tokens.
Both: AdamW with LitLM's parameter groups; the schedule of `scheduler` (Noam when the config has none).
"""
from __future__ import annotations

import logging

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from attnzoo.models.encoder_decoder import EncoderDecoder, EncoderMLM, mask_tokens
from attnzoo.training.lit_lm import TrainingModule

log = logging.getLogger("attnzoo")

class _Base(TrainingModule):
    """The shared training pieces (lit.TrainingModule), with the paper's Noam schedule by default."""

    def _setup(self, cfg: dict) -> None:
        self._setup_training(cfg, default_scheduler={"name": "noam", "warmup_steps": 4000, "min_lr_ratio": 0.0})

def masked_ce(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, smoothing: float = 0.0):
    """(summed cross-entropy over mask, count): logits (B, T, V), target/mask (B, T)."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none",
                         label_smoothing=smoothing)
    m = mask.reshape(-1).to(ce.dtype)
    return (ce * m).sum(), m.sum()


def exact_match(pred: torch.Tensor, tgt_out: torch.Tensor, tgt_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the decoded tokens equal the target on every real position (EOS included). pred (B, <=T)."""
    T = tgt_out.shape[1]
    if pred.shape[1] < T:
        pred = F.pad(pred, (0, T - pred.shape[1]), value=-1)
    return ((pred[:, :T] == tgt_out) | ~tgt_mask).all(dim=1)


class LitSeq2Seq(_Base):
    """An encoder-decoder (models/encoder_decoder.py) trained with teacher forcing and label smoothing.

    Args: `cfg`, the whole resolved run config (dict or DictConfig, saved as hyper-parameters); `vocab_size`,
    the task's (shared source / target) vocabulary; `pad_id`, `bos_id`, `eos_id`, the task's special ids;
    `model_cfg`, the typed model config (None: from cfg["model"]).
    Batches: (src (B, S), tgt_in (B, T), tgt_out (B, T), src_mask (B, S), tgt_mask (B, T)) from data/seq2seq.py;
    masks are True on real tokens. Validation adds greedy-decoding exact match.
    """

    def __init__(self, cfg: dict, vocab_size: int, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2, model_cfg=None):
        super().__init__()
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        self.save_hyperparameters({"cfg": cfg, "vocab_size": vocab_size, "pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id},
                                  logger=False)
        self.model = EncoderDecoder(cfg["model"] if model_cfg is None else model_cfg, vocab_size=vocab_size)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self._setup(cfg)
        self._val = None

    def forward(self, src, tgt_in, src_mask=None):
        return self.model(src, tgt_in, src_mask)

    def training_step(self, batch, batch_idx: int):
        src, tgt_in, tgt_out, src_mask, tgt_mask = batch
        total, count = masked_ce(self.model(src, tgt_in, src_mask), tgt_out, tgt_mask, self.model.opts.label_smoothing)
        loss = total / count.clamp_min(1)
        return self.finish_training_step(loss)

    def on_validation_epoch_start(self) -> None:
        # [summed ce, target tokens, correct tokens (teacher forced), exact-match sequences, sequences]
        self._val = torch.zeros(5, device=self.device, dtype=torch.float64)

    def validation_step(self, batch, batch_idx: int) -> None:
        src, tgt_in, tgt_out, src_mask, tgt_mask = batch
        logits = self.model(src, tgt_in, src_mask)
        total, count = masked_ce(logits, tgt_out, tgt_mask)
        tok = ((logits.argmax(-1) == tgt_out) & tgt_mask).sum()
        pred = self.model.generate(src, src_mask, max_new_tokens=tgt_out.shape[1], bos_id=self.bos_id,
                                   eos_id=self.eos_id, pad_id=self.pad_id)
        exact = exact_match(pred, tgt_out, tgt_mask).sum()
        self._val += torch.stack([total.double(), count.double(), tok.double(), exact.double(),
                                  torch.tensor(float(src.shape[0]), device=self.device, dtype=torch.float64)])

    def on_validation_epoch_end(self) -> None:
        total, count, tok, exact, n = self._reduce(self._val)
        val_loss = (total / count.clamp_min(1)).float()
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=50)))
        self.log("val/token_acc", (tok / count.clamp_min(1)).float())
        self.log("val/acc", (exact / n.clamp_min(1)).float(), prog_bar=True)


class LitMLM(_Base):
    """Masked LM on the text datamodule's blocks (x, y[, mask]): x is masked here, y is ignored.

    The model's vocabulary is the tokenizer's plus one `[MASK]` id (= the tokenizer's vocab_size), so any
    text tokenizer works without a reserved mask token; random replacements come from the real tokens.

    Args: `cfg`, the whole resolved run config (its `model.encdec` sets the masking rates); `vocab_size`, the
    text tokenizer's vocabulary (the model gets vocab_size + 1); `model_cfg`, the typed model config (None:
    from cfg["model"])."""

    def __init__(self, cfg: dict, vocab_size: int, model_cfg=None):
        super().__init__()
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        self.save_hyperparameters({"cfg": cfg, "vocab_size": vocab_size}, logger=False)
        self.text_vocab, self.mask_id = vocab_size, vocab_size
        self.model = EncoderMLM(cfg["model"] if model_cfg is None else model_cfg, vocab_size=vocab_size + 1)
        self._setup(cfg)
        self._val = None

    def forward(self, idx):
        return self.model(idx)

    def _step(self, x: torch.Tensor, generator=None):
        inp, chosen = mask_tokens(x, self.mask_id, self.text_vocab, self.model.opts.mlm_prob, generator)
        logits = self.model(inp)
        total, count = masked_ce(logits, x, chosen)
        return total, count, logits, chosen

    def training_step(self, batch, batch_idx: int):
        total, count, _, _ = self._step(batch[0])
        loss = total / count.clamp_min(1)
        return self.finish_training_step(loss)

    def on_validation_epoch_start(self) -> None:
        self._val = torch.zeros(3, device=self.device, dtype=torch.float64)  # [summed ce, chosen, correct]

    def validation_step(self, batch, batch_idx: int) -> None:
        x = batch[0]
        g = torch.Generator(device=x.device).manual_seed(1000 + batch_idx)  # the same masks every validation
        total, count, logits, chosen = self._step(x, g)
        correct = ((logits.argmax(-1) == x) & chosen).sum()
        self._val += torch.stack([total.double(), count.double(), correct.double()])

    def on_validation_epoch_end(self) -> None:
        total, count, correct = self._reduce(self._val)
        val_loss = (total / count.clamp_min(1)).float()
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=50)))
        self.log("val/acc", (correct / count.clamp_min(1)).float(), prog_bar=True)
