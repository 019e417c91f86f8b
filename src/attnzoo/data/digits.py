"""`data=digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes; UCI optdigits'
test set), image classification with `val/acc`. The images ship inside scikit-learn: nothing is fetched.

The split is fixed: one permutation drawn from `split_seed` (not the run's seed, so every run validates on
the same images), the last `val_size` images held out, and any held-out image whose pixels equal a
training image's dropped (hashed, as the synthetic tasks' splits), so validation never repeats a training
image. Pixels 0..16 are scaled to [0, 1]; batches are (image (B, 1, 8, 8), label (B,)).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch.utils.data import TensorDataset

from attnzoo.config.errors import ConfigError
from attnzoo.data import register_data
from attnzoo.data.shapes import ImageDataModule
from attnzoo.data.synthetic import example_hashes
from attnzoo.data.configs import N_IMAGES, DigitsConfig  # noqa: F401 (torch-free: config checks)

def load_split(cfg: DigitsConfig):
    """((train images, labels), (val images, labels)) as numpy: images (n, 1, 8, 8) float32 in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - the `vision` / `dev` extras install it
        raise ConfigError("needs scikit-learn (pip install -e .[vision])", field="data.name") from e
    d = load_digits()
    images = (d.images.astype(np.float32) / 16.0)[:, None]  # (1797, 1, 8, 8)
    order = np.random.default_rng(cfg.split_seed).permutation(len(images))
    tr, va = order[: len(order) - cfg.val_size], order[len(order) - cfg.val_size:]
    raw = d.images.reshape(len(images), -1).astype(np.int64)
    none = raw[:, :0]
    seen = set(example_hashes(raw[tr], none[tr], none[tr]))
    va = np.array([i for i, h in zip(va, example_hashes(raw[va], none[va], none[va])) if h not in seen], dtype=np.int64)
    return (images[tr], d.target[tr]), (images[va], d.target[va])


@register_data("digits", DigitsConfig)
class DigitsDataModule(ImageDataModule):
    channels = 1
    image_size = 8
    num_classes = 10
    vocab_size = 10  # the classes (the family sizes its head by the data's vocab_size)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        train, val = load_split(self.cfg)
        to = lambda x, y: TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())  # noqa: E731
        self.train_set, self.val_set = to(*train), to(*val)
        self.info = {"task": "digits", "train_examples": len(self.train_set), "val_examples": len(self.val_set),
                     "image_size": 8, "data_seed": self.seed}
