"""No checkpoint runs code (issue 43 item 1). torch.distributed.checkpoint's FileSystemReader reads a folder's
`.metadata` with plain `pickle.load`, and its default planner reads non-tensor entries of a `.distcp` shard with
`torch.load(weights_only=False)`: a payload planted in either ran in every entry point. Now each sharded folder is
checked whole before anything in it is loaded (distributed/fsdp.py verify_sharded) and read with restricted
readers; single files load weights_only. A planted payload writes a marker file and then returns the real object,
so a load that ran it would otherwise succeed: every entry point must refuse in one line and leave no marker."""
from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.config.errors import ConfigError
from tests.conftest import SESSION_CACHE, compose_cfg
from scripts.warm_run import run_python


class Payload:
    """Unpickling it runs `code` (writes the marker, then evaluates to the real object)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def payload_pickle(marker: Path, real: bytes) -> bytes:
    return pickle.dumps(Payload(f"(__import__('pathlib').Path({str(marker)!r}).write_text('ran'), "
                                f"__import__('pickle').loads({real!r}))[1]"))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A trainer=fsdp_cpu run (1 process) with its sharded checkpoints: checkpoints/last.ckpt -> a DCP folder. In a
    process of its own: Lightning's FSDP strategy sets LOCAL_RANK / RANK in the process it runs in, which would
    make this test worker's later DDP runs think they were launched from outside."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    r = run_python(["-m", "attnzoo.cli.train", "debug=smoke", "trainer=fsdp_cpu", "trainer.devices=1",
                    "data.tokenizer=char", "trainer.max_steps=2", "trainer.val_check_interval=2",
                    "perf.decode_tokens=0", f"paths.cache_dir={SESSION_CACHE}", f"hydra.run.dir={out}"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def folder_of(run: Path) -> Path:
    return (run / "checkpoints" / "last.ckpt").resolve()


def plant(run: Path, where: str, marker: Path) -> None:
    """A payload in `where` of the run's last checkpoint folder: .metadata, meta.pt, or a .distcp bytes entry."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    folder = folder_of(run)
    real = (folder / ".metadata").read_bytes()
    if where == ".metadata":
        (folder / ".metadata").write_bytes(payload_pickle(marker, real))
    elif where == "meta.pt":
        meta = torch.load(folder / "meta.pt", weights_only=True)
        meta["planted"] = Payload(f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')")
        torch.save(meta, folder / "meta.pt")
    elif where == ".distcp":  # one non-tensor entry (an optimizer param_group value) re-pointed at a payload
        md = pickle.loads(real)
        fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        info = md.storage_data[MetadataIndex(fqn)]
        buf = io.BytesIO()
        torch.save(Payload(f"(__import__('pathlib').Path({str(marker)!r}).write_text('ran'), 0.1)[1]"), buf)
        shard = folder / info.relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(buf.getvalue())
        info.offset, info.length = offset, len(buf.getvalue())
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    else:
        raise ValueError(where)


def entry_points(run: Path, tmp: Path):
    """name -> a call that reads the run's last checkpoint the way that entry point does."""
    from attnzoo.cli import ckpt as ckpt_cli
    from attnzoo.cli import export as export_cli
    from attnzoo.distributed.fsdp import load_sharded
    from attnzoo.inference.generate import load
    from attnzoo.training.checkpoint_io import check_checkpoint
    from attnzoo.training.fsdp import FSDPStrategy
    from attnzoo.training.run import train

    last = run / "checkpoints" / "last.ckpt"
    return {
        "check_checkpoint (eval, generate, export, info)": lambda: check_checkpoint(last),
        "resume check (weights=False)": lambda: check_checkpoint(last, weights=False),
        "load_sharded": lambda: load_sharded(last),
        "attnzoo-ckpt info": lambda: ckpt_cli.main(["info", str(last)]),
        "attnzoo-ckpt consolidate": lambda: ckpt_cli.main(["consolidate", str(last), str(tmp / "one.ckpt")]),
        "attnzoo.load / attnzoo-generate": lambda: load(run),
        "attnzoo-export": lambda: export_cli.main([str(run), str(tmp / "hf")]),
        "FSDPStrategy.load_checkpoint (Lightning's DCP load)": lambda: FSDPStrategy.load_checkpoint(object(), last),
        "train ckpt_path= (1 process)": lambda: train(compose_cfg(
            ["debug=smoke", "data.tokenizer=char", f"ckpt_path={last}"], tmp / "resume1")),
        "train ckpt_path= (trainer=fsdp_cpu)": lambda: train(compose_cfg(
            ["debug=smoke", "data.tokenizer=char", "trainer=fsdp_cpu", "trainer.devices=1", f"ckpt_path={last}"],
            tmp / "resume2")),
    }


def refused_in_one_line(call, capsys) -> str:
    """The call refuses: a ConfigError, or a CLI's exit 2 with one `error:` line on stderr. Returns the message."""
    try:
        call()
    except ConfigError as e:
        msg = str(e)
    except SystemExit as e:
        assert e.code == 2, e.code
        msg = capsys.readouterr().err.strip()
    else:
        raise AssertionError("the checkpoint was accepted")
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("where", [".metadata", "meta.pt", ".distcp"])
def test_a_payload_never_runs_in_any_entry_point(where, sharded_run, tmp_path, capsys):
    env = dict(os.environ)
    run = copy_run(sharded_run, tmp_path / "run")
    marker = tmp_path / "marker"
    plant(run, where, marker)
    names = []
    for name, call in entry_points(run, tmp_path).items():
        msg = refused_in_one_line(call, capsys)
        assert not marker.exists(), f"{name}: the payload ran"
        assert where in msg and "nothing in the checkpoint was loaded" in msg, (name, msg)
        names.append(name)
    assert len(names) == 10
    assert dict(os.environ) == env  # no entry point left LOCAL_RANK / RANK behind for the tests after this one


def test_the_unplanted_checkpoint_loads(sharded_run, tmp_path):
    """The same readers accept what trainer=fsdp writes (and consolidate it)."""
    from attnzoo.cli import ckpt as ckpt_cli
    from attnzoo.training.checkpoint_io import check_checkpoint

    state = check_checkpoint(sharded_run / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 2 and state["optimizer_states"][0]["param_groups"][0]["lr"] > 0
    ckpt_cli.main(["consolidate", str(sharded_run / "checkpoints" / "last.ckpt"), str(tmp_path / "one.ckpt")])
    assert check_checkpoint(tmp_path / "one.ckpt")["global_step"] == 2


def test_consolidate_under_a_file_is_one_line(sharded_run, tmp_path, capsys):
    """Issue 43: `attnzoo-ckpt consolidate SRC notes.txt/x.ckpt` ended in FileExistsError."""
    from attnzoo.cli import ckpt as ckpt_cli

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        ckpt_cli.main(["consolidate", str(sharded_run / "checkpoints" / "last.ckpt"), str(tmp_path / "notes.txt" / "x.ckpt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0, err
    assert err == (f"attnzoo-ckpt: error: DST: {tmp_path}/notes.txt/x.ckpt cannot be written ({tmp_path}/notes.txt is "
                   f"a file, not a directory); allowed: a path under a writable directory")


def test_consolidate_into_its_own_folder_is_refused_and_the_folder_kept(sharded_run, tmp_path, capsys):
    """Issue 43 item 3: `attnzoo-ckpt consolidate SRC SRC/meta.pt` overwrote the folder's meta.pt with the consolidated
    file (the sharded checkpoint lost); a DST inside SRC is refused before anything is read or written."""
    from attnzoo.cli import ckpt as ckpt_cli

    folder = folder_of(copy_run(sharded_run, tmp_path / "run"))
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    for dst in (folder / "meta.pt", folder / "one.ckpt"):
        with pytest.raises(SystemExit) as e:
            ckpt_cli.main(["consolidate", str(folder), str(dst)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err == (f"attnzoo-ckpt: error: DST: {dst} is inside SRC {folder}, which the file "
                                             f"would overwrite or join; allowed: a path outside the checkpoint folder "
                                             f"(e.g. model.ckpt)"), err
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before


@pytest.mark.parametrize("payload, what", [
    (torch.zeros(3), "it holds an object of type Tensor, not a dict with state_dict and global_step"),
    ({"state_dict": 5, "global_step": 1}, "its state_dict is of type int, not a dict of tensors"),
], ids=["tensor", "state_dict-int"])
def test_info_on_a_torch_file_that_is_not_a_checkpoint(payload, what, tmp_path, capsys):
    """Issue 43 item 3: `attnzoo-ckpt info` of a torch.save'd tensor ended in a RuntimeError traceback from
    `"state_dict" in tensor`."""
    from attnzoo.cli import ckpt as ckpt_cli

    torch.save(payload, tmp_path / "x.ckpt")
    with pytest.raises(SystemExit) as e:
        ckpt_cli.main(["info", str(tmp_path / "x.ckpt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"attnzoo-ckpt: error: CKPT: {tmp_path}/x.ckpt is not a training checkpoint " \
        f"({what}){'; allowed: a checkpoint attnzoo-train wrote' if 'Tensor' in what else ''}", err


@pytest.mark.parametrize("what, line", [
    ("text", "CKPT: <p> is corrupt or truncated (not a complete torch zip archive)"),
    ("empty folder", "CKPT: <p> is a directory; allowed: a .ckpt file, a complete sharded checkpoint folder"),
    ("zip", "CKPT: <p> cannot be loaded ("),
])
def test_info_on_a_file_or_folder_that_is_not_a_checkpoint(what, line, tmp_path, capsys):
    """`attnzoo-ckpt info` of a text file, an empty folder, a zip that torch did not write: one line each."""
    import zipfile

    from attnzoo.cli import ckpt as ckpt_cli

    p = tmp_path / "x"
    if what == "text":
        p.write_text("notes")
    elif what == "empty folder":
        p.mkdir()
    else:
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("a.txt", "x")
    with pytest.raises(SystemExit) as e:
        ckpt_cli.main(["info", str(p)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and err.startswith("attnzoo-ckpt: error: " + line.replace("<p>", str(p)))


def test_a_payload_in_a_single_file_checkpoint(tmp_path, capsys):
    """A .ckpt holding a payload: weights_only refuses it in one line, unrun."""
    from attnzoo.training.checkpoint_io import check_checkpoint

    marker = tmp_path / "marker"
    torch.save({"global_step": 1, "state_dict": {}, "x": Payload(f"open({str(marker)!r}, 'w')")},
               tmp_path / "bad.ckpt")
    msg = refused_in_one_line(lambda: check_checkpoint(tmp_path / "bad.ckpt"), capsys)
    assert "bad.ckpt cannot be loaded" in msg and not marker.exists()


def test_the_torch_free_config_read_never_runs_a_payload(tmp_path):
    """distributed/checkpoint_files.saved_run_config (attnzoo-generate's early look at a run's config) reads the
    archive's pickle with its own allowlist: a payload anywhere in it - beside the config or inside it - stops the
    read (None: the caller loads with weights_only as before), unrun; a plain checkpoint's config reads whole."""
    from attnzoo.distributed.checkpoint_files import saved_run_config

    marker = tmp_path / "marker"
    cfg = {"model": {"max_seq_len": 40, "position": {"name": "learned"}}, "data": {"name": "text"}}
    torch.save({"global_step": 1, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cfg": cfg}},
               tmp_path / "plain.ckpt")
    assert saved_run_config(tmp_path / "plain.ckpt") == cfg
    for i, where in enumerate(("beside", "inside")):
        bad = {"global_step": 1, "state_dict": {"w": torch.ones(2)},
               "hyper_parameters": {"cfg": {**cfg, "x": Payload(f"open({str(marker)!r}, 'w')")} if where == "inside"
                                    else cfg}}
        if where == "beside":
            bad["x"] = Payload(f"open({str(marker)!r}, 'w')")
        torch.save(bad, tmp_path / f"bad{i}.ckpt")
        assert saved_run_config(tmp_path / f"bad{i}.ckpt") is None and not marker.exists(), where


@pytest.mark.parametrize("damage,expect", [
    ("escape", "names a shard outside the folder ('../outside.distcp')"),
    ("absolute", "names a shard outside the folder ('/tmp/"),
    ("missing-shard", "__0_0.distcp is missing"),
    ("truncated-shard", "__0_0.distcp is truncated"),
    ("garbage-metadata", ".metadata is not a plain torch.distributed.checkpoint index"),
    ("truncated-metadata", ".metadata is not a plain torch.distributed.checkpoint index"),
])
def test_damaged_folders_are_refused_in_one_line(damage, expect, sharded_run, tmp_path, capsys):
    from attnzoo.training.checkpoint_io import check_checkpoint

    run = copy_run(sharded_run, tmp_path / "run")
    folder = folder_of(run)
    md_bytes = (folder / ".metadata").read_bytes()
    md = pickle.loads(md_bytes)
    if damage in ("escape", "absolute"):
        outside = tmp_path / "outside.distcp"
        shutil.copy(folder / "__0_0.distcp", outside)
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp" if damage == "escape" else str(outside)
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    elif damage == "missing-shard":
        (folder / "__0_0.distcp").unlink()
    elif damage == "truncated-shard":
        data = (folder / "__0_0.distcp").read_bytes()
        (folder / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    elif damage == "garbage-metadata":
        (folder / ".metadata").write_bytes(b"not a pickle at all")
    else:
        (folder / ".metadata").write_bytes(md_bytes[: len(md_bytes) // 2])
    for weights in (True, False):
        msg = refused_in_one_line(lambda: check_checkpoint(run / "checkpoints" / "last.ckpt", weights=weights), capsys)
        assert msg.startswith("ckpt_path: ") and expect in msg, msg
