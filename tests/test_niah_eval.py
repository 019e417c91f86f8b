"""`attnzoo-eval RUN --task niah` (inference/niah.py): the accuracies it writes per (task, length, depth) are the
scores of greedy completions that the model's own full-forward generation reproduces; the JSON's cells, means and
heatmap; refusals in one line (before the run is loaded where they need no run)."""
from __future__ import annotations

import json

import pytest
import torch

from attnzoo.data.needles import make_samples, score
from attnzoo.inference import generate as inference
from attnzoo.inference.generate import eval_main, load
from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, compose_cfg

# a char-level text run with RoPE sized for 1,024 positions, trained a few steps: prompts of a few hundred tokens
RUN = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=64", "model.max_seq_len=1024",
       "trainer.max_steps=2", "trainer.val_check_interval=2", "perf.measure_decode=false", "sample.max_new_tokens=0"]
ARGS = ["--task", "niah", "--niah-tasks", "passkey,niah_single_2", "--lengths", "400", "560", "--depths", "0", "1",
        "--samples", "2", "--batch-size", "3"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("niah") / "run"
    train(compose_cfg(RUN, out))
    return out


def test_accuracies_are_the_greedy_completions_scores(text_run, tmp_path, capsys):
    out = tmp_path / "niah.json"
    eval_main([str(text_run), *ARGS, "--out", str(out)])
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000 and "wrote" in capsys.readouterr().out
    assert set(res["accuracy"]) == {"passkey", "niah_single_2"}
    assert all(set(res["accuracy"][t]) == {"400", "560"} and set(res["accuracy"][t]["400"]) == {"0.0", "1.0"}
               for t in res["accuracy"])
    # the same prompts completed by the model's own generate (full forward each step, no static cache)
    from attnzoo.inference.niah import haystack_text

    run = load(text_run)
    hay, _ = haystack_text(run, None)
    samples = make_samples(["passkey", "niah_single_2"], [400, 560], [0.0, 1.0], 2, run.encode, hay, 0)
    n = res["new_tokens"]
    want: dict = {}
    for s in samples:
        idx = torch.tensor([run.encode(s.prompt)])
        with torch.no_grad():
            new = run.model.generate(idx, n, temperature=0.0)[0, idx.shape[1]:].tolist()
        want.setdefault((s.task, str(s.length), str(s.depth)), []).append(score(run.decode(new), s.answers))
    for (task, length, depth), scores in want.items():
        assert res["accuracy"][task][length][depth] == pytest.approx(sum(scores) / len(scores)), (task, length, depth)
    for task in res["accuracy"]:
        cells = [v for ds in res["accuracy"][task].values() for v in ds.values()]
        assert res["by_task"][task] == pytest.approx(sum(cells) / len(cells))


@pytest.mark.parametrize("extra,line", [
    (["--depths", "1.5"], "--depths: got 1.5; allowed: fractions of the haystack in [0, 1]"),
    (["--niah-tasks", "needle"], "--niah-tasks: unknown task 'needle'; allowed: niah_single_1"),
    (["--samples", "0"], "--samples: must be >= 1, got 0"),
    (["--text", "x.txt"], "--text: is an option of --task lm"),
    (["--haystack", "/nonexistent"], "--haystack: /nonexistent does not exist"),
])
def test_bad_settings_are_refused_before_the_run_is_loaded(extra, line, text_run, capsys, monkeypatch):
    monkeypatch.setattr(inference, "load", lambda *a, **k: pytest.fail("loaded the run before checking"))
    with pytest.raises(SystemExit) as e:
        eval_main([str(text_run), *ARGS, *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and err.startswith(f"attnzoo-eval: error: {line}"), err


def test_lengths_past_the_models_positions_are_refused(text_run, capsys):
    with pytest.raises(SystemExit):
        eval_main([str(text_run), "--task", "niah", "--niah-tasks", "passkey", "--lengths", "1020", "--samples", "1"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnzoo-eval: error: --lengths: 1020 tokens + ") and "model.max_seq_len=1024" in err, err
    assert "--extrapolate" in err


def test_the_sweep_report_shows_each_variants_needle_grid(tmp_path):
    """attnzoo-report on a data=needle sweep (fabricated jobs, each with the niah.json a run writes at its end): one
    heatmap panel per variant in plots/niah.png and a table of the accuracy per length, the mean over depths, taking
    each variant's best learning rate (as the report's other tables)."""
    import json

    import matplotlib.pyplot as plt

    from attnzoo.analysis.niah import summarise_cells
    from attnzoo.analysis.report import build_report
    from tests.test_report_html import write_job

    def grid(acc64, acc128):  # two depths per length
        return summarise_cells({"needle": {64: {0.0: [acc64[0]], 1.0: [acc64[1]]},
                                           128: {0.0: [acc128[0]], 1.0: [acc128[1]]}}})

    jobs = {("gqa", 1e-3): (0.9, grid((1.0, 1.0), (0.5, 0.25))), ("gqa", 3e-3): (0.2, grid((0.0, 0.0), (0.0, 0.0))),
            ("gated_deltanet", 1e-3): (0.8, grid((1.0, 0.75), (1.0, 0.5)))}
    for i, ((mixer, lr), (acc, result)) in enumerate(jobs.items()):
        job = tmp_path / "needle" / str(i)
        write_job(job, [f"model/mixer={mixer}", f"optim.lr={lr}"], {"val/acc": acc, "val/loss": 1.0 - acc})
        (job / "niah.json").write_text(json.dumps(result))
    rep = build_report(tmp_path / "needle")
    assert set(rep["niah"]) == {"needle"} and set(rep["niah"]["needle"]) == {"model/mixer=gqa", "model/mixer=gated_deltanet"}
    gqa = rep["niah"]["needle"]["model/mixer=gqa"]  # the lr with the best val/acc, not the other one's zeros
    assert gqa["by_length"] == {"64": 1.0, "128": 0.375} and gqa["mean"] == pytest.approx(0.6875)
    md = (tmp_path / "needle" / "report.md").read_text()
    assert "| model/mixer=gqa | 1.000 | 0.375 | 0.688 |" in md and "| model/mixer=gated_deltanet | 0.875 | 0.750 |" in md
    assert "![niah](plots/niah.png)" in md and "<h2>Needle in a haystack</h2>" in (tmp_path / "needle" / "report.html").read_text()
    image = plt.imread(tmp_path / "needle" / "plots" / "niah.png")
    assert image.shape[1] > image.shape[0] > 100  # two panels side by side


def test_a_text_run_evaluates_rulers_tasks_at_its_end_as_attnzoo_eval_does(tmp_path, capsys):
    """eval.niah_tasks on a text run: after training, niah.json / niah.png and niah/<task>@<length>@<depth> in the
    summary, each cell what attnzoo-eval --task niah gives on the same checkpoint with the run's seed and the same
    completion length; a length too short for a task's question (the training length, 64 characters) is left out
    of its grid and said so. The sweep report draws one heatmap figure and one table per task."""
    from attnzoo.analysis.report import build_report
    from tests.test_report_html import write_job

    out = tmp_path / "sweep" / "0"
    train(compose_cfg([*RUN, "eval.context_lengths=[400]", "eval.niah_tasks=[passkey,niah_single_2]",
                       "eval.niah_depths=[0,1]", "eval.niah_samples=2"], out))
    assert "niah: passkey left out at 64 tokens" in capsys.readouterr().out
    res = json.loads((out / "niah.json").read_text())
    assert res["too_short"] == {"passkey": [64], "niah_single_2": [64]} and (out / "niah.png").stat().st_size > 10_000
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    seed = json.loads((out / "summary.json").read_text())["config"]["seed"]
    for task in ("passkey", "niah_single_2"):
        assert {f"niah/{task}@400@0.0", f"niah/{task}@400@1.0"} <= set(metrics)
        eval_main([str(out), "--task", "niah", "--niah-tasks", task, "--lengths", "400", "--depths", "0", "1",
                   "--samples", "2", "--batch-size", "2", "--seed", str(seed), "--max-new-tokens",
                   str(res["new_tokens"][task]), "--out", str(tmp_path / f"{task}.json")])
        want = json.loads((tmp_path / f"{task}.json").read_text())
        assert res["accuracy"][task] == want["accuracy"][task]
        assert metrics[f"niah/{task}@400@1.0"] == want["accuracy"][task]["400"]["1.0"]
    write_job(tmp_path / "sweep" / "1", ["model/mixer=gqa"], {"val/loss": 9.0})  # a job without the grid
    (out / ".hydra").mkdir(exist_ok=True)
    (out / ".hydra" / "overrides.yaml").write_text("- model/mixer=gated_deltanet\n")
    rep = build_report(tmp_path / "sweep")
    assert set(rep["niah"]) == {"passkey", "niah_single_2"}
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert "### passkey" in md and "![niah](plots/niah_niah_single_2.png)" in md
    assert (tmp_path / "sweep" / "plots" / "niah_passkey.png").is_file()
