"""`data=shapes`: procedurally drawn scenes of coloured shapes, for image classification, captioning and VQA.

Nothing is downloaded: each scene is drawn from `data.seed` (or the run's seed). The canvas (`canvas` x
`canvas` pixels, RGB) is a `grid` x `grid` layout of cells; 1..`max_objects` objects sit in distinct cells,
each a filled square / circle / triangle / cross of a random size and offset inside its cell, in one of
`n_colours` colours. Difficulty: more objects, a finer grid or larger canvas, more shapes and colours, and
relation questions.

    task=classify  label = (shape, colour) of the first object in reading order   (n_shapes * n_colours classes)
    task=caption   <bos> red square and blue circle <eos>        (objects in reading order, row by row)
    task=vqa       <bos> what colour is the square ? red <eos>
                   <bos> what shape is the blue object ? circle <eos>
                   <bos> how many triangle ? two <eos>
                   <bos> what colour is the square left of the circle ? red <eos>   (relations=true)

Text batches are (x (B, T), y (B, T), answer_mask (B, T), image (B, 3, H, W)): x/y are the word ids shifted by
one (teacher forcing) and the mask is True where y is an answer word or the closing <eos> — the loss and
`val/acc` count those positions only; `val/acc` is the exact match of the whole answer (every masked
position right, which is exactly when greedy decoding reproduces it). Classification batches are
(image (B, 3, H, W), label (B,)).

The validation split is disjoint from the training split by image (synthetic.make_splits hashing the pixels):
no validation scene was seen in training, under any question.
"""
from __future__ import annotations

from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import TensorDataset

from attnzoo.data import register_data
from attnzoo.data.sampling import ResumableDataMixin
from attnzoo.data.synthetic import make_splits
from attnzoo.data.configs import COLOURS, SHAPES, NUMBERS, TASKS, LONGEST_QUESTION, ShapesConfig  # noqa: F401 (torch-free: config checks)

RGB = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255), (0, 255, 255))
SPECIALS = ("<pad>", "<bos>", "<eos>")
WORDS = ("?", "what", "colour", "shape", "is", "the", "object", "how", "many", "left", "of", "above", "and")
VOCAB = SPECIALS + WORDS + COLOURS + SHAPES + NUMBERS  # one fixed word list: ids do not depend on the config
WORD_ID = {w: i for i, w in enumerate(VOCAB)}
PAD, BOS, EOS = 0, 1, 2


def shape_mask(kind: str, s: int) -> np.ndarray:
    """(s, s) bool: a filled shape of side s."""
    i, j = np.mgrid[0:s, 0:s]
    c = (s - 1) / 2
    if kind == "square":
        return np.ones((s, s), dtype=bool)
    if kind == "circle":
        return (i - c) ** 2 + (j - c) ** 2 <= (s / 2) ** 2
    if kind == "triangle":  # apex up, widening by one pixel per row
        return np.abs(j - c) <= (i + 1) / 2
    t = max(1, s // 3)  # cross: a plus sign with bars t pixels thick
    lo = (s - t) // 2
    return ((i >= lo) & (i < lo + t)) | ((j >= lo) & (j < lo + t))


def _words(ws) -> list[int]:
    return [WORD_ID[w] for w in ws]


def _scene(cfg: ShapesConfig, rng: np.random.Generator):
    """(image (3, H, W) uint8, objects [(cell_row, cell_col, shape, colour)] in reading order)."""
    g, cell = cfg.grid, cfg.canvas // cfg.grid
    n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    cells = np.sort(rng.choice(g * g, size=n, replace=False))
    img = np.zeros((3, cfg.canvas, cfg.canvas), dtype=np.uint8)
    objects = []
    for c in cells:
        r, col = divmod(int(c), g)
        shape, colour = int(rng.integers(cfg.n_shapes)), int(rng.integers(cfg.n_colours))
        s = int(rng.integers(max(3, cell // 2), cell + 1))
        oy, ox = (int(v) for v in rng.integers(0, cell - s + 1, size=2))
        m = shape_mask(SHAPES[shape], s)
        y0, x0 = r * cell + oy, col * cell + ox
        for ch in range(3):
            img[ch, y0:y0 + s, x0:x0 + s][m] = RGB[colour][ch]
        objects.append((r, col, shape, colour))
    return img, objects


def _question(cfg: ShapesConfig, objects, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(question words, answer words) for a scene: a question type drawn among those the scene can answer
    unambiguously."""
    shapes = [o[2] for o in objects]
    colours = [o[3] for o in objects]
    kinds = ["count"]
    unique_shape = [o for o in objects if shapes.count(o[2]) == 1]
    unique_colour = [o for o in objects if colours.count(o[3]) == 1]
    if unique_shape:
        kinds.append("colour")
    if unique_colour:
        kinds.append("shape")
    relation = []
    if cfg.relations:
        for b in unique_shape:  # the reference object: its shape names it
            for rel, before in (("left", lambda a: a[1] < b[1]), ("above", lambda a: a[0] < b[0])):
                for sa in set(shapes) - {b[2]}:
                    hits = [a for a in objects if a[2] == sa and before(a)]
                    if len(hits) == 1:  # "the <sa> left of the <b>" names exactly one object
                        relation.append((hits[0], rel, b))
        if relation:
            kinds.append("relation")
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "count":
        s = int(rng.integers(cfg.n_shapes))
        return ["how", "many", SHAPES[s], "?"], [NUMBERS[shapes.count(s)]]
    if kind == "colour":
        o = unique_shape[int(rng.integers(len(unique_shape)))]
        return ["what", "colour", "is", "the", SHAPES[o[2]], "?"], [COLOURS[o[3]]]
    if kind == "shape":
        o = unique_colour[int(rng.integers(len(unique_colour)))]
        return ["what", "shape", "is", "the", COLOURS[o[3]], "object", "?"], [SHAPES[o[2]]]
    a, rel, b = relation[int(rng.integers(len(relation)))]
    q = ["what", "colour", "is", "the", SHAPES[a[2]], rel] + (["of"] if rel == "left" else []) + ["the", SHAPES[b[2]], "?"]
    return q, [COLOURS[a[3]]]


def generate_shapes(cfg: ShapesConfig, n: int, rng: np.random.Generator):
    """(pixels (n, 3*H*W), tokens (n, seq_len + 1), answer mask (n, seq_len), label (n, 1)): the mask marks
    the positions of x = tokens[:, :-1] whose next token y = tokens[:, 1:] is an answer word or the <eos>."""
    L = cfg.seq_len
    pixels = np.zeros((n, 3 * cfg.canvas * cfg.canvas), dtype=np.int64)
    tokens = np.full((n, L + 1), PAD, dtype=np.int64)
    mask = np.zeros((n, L), dtype=bool)
    label = np.zeros((n, 1), dtype=np.int64)
    for i in range(n):
        img, objects = _scene(cfg, rng)
        pixels[i] = img.reshape(-1)
        first = objects[0]
        label[i, 0] = first[2] * cfg.n_colours + first[3]
        if cfg.task == "classify":
            continue
        if cfg.task == "caption":
            prompt = []
            answer = " and ".join(f"{COLOURS[o[3]]} {SHAPES[o[2]]}" for o in objects).split()
        else:
            prompt, answer = _question(cfg, objects, rng)
        seq = [BOS] + _words(prompt) + _words(answer) + [EOS]
        tokens[i, :len(seq)] = seq
        start = 1 + len(prompt)  # the first answer word is y at x position start - 1
        mask[i, start - 1:len(seq) - 1] = True
    return pixels, tokens, mask, label


def _image_only(parts):
    pixels = parts[0]
    return pixels, pixels[:, :0], pixels[:, :0]


class ImageDataModule(ResumableDataMixin, L.LightningDataModule):
    """In-memory image datamodule: `setup` fills train_set / val_set (TensorDatasets); subclasses say what
    the image geometry and the label space are (`image_size`, `channels`, `vocab_size`, `num_classes`)."""

    channels = 3
    task = "classify"

    def __init__(self, cfg, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir = cfg, cache_dir
        self.seed = cfg.seed if cfg.seed is not None else seed
        self.train_set = self.val_set = None
        self.info: dict = {}



@register_data("shapes", ShapesConfig)
class ShapesDataModule(ImageDataModule):
    def __init__(self, cfg, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__(cfg, cache_dir, seed)
        self.task = cfg.task

    @property
    def image_size(self) -> int:
        return self.cfg.canvas

    @property
    def num_classes(self) -> int:
        return self.cfg.n_shapes * self.cfg.n_colours

    @property
    def vocab_size(self) -> int:
        """Classify: the classes; caption / vqa: the word list."""
        return self.num_classes if self.task == "classify" else len(VOCAB)

    def decode(self, ids) -> str:
        return " ".join(VOCAB[i] for i in ids if i != PAD)

    def _tensors(self, pixels, tokens, mask, label) -> TensorDataset:
        S = self.cfg.canvas
        image = torch.from_numpy(pixels.reshape(-1, 3, S, S)).float() / 255.0
        if self.task == "classify":
            return TensorDataset(image, torch.from_numpy(label[:, 0]))
        tok = torch.from_numpy(tokens)
        return TensorDataset(tok[:, :-1].contiguous(), tok[:, 1:].contiguous(), torch.from_numpy(mask), image)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        splits = make_splits(generate_shapes, self.cfg, self.seed, key=_image_only,
                             hint="more objects, colours or shapes, a larger canvas, or a smaller train_size/val_size")
        self.train_set, self.val_set = (self._tensors(*splits[k]) for k in ("train", "val"))
        self.info = {"task": f"shapes/{self.task}", "train_examples": len(self.train_set),
                     "val_examples": len(self.val_set), "image_size": self.image_size, "data_seed": self.seed,
                     "vocab_size": self.vocab_size}
