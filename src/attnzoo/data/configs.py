"""The data modules' config dataclasses, torch-free: what the config checks read (issue 45: a refused value is
reported before torch or Lightning is imported). Each is the schema of `data` for its name, with its own
`validate(model, field)`; the `LightningDataModule`s live in this package's other modules, declared at the end of
this file: the registry imports a data module's module when it is first built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from attnzoo.config.errors import ConfigError, check, check_choice
from attnzoo.data import DATAMODULES
from attnzoo.data.shards_configs import MixtureSource, check_mixture
from attnzoo.data.synthetic_configs import (NEEDLE_SPECIALS, NeedleConfig, SyntheticConfig,  # noqa: F401 (re-exported)
                                         needle_tokens)

if TYPE_CHECKING:
    from attnzoo.data.prepare import PrepareOptions


# ----------------------------------------------------------------------------- text

@dataclass
class TextDataConfig:
    natural_text: ClassVar[bool] = True  # loss / perplexity, no answer accuracy (training/families.py)
    name: str = "text"
    path: Optional[str] = None  # null: the embedded corpus (this Python's stdlib sources); or a file / folder
    # cap on corpus characters read (a data.path cut by it is reported in one line naming `attnzoo-data prepare`,
    # which prepares a corpus of any size for data=shards); null: all of it, in memory
    max_chars: Optional[int] = 2_000_000
    tokenizer: str = "bpe"  # bpe | char | file (tokenizer_file)
    # bpe: the vocabulary learned; char: unused (the corpus's characters); file: the embedding rows, >= the
    # file's tokens (model.init_from sets it to the imported model's vocab_size)
    vocab_size: int = 2048
    # a HF `tokenizers` JSON (tokenizer.json) for tokenizer=file; model.init_from sets it (and tokenizer=file)
    # when its directory has one, so the corpus is encoded as the imported model was trained
    tokenizer_file: Optional[str] = None
    seq_len: int = 256
    batch_size: int = 16
    val_fraction: float = 0.05  # the last fraction of the token stream
    num_workers: int = 0
    # documents (the corpus's files, each after an <|endoftext|> separator) packed into rows without padding,
    # with document masks: attention never crosses a document start, recurrent state resets, positions restart
    # (packing.py). false: the stream cut into blocks that run across documents (no masks)
    packing: bool = False
    # one document per row, padded (the baseline packing is measured against); documents longer than a row
    # continue in the next rows. Same targets as packing
    pad_documents: bool = False

    def validate(self, model, field: str) -> None:
        check_choice(self.tokenizer, f"{field}.tokenizer", ("bpe", "char", "file"))
        if self.tokenizer == "file":
            check(self.tokenizer_file is not None, f"{field}.tokenizer_file", "must be set with tokenizer=file "
                  "(a HF tokenizers JSON, e.g. a transformers model's tokenizer.json)")
        check(self.seq_len > 0, f"{field}.seq_len", "must be positive")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        check(0.0 < self.val_fraction < 0.5, f"{field}.val_fraction", "must be in (0, 0.5)")
        if self.tokenizer == "bpe":
            check(self.vocab_size >= 260, f"{field}.vocab_size", "must be >= 260 (256 bytes + specials) for bpe")
        check(self.vocab_size > 0, f"{field}.vocab_size", "must be positive")
        check(not (self.packing and self.pad_documents), f"{field}.pad_documents",
              "packing and pad_documents are two layouts of the same documents; allowed: one of them true")
        if self.path is not None:  # a missing, binary or empty corpus before any work (its tokens: the data module)
            from attnzoo.data.corpus import load_documents

            try:  # the characters the run reads (data.max_chars), or its first MiB when it reads all
                load_documents(self.path, self.max_chars if self.max_chars is not None else 1 << 20)
            except ConfigError as e:
                if self.max_chars is not None or "is empty" not in str(e):
                    raise

    SMALL_CORPUS_BYTES: ClassVar[int] = 1 << 16  # encoded in a few ms: check_corpus counts its tokens

    def check_corpus(self, cache_dir: str):
        """The refusals of TextDataModule.setup that need the corpus and its tokenizer, made without torch for
        `preflight` (issue 45): a BPE vocabulary the corpus cannot support (the tokenizer is trained and cached as
        setup would: setup then loads it), and a corpus too short for seq_len, encoded here when it is small (64 KiB) or
        even one token per byte would be too few (either way it takes milliseconds; otherwise setup counts). A tokenizer file and
        document layouts (packing, pad_documents) are left to setup. Returns the tokenizer (None for a file), for
        preflight's other checks in the data's tokens (the end-of-run needle prompts)."""
        if self.tokenizer == "file":
            return None
        from pathlib import Path

        from attnzoo.data.corpus import load_corpus, text_sha
        from attnzoo.data.tokenizer import get_tokenizer

        text, _ = load_corpus(self.path, self.max_chars)
        tok = get_tokenizer(self.tokenizer, text, self.vocab_size, Path(cache_dir).expanduser(), text_sha(text))
        refusal = vocab_refusal(self, len(text), tok.vocab_size)
        if refusal:
            raise refusal
        n_bytes = len(text.encode("utf-8"))  # >= its tokens (a character, or a byte-level BPE token, per byte at least)
        small = too_few(self, n_bytes) or n_bytes <= self.SMALL_CORPUS_BYTES
        if small and not (self.packing or self.pad_documents):
            n = len(tok.encode_long(text) if hasattr(tok, "encode_long") else tok.encode(text))
            if too_few(self, n):
                raise length_refusal(self, n)
        return tok



def vocab_refusal(cfg, chars: int, learned: int) -> Optional[ConfigError]:
    """A BPE vocabulary the corpus cannot support (`cfg`: a TextDataConfig or its DictConfig; TextDataModule.setup
    and TextDataConfig.check_corpus)."""
    if cfg.tokenizer == "bpe" and learned < cfg.vocab_size // 2:
        return ConfigError(f"{cfg.vocab_size} asked for, but this corpus ({chars:,} characters) supports only "
                           f"{learned} BPE tokens (what the tokenizer learned); allowed: <= {learned}, or a larger "
                           f"corpus", field="data.vocab_size")
    return None


def too_few(cfg, n_tokens: int) -> bool:
    """A token stream too short for seq_len (2 training blocks + the validation tail)."""
    n_val = max(int(n_tokens * cfg.val_fraction), cfg.seq_len + 1)
    return n_tokens - n_val < 2 * (cfg.seq_len + 1)


def length_refusal(cfg, n_tokens: int) -> ConfigError:
    return ConfigError(f"corpus has {n_tokens} tokens, too few for seq_len={cfg.seq_len}; allowed: a longer text or "
                       f"a smaller seq_len", field="data.seq_len")


# ----------------------------------------------------------------------------- shapes

COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan")


SHAPES = ("square", "circle", "triangle", "cross")


NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


TASKS = ("classify", "caption", "vqa")


LONGEST_QUESTION = 10  # "what colour is the triangle left of the circle ?" (9 words) + the answer


@dataclass
class ShapesConfig:
    name: str = "shapes"
    task: str = "vqa"  # classify | caption | vqa
    canvas: int = 16  # image side in pixels
    grid: int = 2  # grid x grid cells, at most one object per cell; canvas must be a multiple of grid
    min_objects: int = 1
    max_objects: int = 2  # <= grid * grid
    n_shapes: int = 3  # the first n of square, circle, triangle, cross
    n_colours: int = 4  # the first n of red, green, blue, yellow, magenta, cyan
    relations: bool = True  # vqa: also "what colour is the <shape> left of / above the <shape> ?"
    seq_len: int = 16  # text tokens per example (question + answer + <eos>, right-padded)
    batch_size: int = 64
    train_size: int = 4000
    val_size: int = 400  # scenes disjoint from the training scenes (hashed)
    seed: Optional[int] = None  # data seed; null: the run's seed
    num_workers: int = 0

    def validate(self, model, field: str) -> None:
        check_choice(self.task, f"{field}.task", TASKS)
        check(self.grid >= 1, f"{field}.grid", f"must be >= 1, got {self.grid}")
        check(self.canvas >= 4 * self.grid and self.canvas % self.grid == 0, f"{field}.canvas",
              f"{self.canvas} is not a multiple of grid={self.grid} with cells of >= 4 pixels; allowed: "
              f"{4 * self.grid}, {5 * self.grid}, {6 * self.grid}, ...")
        check(1 <= self.min_objects <= self.max_objects, f"{field}.min_objects",
              f"must be in [1, max_objects={self.max_objects}], got {self.min_objects}")
        check(self.max_objects <= min(self.grid * self.grid, len(NUMBERS) - 1), f"{field}.max_objects",
              f"{self.max_objects} objects do not fit one per cell of a {self.grid}x{self.grid} grid; allowed: "
              f"<= {min(self.grid * self.grid, len(NUMBERS) - 1)}")
        check(2 <= self.n_shapes <= len(SHAPES), f"{field}.n_shapes", f"allowed: 2 .. {len(SHAPES)}, got {self.n_shapes}")
        check(2 <= self.n_colours <= len(COLOURS), f"{field}.n_colours", f"allowed: 2 .. {len(COLOURS)}, got {self.n_colours}")
        need = self.text_len()
        check(self.seq_len >= need, f"{field}.seq_len", f"{self.seq_len} cannot hold the longest {self.task} "
              f"example ({need} tokens); allowed: >= {need}")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        check(self.train_size >= self.batch_size, f"{field}.train_size", f"{self.train_size} is smaller than "
              f"batch_size={self.batch_size}; allowed: >= batch_size")
        check(self.val_size > 0, f"{field}.val_size", "must be positive")

    def text_len(self) -> int:
        """Input tokens of the longest example: <bos> + prompt + answer (the <eos> is only a target)."""
        if self.task == "caption":
            return 1 + 3 * self.max_objects - 1  # colour shape [and colour shape ...]
        return 1 + LONGEST_QUESTION if self.task == "vqa" else 1

    @property
    def image_size(self) -> int:
        return self.canvas

    @property
    def channels(self) -> int:
        return 3



# ----------------------------------------------------------------------------- digits

N_IMAGES = 1797


@dataclass
class DigitsConfig:
    name: str = "digits"
    val_size: int = 297  # held-out images (the rest train): 1500 / 297
    split_seed: int = 0  # the fixed permutation the split is cut from
    batch_size: int = 64
    seed: Optional[int] = None  # shuffling seed; null: the run's seed
    num_workers: int = 0
    seq_len: int = 1  # one label per image; every data section has a seq_len (the text tasks' context length)

    def validate(self, model, field: str) -> None:
        check(0 < self.val_size < N_IMAGES, f"{field}.val_size", f"allowed: 1 .. {N_IMAGES - 1}, got {self.val_size}")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        check(N_IMAGES - self.val_size >= self.batch_size, f"{field}.batch_size",
              f"{self.batch_size} exceeds the {N_IMAGES - self.val_size} training images; allowed: <= {N_IMAGES - self.val_size}")

    @property
    def image_size(self) -> int:
        return 8

    @property
    def channels(self) -> int:
        return 1



# ----------------------------------------------------------------------------- seq2seq

PAD, BOS, EOS, FIRST_SYMBOL = 0, 1, 2, 3


@dataclass
class Seq2SeqConfig:
    name: str = "reversal"
    vocab_size: int = 16  # 3 specials (pad, bos, eos) + task symbols
    seq_len: int = 16  # longest source (sources are padded to it); targets are one longer (EOS)
    min_len: int = 1  # shortest source
    batch_size: int = 64
    train_size: int = 20_000
    val_size: int = 500
    seed: Optional[int] = None  # data seed; null: the run's seed
    num_workers: int = 0

    def validate(self, model, field: str) -> None:
        check(self.vocab_size >= FIRST_SYMBOL + 2, f"{field}.vocab_size",
              f"must be >= {FIRST_SYMBOL + 2} (pad, bos, eos and two symbols), got {self.vocab_size}")
        check(1 <= self.min_len <= self.seq_len, f"{field}.min_len", f"must be in [1, seq_len={self.seq_len}], got {self.min_len}")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        check(self.train_size >= self.batch_size, f"{field}.train_size", "must be >= batch_size")
        check(self.val_size > 0, f"{field}.val_size", "must be positive")


@dataclass
class AdditionConfig(Seq2SeqConfig):
    name: str = "addition"
    vocab_size: int = 14  # pad, bos, eos, digits 0-9, '+'
    max_digits: int = 4  # operands have 1 .. max_digits digits; needs 2 * max_digits + 1 <= seq_len
    seq_len: int = 9

    def validate(self, model, field: str) -> None:
        check(self.vocab_size == 14, f"{field}.vocab_size", f"is fixed by the task; allowed: 14, got {self.vocab_size}")
        check(self.max_digits >= 1, f"{field}.max_digits", "must be >= 1")
        check(2 * self.max_digits + 1 <= self.seq_len, f"{field}.max_digits",
              f"{self.max_digits} needs seq_len >= {2 * self.max_digits + 1}; allowed: 1 .. {(self.seq_len - 1) // 2}")
        super().validate(model, field)


@dataclass
class SortingConfig(Seq2SeqConfig):
    name: str = "sorting"



# ----------------------------------------------------------------------------- copying

@dataclass
class CopyingConfig(SyntheticConfig):
    name: str = "copying"
    vocab_size: int = 16  # 14 data tokens + blank + separator
    seq_len: int = 64
    copy_len: int = 8  # n tokens to reproduce; needs 2n <= seq_len

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check(self.copy_len >= 1, f"{field}.copy_len", "must be >= 1")
        check(2 * self.copy_len <= self.seq_len, f"{field}.copy_len",
              f"{self.copy_len} needs seq_len >= {2 * self.copy_len}; allowed: 1 .. {self.seq_len // 2}")
        check(self.vocab_size >= 3, f"{field}.vocab_size", "must be >= 3 (blank, separator, one data token)")


@dataclass
class SelectiveCopyingConfig(CopyingConfig):
    name: str = "selective_copying"



# ----------------------------------------------------------------------------- induction

@dataclass
class InductionConfig(SyntheticConfig):
    name: str = "induction_heads"
    vocab_size: int = 64
    seq_len: int = 256

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check(self.seq_len >= 4, f"{field}.seq_len", f"must be >= 4, got {self.seq_len}")
        check(self.vocab_size >= 3, f"{field}.vocab_size", "must be >= 3")



# ----------------------------------------------------------------------------- mqar

@dataclass
class MQARConfig(SyntheticConfig):
    name: str = "mqar"
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16  # N; clipped to seq_len // 4 (needs 4N <= L), e.g. when debug=smoke shrinks seq_len
    power_a: float = 0.01  # power-law exponent of the query gaps
    random_non_queries: bool = True  # filler tokens random from [0, V) (Zoology); false: 0

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check(self.num_kv_pairs >= 1, f"{field}.num_kv_pairs", f"must be >= 1, got {self.num_kv_pairs}")
        check(self.seq_len >= 4, f"{field}.seq_len", f"must be >= 4 (4 * num_kv_pairs), got {self.seq_len}")
        n = effective_pairs(self)
        check(self.vocab_size // 2 - 1 >= n, f"{field}.vocab_size",
              f"{self.vocab_size} leaves {self.vocab_size // 2 - 1} keys for {n} pairs; allowed: >= {2 * n + 2}")
        check(0 < self.power_a <= 1, f"{field}.power_a", f"must be in (0, 1], got {self.power_a}")


def effective_pairs(cfg) -> int:
    """The number of pairs actually used: num_kv_pairs, clipped so that 4N <= seq_len."""
    return max(1, min(cfg.num_kv_pairs, cfg.seq_len // 4))


def noise_tokens(cfg) -> int:
    n = effective_pairs(cfg)
    return cfg.noise_len if cfg.noise_len is not None else (cfg.seq_len - 3 * n) // 2


@dataclass
class NoisyARConfig(SyntheticConfig):
    """Associative recall with noise: the N pairs are interleaved with `noise_len` noise tokens from a
    reserved range [V - noise_vocab, V) that never serves as a key or value; then the N keys are queried
    in random order at random positions of the query region, the rest of which is noise too."""

    name: str = "noisy_ar"
    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16  # clipped to seq_len // 4
    noise_len: Optional[int] = None  # noise tokens among the pairs; null: (seq_len - 3N) // 2
    noise_vocab: int = 16

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check(self.num_kv_pairs >= 1, f"{field}.num_kv_pairs", f"must be >= 1, got {self.num_kv_pairs}")
        check(self.seq_len >= 4, f"{field}.seq_len", f"must be >= 4, got {self.seq_len}")
        check(self.noise_vocab >= 1, f"{field}.noise_vocab", "must be >= 1")
        n = effective_pairs(self)
        kv = self.vocab_size - self.noise_vocab
        check(kv // 2 - 1 >= n, f"{field}.vocab_size", f"{self.vocab_size} minus noise_vocab={self.noise_vocab} leaves too few keys for {n} pairs")
        noise = noise_tokens(self)
        check(0 <= noise <= self.seq_len - 3 * n, f"{field}.noise_len",
              f"{noise} does not fit: allowed 0 .. seq_len - 3 * num_kv_pairs = {self.seq_len - 3 * n}")



# ----------------------------------------------------------------------------- shards

PREPARE = "attnzoo-data prepare SRC OUT"


@dataclass
class ShardsDataConfig:
    natural_text: ClassVar[bool] = True  # loss / perplexity, no answer accuracy (training/families.py)
    name: str = "shards"
    path: Optional[str] = None  # OUT of `attnzoo-data prepare SRC OUT` (its manifest.json, tokenizer.json, train/, val/)
    seq_len: int = 256
    batch_size: int = 16
    num_workers: int = 2  # loader worker processes per rank (each streams its own share of the shards)
    # document masks from the end-of-text ids inside each block: attention never crosses a document start,
    # recurrent state resets, positions restart (packing.py). false: plain blocks that run across documents
    packing: bool = False
    shuffle: bool = True  # the training blocks' order, per epoch from the run's seed (validation: in order)
    # the embedding rows: null = the prepared tokenizer's vocabulary (the manifest's); more for a model whose
    # embedding is larger than its tokenizer (model.init_from), never fewer
    vocab_size: Optional[int] = None
    # instead of path: a source `attnzoo-data prepare` reads, prepared on first use into paths.cache_dir/shards/<key>
    # (key: the source's fingerprint + the prepare options), once for every job of a sweep and every rank
    source: Optional[str] = None
    prepare: dict = field(default_factory=dict)  # with source: attnzoo-data prepare's options, e.g. {vocab_size: 8192}
    # instead of path / source: prepared folders (one tokenizer) mixed by weight, {name: {path, weight}}; the name
    # is its data/tokens/<name> metric (data/shards_configs.py, docs/data.md#mixtures)
    mixture: Optional[dict[str, MixtureSource]] = None

    def validate(self, model, field: str) -> None:
        check(self.seq_len > 0, f"{field}.seq_len", "must be positive")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        if self.mixture is not None:
            check_mixture(self, model, field)
            return
        check(self.path is None or self.source is None, f"{field}.source", f"{self.source!r} given with "
              f"{field}.path={self.path!r}; allowed: one of them (a prepared folder, or a source prepared on first use)")
        check(self.path is not None or self.source is not None, f"{field}.path", f"is required with data=shards; "
              f"allowed: a folder written by `{PREPARE}` (or {field}.source=SRC, prepared on first use)")
        if self.source is not None:  # the source and the options checked now; the manifest once it is prepared
            prepare_options(self.source, self.prepare, field)
            return
        check(not self.prepare, f"{field}.prepare", f"{self.prepare} without {field}.source; allowed: options of "
              f"the prepare of {field}.source")
        manifest = read_manifest(self.path, f"{field}.path")
        vocab = int(manifest["tokenizer"]["vocab_size"])
        if self.vocab_size is not None:
            check(self.vocab_size >= vocab, f"{field}.vocab_size", f"{self.vocab_size} embedding rows, fewer than "
                  f"{self.path}'s tokenizer ({vocab} tokens); allowed: >= {vocab}, or null (the manifest's)")
        rows = getattr(model, "vocab_size", None)  # set by model.init_from (the imported embedding); else from here
        if rows is not None:
            check(rows >= vocab, "model.vocab_size", f"{rows} embedding rows, fewer than {self.path}'s tokenizer "
                  f"({vocab} tokens); allowed: a model with >= {vocab}, or a corpus prepared with its tokenizer")
        longest = manifest["splits"]["train"].get("max_document_tokens")
        if self.packing and longest is not None:
            check(self.seq_len <= longest, f"{field}.seq_len", f"{self.seq_len} is longer than every document of "
                  f"{self.path} (the longest: {longest} tokens): with data.packing=true no token would see more "
                  f"than {longest} tokens of context; allowed: <= {longest}, or data.packing=false")


def _relabel(e: ConfigError, field: str) -> ConfigError:
    """prepare's refusal (fields SRC, --vocab-size, prepare) as this config's (data.source, data.prepare.vocab_size)."""
    where = {"SRC": f"{field}.source", "prepare": f"{field}.prepare"}.get(e.field or "")
    if where is None:
        where = f"{field}.prepare." + (e.field or "").removeprefix("--").replace("-", "_")
    return ConfigError(str(e).removeprefix(f"{e.field}: "), field=where)


def prepare_options(source: str, options: dict, field: str = "data") -> tuple[PrepareOptions, dict, dict]:
    """(the options, the source record, the tokenizer identity) of data.source + data.prepare, checked: one line
    naming data.source / data.prepare.<option>. progress is the command's; the rest shapes the prepared folder."""
    from attnzoo.data.prepare import checked_options, resolve_source
    from attnzoo.data.prepare_tokens import tokenizer_source

    try:
        o = checked_options(options, exclude=("progress",))
        return o, resolve_source(str(source), o)[0], tokenizer_source(o)[1]
    except ConfigError as e:
        raise _relabel(e, field) from None


def read_manifest(path: str, field: str = "data.path") -> dict:
    """OUT/manifest.json, checked as `attnzoo-data info` checks it (a finished prepare output of a version this
    attnzoo reads: prepare.read_manifest), with its tokenizer and splits present. One-line ConfigError naming
    `field` otherwise."""
    from attnzoo.data.prepare import read_manifest as read_prepared_manifest

    try:
        manifest = read_prepared_manifest(path)
    except ConfigError as e:
        raise ConfigError(str(e).removeprefix(f"{e.field}: "), field=field) from None
    for part in ("tokenizer.json", "train/index.json", "val/index.json"):
        if not (Path(path).expanduser() / part).is_file():
            raise ConfigError(f"{path} has no {part}; allowed: a folder written by `{PREPARE}`", field=field)
    return manifest

# ----------------------------------------------------------------------------- where each data module lives
for _name, _config, _module in (
        ("text", TextDataConfig, "text"), ("shards", ShardsDataConfig, "shards"), ("mqar", MQARConfig, "mqar"),
        ("noisy_ar", NoisyARConfig, "mqar"), ("copying", CopyingConfig, "copying"),
        ("selective_copying", SelectiveCopyingConfig, "copying"), ("induction_heads", InductionConfig, "induction"),
        ("reversal", Seq2SeqConfig, "seq2seq"), ("sorting", SortingConfig, "seq2seq"),
        ("addition", AdditionConfig, "seq2seq"), ("shapes", ShapesConfig, "shapes"), ("digits", DigitsConfig, "digits"),
        ("needle", NeedleConfig, "needle")):
    DATAMODULES.declare(_name, _config, f"attnzoo.data.{_module}")
# modules of the package that register no data module
DATAMODULES.helpers(*(f"attnzoo.data.{m}" for m in ("corpus", "needles", "prepare", "prepare_tokens", "sampling",
                                                     "shards_configs", "sources", "synthetic", "synthetic_configs",
                                                     "tokenizer")))
