"""`data=text`: language modelling on the embedded corpus (or a user file/folder)."""
from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from torch.utils.data import Dataset

from attnzoo.config.errors import ConfigError, check
from attnzoo.data import register_data
from attnzoo.data.corpus import cap_notice, load_corpus, load_documents, text_sha
from attnzoo.data.sampling import ResumableDataMixin
from attnzoo.data.tokenizer import BPETokenizer, FileTokenizer, encode_corpus, file_sha, get_tokenizer
from attnzoo.data.configs import TextDataConfig, length_refusal, too_few, vocab_refusal  # noqa: F401 (torch-free)


class Blocks(Dataset):
    """Contiguous, non-overlapping blocks of seq_len + 1 tokens: x = block[:-1], y = block[1:]."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        self.ids, self.seq_len = ids, seq_len
        self.n = (len(ids) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        s = i * self.seq_len
        block = self.ids[s : s + self.seq_len + 1].long()
        return block[:-1], block[1:]


class PackedBlocks(Blocks):
    """`Blocks` of the document stream with each token's document: (x, y, loss_mask, token_mask, doc_ids),
    doc_ids (T,) counting the document starts before each x token inside the block (0 = the block's first
    document, which may have begun in an earlier block). `starts`: sorted stream offsets of the documents'
    separators."""

    def __init__(self, ids: torch.Tensor, starts: torch.Tensor, seq_len: int):
        super().__init__(ids, seq_len)
        self.starts = starts

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        s = i * self.seq_len
        pos = s + torch.arange(self.seq_len)
        docs = torch.searchsorted(self.starts, pos, right=True) - torch.searchsorted(self.starts, s, right=True)
        ones = torch.ones(self.seq_len, dtype=torch.bool)
        return x, y, ones, ones, docs


class DocumentRows(Dataset):
    """One document per row, padded at the end: (x, y, loss_mask, token_mask) with the padding's targets out of
    the loss and its inputs marked not real. A document's x tokens are its separator and text, its last target
    the next separator (as in `PackedBlocks`); longer documents continue in the next rows."""

    def __init__(self, ids: torch.Tensor, starts: torch.Tensor, seq_len: int, pad_id: int = 0):
        self.ids, self.seq_len, self.pad_id = ids, seq_len, pad_id
        bounds = torch.cat([starts, starts.new_tensor([len(ids) - 1])]).tolist()
        first = [0] if not bounds or bounds[0] > 0 else []  # text before the first separator (a cut document)
        edges = first + bounds
        self.rows = [(p, min(p + seq_len, b)) for a, b in zip(edges[:-1], edges[1:]) for p in range(a, b, seq_len)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        a, b = self.rows[i]  # x = ids[a:b], y = ids[a+1:b+1]
        n, T = b - a, self.seq_len
        x = torch.full((T,), self.pad_id, dtype=torch.long)
        y = torch.full((T,), self.pad_id, dtype=torch.long)
        x[:n], y[:n] = self.ids[a:b].long(), self.ids[a + 1:b + 1].long()
        real = torch.arange(T) < n
        return x, y, real, real


def separator_id(tokenizer) -> int:
    """The end-of-text token that starts every document in the document stream."""
    if isinstance(tokenizer, BPETokenizer):
        for name in ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"):
            tid = tokenizer.tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ConfigError("the tokenizer file has no end-of-text token (<|endoftext|>, </s>, <eos>); allowed: "
                          "data.packing=false and data.pad_documents=false with this tokenizer", field="data.packing")
    return 0  # CharTokenizer: <|endoftext|>


def document_stream(tokenizer, docs: list[str], cache_dir: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, starts): every document as [separator] + its tokens, concatenated; starts = each separator's
    offset. Cached beside the plain token stream."""
    sep = separator_id(tokenizer)
    encoded = [encode_corpus(tokenizer, d, cache_dir, f"{key}-doc{i}-{text_sha(d)}") for i, d in enumerate(docs)]
    lengths = torch.tensor([1 + len(e) for e in encoded], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    ids = torch.cat([torch.cat([torch.tensor([sep], dtype=torch.int32), e]) for e in encoded])
    return ids, starts


def load_tokenizer_file(path: str, vocab_size: int) -> FileTokenizer:
    """data.tokenizer_file, read and checked against the embedding it will index (one-line errors)."""
    from pathlib import Path

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{path} does not exist; allowed: a HF tokenizers JSON (tokenizer.json)",
                          field="data.tokenizer_file")
    try:
        tok = FileTokenizer.from_file(p)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ConfigError(f"{path} is not a HF tokenizers file ({str(e).splitlines()[0][:120]})",
                          field="data.tokenizer_file") from None
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"{path} has {tok.vocab_size} tokens, more than data.vocab_size={vocab_size} embedding "
                          f"rows; allowed: data.vocab_size >= {tok.vocab_size}", field="data.tokenizer_file")
    return tok


@register_data("text", TextDataConfig)
class TextDataModule(ResumableDataMixin, L.LightningDataModule):
    def __init__(self, cfg: TextDataConfig, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir, self.seed = cfg, cache_dir, seed
        self.tokenizer = None
        self.info: dict = {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.tokenizer is not None:
            return
        cfg = self.cfg
        text, source = load_corpus(cfg.path, cfg.max_chars)
        notice = cap_notice(cfg.path, cfg.max_chars, text)
        if notice:  # a user's corpus cut to the cap: said, not silent
            print(notice, flush=True)
        sha = text_sha(text)
        if cfg.tokenizer == "file":
            self.tokenizer = load_tokenizer_file(cfg.tokenizer_file, cfg.vocab_size)
        else:
            self.tokenizer = get_tokenizer(cfg.tokenizer, text, cfg.vocab_size, self.cache_dir, sha)
        refusal = vocab_refusal(cfg, len(text), self.tokenizer.vocab_size)  # also checked by preflight (check_corpus)
        if refusal:
            raise refusal
        key = f"{cfg.tokenizer}-{cfg.vocab_size if cfg.tokenizer == 'bpe' else 0}-{sha}"
        if cfg.tokenizer == "file":
            key = f"file-{file_sha(cfg.tokenizer_file)}-{sha}"
        documents = cfg.packing or cfg.pad_documents
        if documents:
            ids, starts = document_stream(self.tokenizer, load_documents(cfg.path, cfg.max_chars)[0], self.cache_dir, key)
        else:
            ids = encode_corpus(self.tokenizer, text, self.cache_dir, key)
        n_val = max(int(len(ids) * cfg.val_fraction), cfg.seq_len + 1)
        if too_few(cfg, len(ids)):
            raise length_refusal(cfg, len(ids))
        self.train_ids, self.val_ids = ids[:-n_val], ids[-n_val:]
        if documents:
            cut = len(ids) - n_val
            train_starts, val_starts = starts[starts < cut], starts[starts >= cut] - cut
            if cfg.packing:
                self.train_set = PackedBlocks(self.train_ids, train_starts, cfg.seq_len)
                self.val_set = PackedBlocks(self.val_ids, val_starts, cfg.seq_len)
            else:
                sep = separator_id(self.tokenizer)
                self.train_set = DocumentRows(self.train_ids, train_starts, cfg.seq_len, sep)
                self.val_set = DocumentRows(self.val_ids, val_starts, cfg.seq_len, sep)
            self.info["documents"] = len(starts)
        else:
            self.train_set, self.val_set = Blocks(self.train_ids, cfg.seq_len), Blocks(self.val_ids, cfg.seq_len)
        self.info = {
            **self.info,
            "source": source,
            "corpus_sha": sha,
            "chars": len(text),
            "tokens": int(len(ids)),
            "train_tokens": int(len(self.train_ids)),
            "val_tokens": int(len(self.val_ids)),
        }
        if cfg.tokenizer == "file":
            self.info["tokenizer_file"] = str(cfg.tokenizer_file)

    @property
    def vocab_size(self) -> int:
        # a tokenizer file indexes the embedding of the model it came from: that model's rows (data.vocab_size)
        return self.cfg.vocab_size if self.cfg.tokenizer == "file" else self.tokenizer.vocab_size


    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)
