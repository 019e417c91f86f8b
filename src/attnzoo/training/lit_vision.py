"""LightningModules for the vision families: `LitImageClassifier` (model=vit|swin on data=digits, or data=shapes
with task=classify) and `LitVLM` (model=vlm on data=shapes with task=vqa|caption).

Both share lit.TrainingModule (AdamW groups, the run's schedule, the non-finite-loss policy, exact reduction of
validation sums over ranks). Metrics:
  classifier  train/loss, val/loss, val/acc (top-1), vision/tokens_per_image (input patches)
  vlm         train/loss, val/loss, val/ppl (over answer tokens), val/acc (exact match of the whole answer:
              every answer position right under teacher forcing, which is exactly when greedy decoding
              reproduces it), val/token_acc, vision/tokens_per_image (image tokens the text sees: resampler
              queries, or the encoder's output tokens), cache/cross_attn_bytes (the cross-attention K/V of one
              image, batch 1, fp32; 0 for concat, whose image tokens sit in the self-attention caches)
`perf/tokens_per_sec` counts patches (classifier) or text tokens (vlm); `perf/flops_per_token` includes the
image encoder and connector (per text token: the image's FLOPs spread over its text).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from attnzoo.training.lit_lm import TrainingModule
from attnzoo.models.vision.classifier import ImageClassifier
from attnzoo.models.vision.vlm import VisionLanguageModel


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


class LitImageClassifier(TrainingModule):
    """An image classifier (ViT or Swin encoder + head, models/vision) trained with cross-entropy.

    Args: `cfg`, the whole resolved run config (dict or DictConfig, saved as hyper-parameters); `vocab_size`,
    the number of classes; `image_size` S and `channels` C, the data module's images; `model_cfg`, the typed
    model config (None: from cfg["model"]). Batches: (images (B, C, S, S) float, labels (B,) int64).
    """

    def __init__(self, cfg: dict, vocab_size: int, image_size: int, channels: int, model_cfg=None):
        super().__init__()
        cfg = _plain(cfg)
        self.save_hyperparameters({"cfg": cfg, "vocab_size": vocab_size, "image_size": image_size, "channels": channels},
                                  logger=False)
        self.model = ImageClassifier(cfg["model"] if model_cfg is None else model_cfg, vocab_size, image_size, channels)
        self._setup_training(cfg)
        self._val = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def tokens_in_batch(self, batch) -> int:
        return batch[0].shape[0] * self.model.tokens_per_image

    def training_step(self, batch, batch_idx: int):
        images, labels = batch
        loss = F.cross_entropy(self.model(images).float(), labels)
        return self.finish_training_step(loss)

    def on_validation_epoch_start(self) -> None:
        self._val = torch.zeros(3, device=self.device, dtype=torch.float64)  # [summed ce, images, correct]

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self.model(images).float()
        ce = F.cross_entropy(logits, labels, reduction="sum")
        correct = (logits.argmax(-1) == labels).sum()
        self._val += torch.stack([ce.double(), torch.tensor(float(len(labels)), device=self.device, dtype=torch.float64),
                                  correct.double()])

    def on_validation_epoch_end(self) -> None:
        total, n, correct = self._reduce(self._val)
        self.log("val/loss", (total / n.clamp_min(1)).float(), prog_bar=True)
        self.log("val/acc", (correct / n.clamp_min(1)).float(), prog_bar=True)
        self.log("vision/tokens_per_image", float(self.model.tokens_per_image))


class LitVLM(TrainingModule):
    """A vision-language model (image encoder + connector + DecoderLM, models/vision/vlm.py): next-token loss
    on the answer tokens only.

    Args: `cfg`, the whole resolved run config; `vocab_size`, the text vocabulary; `image_size` S and
    `channels`, the data module's images; `model_cfg`, the typed model config (None: from cfg["model"]).
    Batches: (x (B, T), y (B, T), answer_mask (B, T), images (B, 3, S, S)) from data=shapes (vqa / caption).
    """

    def __init__(self, cfg: dict, vocab_size: int, image_size: int, channels: int, model_cfg=None):
        super().__init__()
        cfg = _plain(cfg)
        self.save_hyperparameters({"cfg": cfg, "vocab_size": vocab_size, "image_size": image_size, "channels": channels},
                                  logger=False)
        self.model = VisionLanguageModel(cfg["model"] if model_cfg is None else model_cfg, vocab_size, image_size, channels)
        self._setup_training(cfg)
        self._val = None

    def forward(self, x: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return self.model(x, images)

    def _loss(self, batch):
        x, y, mask, images = batch
        logits = self.model(x, images).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view_as(y)
        m = mask.to(ce.dtype)
        return (ce * m).sum(), m.sum(), logits

    def training_step(self, batch, batch_idx: int):
        total, count, _ = self._loss(batch)
        loss = total / count.clamp_min(1)
        return self.finish_training_step(loss)

    def on_validation_epoch_start(self) -> None:
        # [summed ce, answer tokens, correct answer tokens, exact answers, examples]
        self._val = torch.zeros(5, device=self.device, dtype=torch.float64)

    def validation_step(self, batch, batch_idx: int) -> None:
        _, y, mask, _ = batch
        total, count, logits = self._loss(batch)
        right = (logits.argmax(-1) == y) | ~mask
        self._val += torch.stack([total.double(), count.double(), (right & mask).sum().double(),
                                  right.all(dim=1).sum().double(),
                                  torch.tensor(float(len(y)), device=self.device, dtype=torch.float64)])

    def on_validation_epoch_end(self) -> None:
        total, count, tok, exact, n = self._reduce(self._val)
        val_loss = (total / count.clamp_min(1)).float()
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", torch.exp(val_loss.clamp(max=50)))
        self.log("val/token_acc", (tok / count.clamp_min(1)).float())
        self.log("val/acc", (exact / n.clamp_min(1)).float(), prog_bar=True)
        self.log("vision/tokens_per_image", float(self.model.image_tokens_per_image))
        self.log("cache/cross_attn_bytes", float(self.model.cross_cache_bytes(batch=1)))
