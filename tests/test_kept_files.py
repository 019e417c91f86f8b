"""Files a user keeps (checkpoints, exports) are safe and shareable: an export onto a full disk is one line and
leaves nothing half-written; checkpoints and exported weights follow the umask like every other file."""
import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from attnzoo.cli import export
from attnzoo.interop import hf
from attnzoo.training.checkpoint_io import AtomicCheckpointIO
from attnzoo.models.decoder import DecoderLM
from attnzoo.training.run import train
from tests.conftest import compose_cfg, tiny_model_cfg

RUN = ["debug=smoke", "data.tokenizer=char", "data.max_chars=20000", "model.n_layers=2", "trainer.max_steps=2",
       "trainer.val_check_interval=2", "perf.measure_decode=false", "sample.max_new_tokens=0", "logger=csv"]
MASKS = {0o022: 0o644, 0o002: 0o664}  # umask -> the mode open() gives a new file


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


class umask:
    def __init__(self, mask: int):
        self.mask = mask

    def __enter__(self):
        self.old = os.umask(self.mask)

    def __exit__(self, *exc):
        os.umask(self.old)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A char-level text run (its export has tokenizer files), trained under umask 0o002."""
    out = tmp_path_factory.mktemp("kept") / "run"
    with umask(0o002):
        train(compose_cfg(RUN, out))
    return out


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- export onto a full disk


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(text_run, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    def full(*a, **k):  # the tokenizer files are written by then: the case that left a half export
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "exports" / "model"
    err = one_line_error(capsys, lambda: export.main([str(text_run), str(out)]))
    assert err == f"attnzoo-export: error: OUT_DIR: cannot write {out} (No space left on device); nothing was written"
    assert not (tmp_path / "exports").exists()  # neither the export, its temporary, nor the parent it created
    (tmp_path / "empty").mkdir()  # into an existing empty directory: it stays, empty
    one_line_error(capsys, lambda: export.main([str(text_run), str(tmp_path / "empty")]))
    assert list(tmp_path.iterdir()) == [tmp_path / "empty"] and not any((tmp_path / "empty").iterdir())


def test_export_to_a_file_or_under_a_file_is_refused_before_work(text_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(export, "load_run_model", lambda *a: pytest.fail("loaded the run before checking OUT_DIR"))
    f = tmp_path / "model.bin"
    f.write_text("x")
    err = one_line_error(capsys, lambda: export.main([str(text_run), str(f)]))
    assert err == f"attnzoo-export: error: OUT_DIR: {f} is a file; allowed: a new or empty directory"
    err = one_line_error(capsys, lambda: export.main([str(text_run), str(f / "export")]))
    assert err == (f"attnzoo-export: error: OUT_DIR: {f / 'export'} cannot be created ({f} is a file, not a "
                   f"directory); allowed: a path under a writable directory")
    assert f.read_text() == "x" and sorted(tmp_path.iterdir()) == [f]


def test_export_is_complete_after_the_rename(text_run, tmp_path):
    export.main([str(text_run), str(tmp_path / "export")])
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(tmp_path.iterdir()) == [tmp_path / "export"]  # no temporary sibling left


# ----------------------------------------------------------------------------- modes follow the umask


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_checkpoint_io_follows_the_umask(mask, tmp_path):
    with umask(mask):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 1},
                                             tmp_path / "checkpoints" / "last.ckpt")
        ref = tmp_path / "plain.txt"
        ref.write_text("a file written by open()")
    assert mode(tmp_path / "checkpoints" / "last.ckpt") == mode(ref) == MASKS[mask]


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_exported_files_follow_the_umask(mask, tmp_path):
    from attnzoo.data.tokenizer import CharTokenizer

    torch.manual_seed(0)
    model = DecoderLM(tiny_model_cfg(max_seq_len=32), vocab_size=40)
    tok = CharTokenizer.train("abcdefghij klmnop\n")
    with umask(mask):
        hf.export_model(model, tmp_path / "sub" / "export", tokenizer=tok)
    out = tmp_path / "sub" / "export"
    files = sorted(out.iterdir())
    assert {p.name for p in files} == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert {p.name: mode(p) for p in files} == {p.name: MASKS[mask] for p in files}
    assert mode(out) == mode(out.parent) == 0o777 & ~mask  # the directory too (mkdtemp makes 0700)


def test_a_runs_checkpoints_and_export_follow_the_umask(text_run, tmp_path):
    """The run trained under umask 0o002: its checkpoints are 0664 like its other files (was 0600)."""
    ckpts = sorted((text_run / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in ckpts} >= {"last.ckpt", "best.ckpt"}
    assert {p.name: mode(p) for p in ckpts} == {p.name: 0o664 for p in ckpts}
    assert mode(text_run / "summary.json") == 0o664
    with umask(0o002):
        export.main([str(text_run), str(tmp_path / "export")])
    assert {mode(p) for p in (tmp_path / "export").iterdir()} == {0o664}
