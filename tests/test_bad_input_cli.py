"""Bad options of attnzoo-generate, attnzoo-eval and attnzoo-bench: exit status 2, exactly one stderr line naming
the option and what is allowed, before any work (the checkpoint is not read, the benchmark does not run) and
nothing written. The rows of docs/reliability.md's table come from scripts/bad_input_table.py (EXTRA)."""
import subprocess
import sys

import pytest
import torch

from attnzoo.inference import generate as inference
from attnzoo.bench import cli as bench_cli
from attnzoo.inference.generate import eval_main, generate_main
from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, compose_cfg

# learned positions, a table of 40: prompt + new tokens past it cannot be embedded
LEARNED = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "model/position=learned",
           "model.max_seq_len=40", "trainer.max_steps=2", "trainer.val_check_interval=2", "perf.measure_decode=false",
           "sample.max_new_tokens=0"]


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    train(compose_cfg(LEARNED, out))
    return out


def refused(capsys, main, argv) -> str:
    """Run a CLI expecting a refusal; return its one stderr line (nothing on stdout: no work began)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, cap.err
    assert cap.out == "", cap.out
    return lines[0]


@pytest.fixture
def no_load(monkeypatch):
    """The refusal comes before the checkpoint is read."""
    monkeypatch.setattr(inference, "load", lambda *a, **k: pytest.fail("read the checkpoint before checking"))


# ----------------------------------------------------------------------------- attnzoo-generate


def _empty_prompts(tmp):
    (tmp / "prompts.txt").write_text("\n  \n\n")
    return ["--prompts", str(tmp / "prompts.txt")]


def _latin1_prompts(tmp):
    (tmp / "prompts.txt").write_bytes(b"caf\xe9 au lait\n")
    return ["--prompts", str(tmp / "prompts.txt")]


def _prompts_dir(tmp):
    (tmp / "prompts").mkdir()
    return ["--prompts", str(tmp / "prompts")]


GENERATE = [  # (argv after RUN, the stderr line after "attnzoo-generate: error: ")
    (["x", "--temperature", "-0.5"], "--temperature: must be >= 0 (0: greedy), got -0.5"),
    (["x", "--temperature", "nan"], "--temperature: must be >= 0 (0: greedy), got nan"),
    (["x", "--top-p", "0"], "--top-p: must be in (0, 1] (1: no nucleus cut), got 0.0"),
    (["x", "--top-p", "1.5"], "--top-p: must be in (0, 1] (1: no nucleus cut), got 1.5"),
    (["x", "--top-k", "-1"], "--top-k: must be >= 0 (0: no top-k cut), got -1"),
    (["x", "--device", "tpu"], "--device: unknown device 'tpu'; allowed: cpu"),
    (["x", "--device", "cuda:99"], "--device: cuda:99: "),
    (_empty_prompts, "--prompts: <tmp>/prompts.txt holds no prompt (no non-blank line); allowed: one prompt per line"),
    # issue 43 item 3: a prompts file that is not UTF-8 (was a UnicodeDecodeError traceback), a folder (was "does not
    # exist"), the KV-cache flags' own values (were refused only after the checkpoint was loaded)
    (_latin1_prompts, "--prompts: <tmp>/prompts.txt is not UTF-8 text (invalid byte at offset 3); allowed: a UTF-8 "
                      "text file with one prompt per line"),
    (_prompts_dir, "--prompts: <tmp>/prompts is a directory; allowed: a text file with one prompt per line"),
    (["x", "--kv-group-size", "0"], "--kv-group-size: must be >= 1 (tokens per key scale, channels per value scale), "
                                    "got 0"),
    (["x", "--kv-cache-dtype", "int3"], "--kv-cache-dtype: got 'int3'; allowed: fp32, bf16, int8, int4"),
    (["x", "--kv-residual", "-1"], "--kv-residual: must be >= 0 (full-precision recent tokens), got -1"),
    (["x", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["x", "--max-new-tokens", "-5"], "--max-new-tokens: must be >= 1, got -5"),
]


@pytest.mark.parametrize("argv,line", GENERATE, ids=[" ".join(a) if isinstance(a, list) else a.__name__.strip("_")
                                                       for a, _ in GENERATE])
def test_generate_options_refused_before_work(argv, line, tmp_path, capsys, no_load):
    argv = argv(tmp_path) if callable(argv) else argv
    got = refused(capsys, generate_main, [str(tmp_path / "run"), *argv])
    assert got.startswith("attnzoo-generate: error: " + line.replace("<tmp>", str(tmp_path))), got


def test_a_sharded_folder_whose_save_did_not_finish_is_named_so(tmp_path, capsys, no_load):
    """attnzoo-generate / -eval on a sharded checkpoint folder without meta.pt (a save cut short): it was taken for a
    run dir ("has no checkpoints/last.ckpt"); now the line `attnzoo-ckpt info` and ckpt_path give (issue 43 item 3)."""
    folder = tmp_path / "last.ckpt.shards-0000002-abc"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    (folder / ".metadata").write_bytes(b"\0" * 64)
    want = (f"checkpoint: {folder} is a sharded checkpoint whose save did not finish (no .metadata / meta.pt); "
            f"allowed: a .ckpt file, a complete sharded checkpoint folder")
    assert refused(capsys, generate_main, [str(folder), "x"]).startswith("attnzoo-generate: error: " + want)
    assert refused(capsys, eval_main, [str(folder)]).startswith("attnzoo-eval: error: " + want)


def test_generate_past_the_learned_position_table_is_one_line(learned_run, tmp_path, capsys, monkeypatch):
    """'def ' is 4 characters: 36 new tokens fill the table of 40 exactly, 37 do not fit (was a traceback). Refused
    from the config the checkpoint carries, before the run is loaded (inference/commands.py precheck_prompt_fit),
    and in a process that never imports torch; the loaded run's own check (generate.py) gives the same line."""
    from attnzoo.distributed.checkpoint_files import saved_run_config

    want = ("attnzoo-generate: error: --max-new-tokens: the prompt (4 tokens) + 37 new tokens exceed the learned "
            "position table (model.max_seq_len=40); allowed: <= 36")
    prompts = tmp_path / "p.txt"
    prompts.write_text("d\n" + "x" * 40 + "\n")  # every prompt is checked before the first is sampled
    with monkeypatch.context() as m:
        m.setattr(inference, "load", lambda *a, **k: pytest.fail("loaded the run before checking"))
        assert refused(capsys, generate_main, [str(learned_run), "def ", "--max-new-tokens", "37"]) == want
        got = refused(capsys, generate_main, [str(learned_run), "--prompts", str(prompts), "--max-new-tokens", "1"])
        assert got == ("attnzoo-generate: error: --prompts: prompt 2 (40 tokens) fills the learned position table "
                       "(model.max_seq_len=40); allowed: a prompt of < 40 tokens")
        # --extrapolate does not stretch a learned table
        got = refused(capsys, generate_main, [str(learned_run), "def ", "--max-new-tokens", "37", "--extrapolate"])
        assert got.startswith("attnzoo-generate: error: --max-new-tokens: the prompt (4 tokens) + 37 new tokens exceed")
    # where the saved config cannot be read without torch, the loaded run refuses it in the same line
    with monkeypatch.context() as m:
        m.setattr("attnzoo.distributed.checkpoint_files.saved_run_config", lambda path: None)
        assert refused(capsys, generate_main, [str(learned_run), "def ", "--max-new-tokens", "37"]) == want
    probe = ("import sys\nfrom attnzoo.inference.commands import generate_main\ntry:\n    generate_main(sys.argv[1:])\n"
             "finally:\n    print('torch' in sys.modules, 'lightning' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, str(learned_run), "def ", "--max-new-tokens", "37"],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr.strip(), r.stdout.strip()) == (2, want, "False False")
    # the config read without torch is the one torch reads
    ckpt = learned_run / "checkpoints" / "last.ckpt"
    assert saved_run_config(ckpt) == torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["cfg"]
    generate_main([str(learned_run), "def ", "--max-new-tokens", "36", "--top-k", "0", "--top-p", "1"])  # the edge fits
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.rstrip("\n")) >= 4


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal", "none"])
def test_generate_past_max_seq_len_is_refused_for_every_position_method(position):
    """model.max_seq_len (the longest prompt + generation) caps computed positions too (was: learned only), unless
    --extrapolate; every prompt checked before the first is sampled."""
    from types import SimpleNamespace

    from attnzoo.config.errors import ConfigError

    cfg = SimpleNamespace(max_seq_len=40, position=SimpleNamespace(name=position))
    run = SimpleNamespace(model=SimpleNamespace(cfg=cfg), encode=lambda p: list(p.encode()))
    inference._check_prompts(run, ["def "], 36)  # the edge fits
    with pytest.raises(ConfigError) as e:
        inference._check_prompts(run, ["d", "def "], 37)
    assert str(e.value) == (f"--max-new-tokens: prompt 2 (4 tokens) + 37 new tokens exceed model.max_seq_len=40 "
                            f"({position} positions: lengths the model is not sized for); allowed: <= 36, or "
                            f"--extrapolate to generate past it")
    inference._check_prompts(run, ["def "], 1000, extrapolate=True)


# ----------------------------------------------------------------------------- attnzoo-eval


def _file(tmp):
    (tmp / "f.txt").write_text("x")
    return tmp / "f.txt"


EVAL = [
    (lambda t: ["--context-lengths", "64", "0", "-5"], "--context-lengths: got 0 -5; allowed: lengths >= 2"),
    (lambda t: ["--max-batches", "0"], "--max-batches: must be >= 1, got 0; allowed: omit it for every batch"),
    (lambda t: ["--out", str(_file(t) / "eval.json")],
     "--out: <tmp>/f.txt/eval.json cannot be written (<tmp>/f.txt is a file, not a directory); allowed: a path "
     "under a writable directory"),
    (lambda t: ["--out", str(t)], "--out: <tmp> is a directory; allowed: a file path"),
    (lambda t: ["--device", "npu"], "--device: unknown device 'npu'; allowed: cpu"),
    (lambda t: ["--kv-residual", "-2"], "--kv-residual: must be >= 0 (full-precision recent tokens), got -2"),
]


@pytest.mark.parametrize("argv,line", EVAL, ids=[e[1].split(":")[0] + str(i) for i, e in enumerate(EVAL)])
def test_eval_options_refused_before_work(argv, line, learned_run, tmp_path, capsys, no_load):
    got = refused(capsys, eval_main, [str(learned_run), *argv(tmp_path)])
    assert got.startswith("attnzoo-eval: error: " + line.replace("<tmp>", str(tmp_path))), got
    assert not (learned_run / "eval.json").exists() and not (tmp_path / "f.txt" / "eval.json").exists()


# ----------------------------------------------------------------------------- attnzoo-bench


BENCH = [
    (lambda t: ["--threads", "0"], "--threads: must be >= 1, got 0; allowed: omit it for torch's default"),
    (lambda t: ["--threads", "-2"], "--threads: must be >= 1, got -2"),
    (lambda t: ["--out", str(_file(t))], "--out: <tmp>/f.txt is a file; allowed: a folder (new or existing)"),
    (lambda t: ["--out", str(_file(t) / "bench")],
     "--out: <tmp>/f.txt/bench cannot be created (<tmp>/f.txt is a file, not a directory); allowed: a folder under "
     "a writable directory"),
]


@pytest.mark.parametrize("argv,line", BENCH, ids=[b[1].split(";")[0] for b in BENCH])
def test_bench_options_refused_before_the_benchmark_runs(argv, line, tmp_path, capsys, monkeypatch):
    mods = bench_cli.subcommands()
    monkeypatch.setattr(bench_cli, "subcommands", lambda: mods)
    monkeypatch.setattr(mods["cache"], "run", lambda args: pytest.fail("the benchmark ran before the check"))
    threads = torch.get_num_threads()
    argv = argv(tmp_path)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "bench")]
    got = refused(capsys, bench_cli.main, [*out, *argv, "cache", "--quick"])
    assert got.startswith("attnzoo-bench cache: error: " + line.replace("<tmp>", str(tmp_path))), got
    assert torch.get_num_threads() == threads and not (tmp_path / "bench").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["f.txt"])


def test_bench_train_with_an_unknown_mixer_is_one_line(tmp_path, capsys):
    """attnzoo-bench train --mixer nope (and any attnzoo.load_config caller): the CLI's one line, not Hydra's
    MissingConfigException with its search path; nothing written."""
    got = refused(capsys, bench_cli.main, ["--out", str(tmp_path / "bench"), "train", "--quick", "--mixer", "nope"])
    assert got.startswith("attnzoo-bench train: error: model/mixer: unknown option 'nope'; allowed: deltanet, "), got
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("argv, line", [
    (["experiment=mqar", "model/mixer=gated_deltanet", "model.mixer.use_gate=true"],
     "model.mixer.use_gate: every layer (gated_deltanet) takes its settings from model.mixers.gated_deltanet (the "
     "experiment's recipe), which this value would not reach; allowed: model.mixers.gated_deltanet.use_gate=true"),
    (["experiment=mqar", "model/mixer=gqa", "model.mixer.conv_size=2"], None),  # gqa has no recipe entry: reaches
    (["experiment=mqar", "model/mixer=gla", "model.mixers.gla.use_gate=true"], None),
])
def test_a_mixer_override_the_recipe_shadows_is_refused_with_the_key_that_reaches(argv, line):
    """experiment=mqar gives some mixers the sweep's settings through model.mixers.<name>: a model.mixer.<key> for
    them would be silently dropped, so the CLI refuses it naming the key that reaches the layers."""
    from attnzoo.cli.train import check_unknown_keys

    assert check_unknown_keys(argv) == line


def test_an_output_dir_under_a_file_is_one_line_from_the_command(tmp_path, monkeypatch, capsys):
    """attnzoo-train's own record of a new run dir (.hydra) is written before the checks; under a file it is skipped
    and the checks name paths.output_dir in one line (was a NotADirectoryError traceback; found by
    scripts/refusal_bench.py, the in-process case of tests/test_bad_input.py never reached it)."""
    from tests.conftest import cli_train

    (tmp_path / "a.txt").write_text("x")
    code, out, err = cli_train(["debug=smoke", "data.tokenizer=char", f"paths.output_dir={tmp_path}/a.txt/run",
                                f"hydra.run.dir={tmp_path}/hydra"], monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and lines == [f"attnzoo: error: paths.output_dir: {tmp_path}/a.txt/run is not writable "
                                   f"({tmp_path}/a.txt is not a directory); allowed: a writable directory"], err
