"""A prepared folder's litdata index.json is checked before litdata reads anything (data/shards.py
read_split_index): a chunk named outside the folder (`../../outside/chunk.bin`, an absolute path) was followed, so
training read files outside the prepared folder (issue 43 item 1); a missing or truncated chunk ended in litdata's
ChunkWaitTimeoutError after minutes; a corrupt index.json in a JSONDecodeError traceback. Each is one line now."""
from __future__ import annotations

import json
import shutil

import pytest

from attnzoo.config.errors import ConfigError
from attnzoo.data.shards import ShardsDataConfig, ShardsDataModule
from tests.shards_fixture import numbered_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return numbered_corpus(tmp_path_factory.mktemp("shards") / "prepared")


def tamper(root, how: str, outside):
    index_file = root / "train" / "index.json"
    index = json.loads(index_file.read_text())
    first = index["chunks"][0]
    if how in ("parent", "absolute"):
        outside.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "train" / first["filename"], outside / "chunk.bin")
        first["filename"] = "../../outside/chunk.bin" if how == "parent" else str(outside / "chunk.bin")
    elif how == "missing":
        (root / "train" / first["filename"]).unlink()
    elif how == "truncated":
        chunk = root / "train" / first["filename"]
        chunk.write_bytes(chunk.read_bytes()[:10])
    elif how == "corrupt":
        index_file.write_text(index_file.read_text()[:40])
        return
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize("how,expect", [
    ("parent", "names a chunk outside its folder ('../../outside/chunk.bin')"),
    ("absolute", "names a chunk outside its folder ('/"),
    ("missing", "chunk-0-0.bin is missing (its index.json names it)"),
    ("truncated", "chunk-0-0.bin is truncated (10 of 348 bytes)"),
    ("corrupt", "train/index.json is not a litdata index (JSONDecodeError"),
])
def test_a_damaged_index_is_refused_in_one_line(how, expect, corpus, tmp_path):
    root = tmp_path / "a" / "prepared"
    shutil.copytree(corpus, root)
    tamper(root, how, tmp_path / "a" / "outside")
    dm = ShardsDataModule(ShardsDataConfig(path=str(root), seq_len=15, batch_size=3), seed=5)
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    msg = str(e.value)
    assert msg.startswith("data.path: ") and "\n" not in msg and expect in msg, msg


def test_the_intact_folder_reads(corpus):
    dm = ShardsDataModule(ShardsDataConfig(path=str(corpus), seq_len=15, batch_size=3), seed=5)
    dm.setup("fit")
    assert dm.info["train_blocks"] > 0 and dm.info["val_blocks"] > 0
