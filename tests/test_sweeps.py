"""Named sweeps: every sweeps/*.yaml composes and validates; smoke sweeps run end to end as Hydra multiruns
(jobs one after another in this process); the report equals the runs' summary.json; a failing job is
recorded and the others finish; wandb offline gives one run per job, grouped by sweep; matched budgets."""
import copy
import csv
import json
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

from attnzoo.training.budget import apply_budget, count_params, match_budget
from attnzoo.config.schema import ConfigError
from attnzoo.training.config_checks import validate
from attnzoo.config.paths import CONF_DIR, sweeps_dir
from attnzoo.analysis.report import build_report
from attnzoo.cli.sweep import available, smoke_overlay
from attnzoo.cli.sweep import main as sweep_main
from tests.conftest import SESSION_CACHE, SMALL_TEXT
from tests.shards_fixture import text_corpus

SWEEPS = available()


_PREPARED: list = []


def prepared_corpus() -> str:
    """A tiny prepared corpus (attnzoo-data prepare's layout) for the sweeps on data=shards; one per process."""
    if not _PREPARED:
        import atexit
        import shutil

        folder = tempfile.mkdtemp(prefix="attnzoo-shards-")
        atexit.register(shutil.rmtree, folder, True)  # removed when the worker exits (was: left in /tmp)
        _PREPARED.append(str(text_corpus(Path(folder) / "out")))
    return _PREPARED[0]


def compose_sweep(name: str, overrides=()):
    def composed(extra):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", overrides=[f"hydra.searchpath=[file://{sweeps_dir().parent}]", f"+sweeps={name}",
                                               *smoke_overlay(name, list(overrides)), f"paths.cache_dir={SESSION_CACHE}",
                                               "paths.output_dir=/tmp/unused", *extra, *overrides], return_hydra_config=True)

    # a sweep on a prepared corpus (data=shards) names its data.path on the command line: the tests give a tiny one;
    # once a sweep is known to be on shards, it is composed with it directly (one compose, not two)
    if name in _ON_SHARDS:
        cfg = composed([f"data.path={prepared_corpus()}"])
        assert cfg.data.name == "shards", (name, overrides)
        return cfg
    cfg = composed([])
    if cfg.data.name != "shards":
        return cfg
    _ON_SHARDS.add(name)
    return composed([f"data.path={prepared_corpus()}"])


_ON_SHARDS: set = set()  # the sweeps compose_sweep found on data=shards


def with_overrides(cfg, *overrides: str):
    """A copy of composed `cfg` with `overrides` applied as Hydra's compose applies them after it composed the
    defaults list (ConfigLoaderImpl._apply_overrides_to_config): the same config as composing again with them (but
    Hydra's record of the command line under `hydra:`), for overrides of plain values (no config group, nothing
    added or deleted), at the cost of a copy, not a compose."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    assert all(o.package is None and not picks_a_group(cfg, o.key_or_group) and not o.is_add() and not o.is_delete()
               and not o.is_sweep_override() for o in parsed), overrides
    out = copy.deepcopy(cfg)
    ConfigLoaderImpl._apply_overrides_to_config(parsed, out)
    return out


def picks_a_group(cfg, key: str) -> bool:
    """`key=...` chooses an option of a config group (model/mixer, data, ...: Hydra's choices of `cfg`, composed with
    its hydra config): composing with it changes the defaults list."""
    return key.lstrip("+~") in cfg.hydra.runtime.choices or "/" in key


def grid(cfg) -> dict[str, list[str]]:
    return {k: [v.strip() for v in _split(str(vals))] for k, vals in cfg.hydra.sweeper.params.items()}


def _split(s: str) -> list[str]:
    """Split a sweep string on top-level commas ('[a,b],[c]' -> ['[a,b]', '[c]'])."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def test_expected_sweeps_exist():
    assert {"mixers", "kv_heads", "window", "hybrid_ratio", "moe", "lm"} <= set(SWEEPS)


def multirun_config(name: str, extra: list):
    """sweeps/NAME's multirun config as Hydra hands it to attnzoo-sweep's callbacks (its grid in
    hydra.sweeper.params), with Hydra left initialized, as check_grid finds it in a sweep."""
    from attnzoo.cli.sweep import hydra_argv

    argv = [a for a in hydra_argv(name, extra) if a != "-m"]
    GlobalHydra.instance().clear()
    initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
    return compose(config_name="train", overrides=argv, return_hydra_config=True)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_and_every_value_validates(name, monkeypatch):
    """Each grid value, with the other keys at their first value, composes and passes validation: checked by
    attnzoo-sweep's own grid check (cli/sweep.check_grid, before the first job), at the sweep's full size and in its
    debug=smoke form (the README's), every value validated (counted: a value that could not be composed would be
    skipped by check_grid and is a failure here). A sweep on a prepared corpus (data=shards) without one is refused
    before its first job; with one, it passes."""
    from hydra.core.hydra_config import HydraConfig

    import attnzoo.training.config_checks as checks
    from attnzoo.cli.sweep import check_grid

    calls = []
    validate = checks.validate
    monkeypatch.setattr(checks, "validate", lambda cfg: calls.append(1) or validate(cfg))
    try:
        for extra in ([f"paths.cache_dir={SESSION_CACHE}"], ["debug=smoke", f"paths.cache_dir={SESSION_CACHE}"]):
            cfg = multirun_config(name, extra)
            HydraConfig.instance().set_config(cfg)
            if cfg.data.name == "shards" and not cfg.data.get("path"):  # the user's prepared corpus (lm_125m, ...)
                assert check_grid(cfg).startswith("data.path: is required with data=shards"), name
                cfg = multirun_config(name, [*extra, f"data.path={prepared_corpus()}"])
                HydraConfig.instance().set_config(cfg)
            g = grid(cfg)
            assert g and all(g.values())
            calls.clear()
            assert check_grid(cfg) is None, (name, extra)
            assert len(calls) == 1 + sum(len(v) - 1 for v in g.values()), (name, extra, len(calls))
    finally:  # no Hydra state left for the next test in this worker (a run reads HydraConfig when it is set)
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_smoke_form_is_small_and_valid(name):
    base = compose_sweep(name, ["debug=smoke"])
    g = grid(base)
    first = [f"{k}={v[0]}" for k, v in g.items()]
    # the first job: composed again where the grid picks a config group (its defaults list changes); else the same
    # config is the composed one with the grid's first values set as Hydra sets them
    cfg = (compose_sweep(name, ["debug=smoke", *first]) if any(picks_a_group(base, k) for k in g)
           else with_overrides(base, *first))
    assert cfg.trainer.max_steps <= 10 and cfg.trainer.limit_val_batches <= 2
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg)


def run_sweep(name: str, sweep_dir: Path, *overrides: str) -> dict:
    sweep_main([name, "debug=smoke", f"hydra.sweep.dir={sweep_dir}", f"paths.cache_dir={SESSION_CACHE}",
                "perf.decode_tokens=2", *overrides])
    return build_report(sweep_dir)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_mixers_smoke_sweep_and_report(tmp_path):
    d = tmp_path / "mixers"
    rep = run_sweep("mixers", d, "model/mixer=gqa,deltanet", "data.num_kv_pairs=4", "model.d_model=32",
                    "optim.lr=1e-3,3e-3", "data.train_size=256", "data.val_size=16")
    rows = read_csv(d / "report.csv")
    job_dirs = sorted(p.parent for p in d.glob("*/summary.json"))
    assert len(rows) == len(job_dirs) == 4
    for row in rows:
        summary = json.loads((d / row["job"] / "summary.json").read_text())
        assert row["status"] == summary["status"] == "ok"
        for key in ("val/acc", "val/loss", "perf/tokens_per_sec", "cache/bytes_per_token", "params/total"):
            assert float(row[key]) == summary["metrics"][key], key  # exact: the CSV keeps full precision
        assert row["mixer"] == summary["model"]["mixers"][0]
        # what each layer really was, from summary.json (2 layers of 32 wide, 4 heads of 8; GQA's 2 KV heads)
        expect = {"gqa": "2x gqa h4 kv2 d8 conv4", "deltanet": "2x deltanet n_qk_heads=4 n_v_heads=4 qk_dim=8 v_dim=8 state_shape=8x8 conv4"}[row["mixer"]]
        assert row["layers"].startswith(expect), row["layers"]
    assert {r["mixer"] for r in rows} == {"gqa", "deltanet"}
    # best of two learning rates: one row per mixer, the better val/acc of its two jobs
    assert len(rep["best"]) == 2
    for b in rep["best"]:
        accs = [float(r["val/acc"]) for r in rows if r["mixer"] == b["mixer"]]
        assert b["metrics"]["val/acc"] == max(accs)
    for name in ("curves.png", "acc_vs_cache.png", "tokens_per_sec.png", "mqar_difficulty.png", "recall_vs_state.png"):
        p = d / "plots" / name
        assert p.is_file() and p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 1000, name
    html = (d / "report.html").read_text()
    # the 5 PNGs embedded as <img src='data:...'> (the page's plotly.js holds a base64 PNG string of its own)
    assert html.count("src='data:image/png;base64,") == 5 and "deltanet" in html
    md = (d / "report.md").read_text()
    assert "attnzoo-sweep mixers" in md and md.count("| ok |") == 6  # 2 best rows + 4 job rows


def test_failing_job_is_recorded_and_others_finish(tmp_path, capfd):
    d = tmp_path / "kv"
    with pytest.raises(SystemExit) as e:  # the sweep ends with a failing status when any job failed
        # job 0 diverges at run time (no clipping, lr 1e30: a non-finite loss stops it); a value any job would
        # refuse is refused before the first job instead (tests/test_bad_input.py, cli/sweep.check_grid)
        run_sweep("kv_heads", d, "model.n_kv_heads=2", "optim.lr=1e30,3e-3", "trainer.gradient_clip_val=null",
                  "data.train_size=128", "data.val_size=16")
    assert e.value.code == 1 and "attnzoo: 1 ok, 1 failed" in capfd.readouterr().out
    rep = build_report(d)
    rows = {r["job"]: r for r in read_csv(d / "report.csv")}
    assert rows["0"]["status"] == "failed" and "non-finite" in rows["0"]["error"]
    assert (d / "0" / "error.txt").is_file()
    assert rows["1"]["status"] == "ok" and float(rows["1"]["val/loss"]) > 0
    # 8 query heads, 2 KV heads, head_dim 32/8=4, 2 layers, K and V, fp32; plus the input conv's tail
    # (2 layers x d_model 32 x 3 columns, fp32) spread over the 64-token context
    assert float(rows["1"]["cache/bytes_per_token"]) == 2 * 2 * 2 * 4 * 4 + 2 * 32 * 3 * 4 / 64
    assert "**FAILED**" in (d / "report.md").read_text() and "class='failed'" in (d / "report.html").read_text()
    assert [j["status"] for j in rep["jobs"]] == ["failed", "ok"]
    # (the kv_heads variants as series of their own: tests/test_report.py, on written jobs)


def test_sweep_rerun_skips_finished_jobs_and_resumes_interrupted_ones(tmp_path, capfd):
    d = tmp_path / "win"
    # one after another in this process (hydra/launcher=basic): the parallel launcher is tested above
    args = ("model.mixer.window=8,64", "optim.lr=3e-3", "data.train_size=128", "data.val_size=16", "hydra/launcher=basic")
    run_sweep("window", d, *args)
    first = {j: json.loads((d / j / "summary.json").read_text()) for j in ("0", "1")}
    # job 1 "interrupted": its summary gone, its last.ckpt kept (as after a SIGKILL)
    (d / "1" / "summary.json").unlink()
    capfd.readouterr()
    run_sweep("window", d, *args)
    out = capfd.readouterr().out
    assert "finished earlier; skipped" in out and "resuming" in out
    assert "attnzoo: 1 ok, 0 failed, 1 skipped (skipped: finished earlier)" in out
    assert json.loads((d / "0" / "summary.json").read_text()) == first["0"]  # untouched
    again = json.loads((d / "1" / "summary.json").read_text())
    assert again["status"] == "ok" and again["global_step"] == first["1"]["global_step"]
    assert again["metrics"]["val/loss"] == pytest.approx(first["1"]["metrics"]["val/loss"], abs=1e-6)


def test_wandb_offline_one_run_per_job_grouped_by_sweep(tmp_path, monkeypatch, capfd):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    d = tmp_path / "window_sweep"
    run_sweep("window", d, "logger=wandb", "model.mixer.window=8,64", "optim.lr=3e-3", "data.train_size=128", "data.val_size=16",
              "hydra/launcher=basic")  # in this process, so the console lines are captured here
    out = capfd.readouterr().out
    assert out.count("attnzoo: wandb offline run in") == 2 and "group window/window_sweep" in out
    runs = sorted(d.glob("*/wandb/offline-run-*"))
    assert len(runs) == 2 and len({r.parent.parent for r in runs}) == 2  # one run in each job's directory
    for r in runs:
        blob = b"".join(p.read_bytes() for p in r.glob("*.wandb"))
        # the run's group is "<sweep name>/<sweep dir>" (from +sweeps=window and the dir): a length-prefixed
        # protobuf string in the run record; another sweep dir would be another group
        group = b"window/window_sweep"
        assert bytes([len(group)]) + group in blob
    assert all(r["status"] == "ok" for r in read_csv(d / "report.csv"))


def test_unknown_sweep_exits_with_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        sweep_main(["no_such_sweep"])
    assert e.value.code == 2 and "mixers" in capsys.readouterr().err


def test_report_without_jobs_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_report(tmp_path)


# ----------------------------------------------------------------------------- matched budgets


def tiny(ffn="swiglu", mixer="gqa"):
    return {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": mixer}, "ffn": {"name": ffn}}


@pytest.mark.parametrize("target", [60_000, 150_000], ids=["60k", "150k"])
def test_budget_matches_ffn_width(target):
    cfg, info = match_budget(tiny(), 256, target)
    got = count_params(cfg, 256)
    assert abs(got - target) <= 0.02 * target and info["budget/params"] == got
    assert cfg["ffn"]["d_ff"] == info["budget/value"] and info["budget/field"] == "model.ffn.d_ff"
    # the non-embedding count excludes the 256 x 64 token table
    assert count_params(cfg, 256, "total") == got + 256 * 64


def test_budget_without_ffn_sets_head_dim_and_rejects_unreachable():
    cfg, info = match_budget(tiny("none"), 256, 40_000)
    assert cfg["head_dim"] % 2 == 0 and abs(count_params(cfg, 256) - 40_000) <= 800
    with pytest.raises(ConfigError, match="model_budget.params"):
        match_budget(tiny(), 256, 10)  # below what the rest of the model already holds


def test_budget_floor_is_below_every_mixers_smallest_model():
    """norm_params_floor (the torch-free refusal of an unreachable target, config_checks) never exceeds the count
    at the smallest width the search can set, for every mixer, pre/post norm, rmsnorm/layernorm: it refuses
    only what match_budget would."""
    from attnzoo.config.registry import MIXERS
    from attnzoo.config.schema import resolve_model
    from attnzoo.training.budget import norm_params_floor

    for i, name in enumerate(sorted(MIXERS.names())):
        for ffn in ("none", "swiglu"):
            cfg = {**tiny(ffn, name), "norm_position": ("pre", "post")[i % 2],
                   "norm": {"name": ("rmsnorm", "layernorm")[(i // 2) % 2]}}
            smallest = {**cfg, "head_dim": 2} if ffn == "none" else {**cfg, "ffn": {"name": ffn, "d_ff": 1}}
            floor = norm_params_floor(resolve_model(copy.deepcopy(cfg)))
            assert 0 < floor <= count_params(smallest, 256), (name, ffn)


@pytest.mark.parametrize("ffn,frac", [("swiglu", 0.25), ("swiglu", 0.75), ("none", 0.25), ("none", 0.75)])
def test_budget_picks_the_closest_width_not_the_next_one_up(ffn, frac):
    """A target a quarter of one width step above width w: w is closest, rounding up would give w + 1 step;
    three quarters: w + 1 step is closest, rounding down would give w."""
    key = "d_ff" if ffn != "none" else "head_dim"
    step = 1 if ffn != "none" else 2

    def at(w):  # parameters at width w
        return count_params({**tiny(ffn), **({key: w} if key == "head_dim" else {"ffn": {"name": ffn, key: w}})}, 256)

    w = 40 * step
    target = round(at(w) + frac * (at(w + step) - at(w)))
    cfg, info = match_budget(tiny(ffn), 256, target)
    assert info["budget/value"] == (w if frac < 0.5 else w + step)
    assert abs(info["budget/params"] - target) < min(abs(at(v) - target) for v in (w - step, w + 2 * step))


def test_report_with_a_broken_summary_names_the_job_and_builds_the_rest(tmp_path, capsys):
    d = tmp_path / "sw"
    for j, text in (("0", json.dumps({"status": "ok", "metrics": {"val/loss": 1.5}})), ("1", '{"status": "ok", "metr')):
        (d / j / ".hydra").mkdir(parents=True)
        (d / j / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={j}e-3\n")
        (d / j / "summary.json").write_text(text)
    rep = build_report(d)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnzoo-report: 1: summary.json unreadable")
    assert [j["status"] for j in rep["jobs"]] == ["ok", "failed"] and (d / "report.html").is_file()


def test_wandb_with_a_key_but_no_server_falls_back_to_offline_quickly(tmp_path, monkeypatch, capfd):
    """A key but no reachable server (a closed local port): the run logs offline after at most
    logger.wandb.init_timeout seconds and says where, instead of wandb's minutes of retries."""
    import socket
    import time

    from attnzoo.training.wandb_logger import make_wandb_logger

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    t0 = time.time()
    lg = make_wandb_logger({"init_timeout": 2}, tmp_path, {"model": {"mixer": {"name": "gqa"}}})
    took = time.time() - t0
    out = capfd.readouterr().out
    assert lg is not None and "logging offline instead" in out and "wandb offline run in" in out, out
    assert took < 40, took
    lg.experiment.finish()


def test_optuna_hparams_search_smoke(tmp_path, monkeypatch, capsys):
    """`hparams_search=optuna` (lightning-hydra-template's convention): a study of 2 trials on MQAR, the
    best value read back from the jobs' returned val/acc. The command runs in this process (tests/conftest.py
    cli_train: the console script's own main; the trials run one after another in it, as in a process of its own)."""
    import yaml

    from tests.conftest import cli_train

    d = tmp_path / "optuna"
    code, out, err = cli_train(["hparams_search=optuna", "experiment=mqar", "debug=smoke", "hydra.sweeper.n_trials=2",
                                "hydra.sweeper.sampler.n_startup_trials=2", f"hydra.sweep.dir={d}",
                                f"paths.cache_dir={SESSION_CACHE}", "perf.measure_decode=false"], monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    res = yaml.safe_load((d / "optimization_results.yaml").read_text())
    accs = [json.loads((d / j / "summary.json").read_text())["metrics"]["val/acc"] for j in ("0", "1")]
    assert res["best_value"] == pytest.approx(max(accs)) and "optim.lr" in res["best_params"]


def test_long_context_smoke_sweep_evaluates_every_length(tmp_path):
    d = tmp_path / "long"
    # 4 sequences a batch (the sweep file's 32 stay under debug=smoke): what is checked is which lengths are evaluated
    # and the cache at each, not the losses
    rep = run_sweep("long_context_positions", d, "model/position=rope_yarn,alibi", "eval.context_lengths=[64,128]",
                    "eval.max_batches=2", "data.batch_size=4", "hydra/launcher=basic")
    assert [j["status"] for j in rep["jobs"]] == ["ok", "ok"]
    for j in rep["jobs"]:
        m = j["metrics"]
        assert {"val/loss@64", "val/loss@128", "cache/bytes_at_ctx@128"} <= set(m)
        assert m["cache/bytes_at_ctx@128"] == 2 * m["cache/bytes_at_ctx@64"]  # GQA: linear in the context
    assert (d / "plots" / "lengths.png").is_file()


def test_long_context_recall_smoke_sweep_reports_every_length(tmp_path):
    """The mixers at long context on MQAR: a sparse stack and the 3:1 hybrid, evaluated at 2x; the cache
    really held after the prefill at each length equals the analytic bytes, and the report's length table
    lists accuracy, cache bytes and decode rate per length."""
    d = tmp_path / "recall"
    rep = run_sweep("long_context_recall", d, 'model.pattern=nsa,"gdn;gdn;gdn;gqa"', "eval.context_lengths=[128]",
                    "eval.max_batches=1", "hydra/launcher=basic")
    assert [j["status"] for j in rep["jobs"]] == ["ok", "ok"]
    for j in rep["jobs"]:
        m = j["metrics"]
        assert {"val/acc@128", "perf/decode_tokens_per_sec@128"} <= set(m)
        summary = json.loads((d / j["job"] / "summary.json").read_text())
        model = attnzoo_model(summary)
        assert m["cache/bytes_at_ctx@128"] == model.cache_bytes(128)  # measured after a real 128-token prefill
    assert [j["mixer"] for j in rep["jobs"]][0] == "nsa"
    table = (d / "report.md").read_text().split("## Length extrapolation")[1].split("## All jobs")[0]
    assert "val/acc@128" in table and "cache bytes@128" in table and "decode tok/s@128" in table
    assert len([ln for ln in table.splitlines() if ln.startswith("| model.pattern=")]) == 2


def attnzoo_model(summary: dict):
    from attnzoo.config.schema import resolve_model
    from attnzoo.models.decoder import DecoderLM

    return DecoderLM(resolve_model(summary["config"]["model"]), vocab_size=summary["model"]["vocab_size"])


def test_tensorboard_hparams_list_the_sweeps_jobs(tmp_path):
    """logger=tensorboard: one event file per job, under tensorboard/<the job's overrides>, holding the
    HParams plugin's experiment (the job's overrides first, the swept key among them, then key fields; no
    constant callbacks.* columns), its session and the final metrics as hparams/<name>."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    d = tmp_path / "tb"
    run_sweep("window", d, "logger=tensorboard", "model.mixer.window=8,64", "optim.lr=3e-3", "data.train_size=128",
              "data.val_size=16", "hydra/launcher=basic")
    for job, window in (("0", 8), ("1", 64)):
        files = list((d / job / "tensorboard").rglob("events.out.tfevents.*"))
        assert len(files) == 1, files
        assert f"window={window}" in files[0].parent.name  # the run is named by its overrides
        hparams, scalars = {}, set()
        for event in EventFileLoader(str(files[0])).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        hparams = {k: val for k, val in data.session_start_info.hparams.items()}
                    if data.HasField("experiment"):
                        columns = [h.name for h in data.experiment.hparam_infos]
                else:
                    scalars.add(v.tag)
        assert hparams["model.mixer.window"].number_value == window and "optim.lr" in hparams
        assert "model.mixer.window" in columns[:8] and not any(c.startswith("callbacks.") for c in columns), columns
        assert {"hparams/val/acc", "hparams/cache/bytes_per_token", "hparams/params/total"} <= scalars
        assert "train/loss" in scalars and "val/acc" in scalars


def test_report_averages_seeds_for_the_best_lr(tmp_path):
    """Seeds swept: a variant's row is the mean over seeds of its best learning rate, with the spread."""
    import statistics

    d = tmp_path / "seeds"
    rep = run_sweep("window", d, "model.mixer.window=8", "optim.lr=3e-3,1e-2", "seed=1,2", "data.train_size=128",
                    "data.val_size=16", "hydra/launcher=basic")
    (row,) = rep["best"]
    assert row["n_seeds"] == 2 and row["n_lr"] == 2
    runs = [j for j in rep["jobs"] if j["lr"] == row["lr"]]
    accs = [j["metrics"]["val/acc"] for j in runs]
    assert row["metrics"]["val/acc"] == pytest.approx(statistics.mean(accs))
    assert row["spread"]["val/acc"] == pytest.approx(statistics.stdev(accs))
    other = [j for j in rep["jobs"] if j["lr"] != row["lr"]]
    assert statistics.mean(j["metrics"]["val/acc"] for j in other) <= row["metrics"]["val/acc"]
    header = next(line for line in (d / "report.md").read_text().splitlines() if line.startswith("| job | variant"))
    assert "| seeds | val/acc std |" in header


@pytest.mark.parametrize("mixer", ["mla", "gated_deltanet"])
def test_budget_match_holds_a_variant_at_the_reference_count(mixer):
    """model_budget.match: {pattern: [gqa]} -> the gqa model's own count at the same sizes, so a sweep's variants
    carry equal parameters at any size (its full form and its debug=smoke form alike)."""
    container = {"model": {**tiny(mixer=mixer), "pattern": [mixer]}, "model_budget": {"match": {"pattern": ["gqa"]}}}
    reference = count_params({**tiny(), "pattern": ["gqa"]}, 256)
    info = apply_budget(container, 256)
    assert info["budget/target"] == reference
    assert abs(count_params(container["model"], 256) - reference) <= 0.02 * reference
    assert container["model"]["pattern"] == [mixer]  # the variant keeps its own mixer


@pytest.mark.parametrize("budget,field", [({"params": 1000, "match": {"pattern": ["gqa"]}}, "model_budget"),
                                          ({"count": "total"}, "model_budget"),
                                          ({"match": []}, "model_budget.match")], ids=["both", "neither", "not-a-map"])
def test_budget_match_or_params_refused_in_one_line(budget, field):
    with pytest.raises(ConfigError) as e:
        apply_budget({"model": tiny(), "model_budget": budget}, 256)
    assert e.value.field == field and "\n" not in str(e.value)


def test_lm_125m_sweep_holds_every_variant_at_the_gqa_count():
    """sweeps/lm_125m: model_budget.match gives every mixer the gqa model's non-embedding parameters, at the
    recipe's full size and in its debug=smoke form (counted on the meta device: nothing is allocated)."""
    for extra in ([], ["debug=smoke"]):
        base = compose_sweep("lm_125m", extra)  # one compose per form: a grid value here is a plain value
        g = grid(base)
        counts = {}
        for pattern in g["model.pattern"]:
            cfg = with_overrides(base, f"model.pattern={pattern}")
            container = {"model": OmegaConf.to_container(cfg.model, resolve=True),
                         "model_budget": OmegaConf.to_container(cfg.model_budget, resolve=True)}
            info = apply_budget(container, 50304)
            counts[pattern] = count_params(container["model"], 50304)
            assert info["budget/rel_error"] <= 0.02, (extra, pattern, info)
        reference = counts["[gqa]"]
        assert all(abs(c - reference) <= 0.02 * reference for c in counts.values()), counts
        if not extra:
            assert 80e6 < reference < 90e6  # 124M with GPT-2's 50k-token embedding tied


def test_scaling_smoke_sweep_stops_every_job_by_its_budget_and_reports_the_fits(tmp_path):
    """`attnzoo-sweep scaling debug=smoke` (sweeps/smoke/scaling.yaml after the sweep file): every job is sized by
    the ladder's rule and stopped by its FLOP budget (at least the budget, less than one step over), and the
    report's iso-FLOP profiles are the jobs' own (N, val/loss) points, fitted by attnzoo.analysis.scaling."""
    from attnzoo.analysis.scaling import fit_profile

    d = tmp_path / "scaling"
    rep = run_sweep("scaling", d, "hydra/launcher=basic")
    assert len(rep["jobs"]) == 12 and all(j["status"] == "ok" for j in rep["jobs"])
    points: dict[tuple, list] = {}
    for j in rep["jobs"]:
        s = json.loads((d / j["job"] / "summary.json").read_text())
        length, model, m = s["length"], s["model"], s["metrics"]
        assert length["limit"] == "trainer.max_flops" and s["global_step"] <= 10
        assert length["max_flops"] <= length["flops"] < length["max_flops"] + length["tokens_per_step"] * length["flops_per_token"]
        logged = [float(r["train/flops"]) for r in read_csv(d / j["job"] / "csv" / "metrics.csv") if r.get("train/flops")]
        assert logged[-1] == pytest.approx(length["flops"], rel=1e-12)  # the count logged as the run went
        assert model["d_model"] == 4 * model["n_layers"] and model["n_heads"] == model["n_layers"]  # d = 4L, heads of 4
        mixer = "gqa" if "model.pattern=[gqa]" in j["overrides"] else "gdn,attn"
        points.setdefault((mixer, length["max_flops"]), []).append((m["params/non_embedding"], m["val/loss"]))
    study = rep["scaling"]
    assert list(study.fits) == ["gdn,attn", "gqa"] and not study.left_out
    for mixer, fit in study.fits.items():
        assert [p.budget for p in fit.profiles] == [1.3e8, 1.75e8]
        for p in fit.profiles:
            n, loss = zip(*sorted(points[(mixer, p.budget)]))
            assert (p.n, p.loss) == (n, loss)
            assert p.coef == pytest.approx(fit_profile(p.budget, n, loss).coef, rel=1e-9)  # the points' order aside
    assert (d / "plots" / "isoflop.png").is_file()
    md = (d / "report.md").read_text()
    assert "## Scaling (iso-FLOP sweep)" in md and "+sweeps/smoke" not in md  # the rerun command: attnzoo-sweep adds it
    assert md.index("## Scaling") < md.index("## All jobs") and "## Best learning rate" not in md  # one lr: no such table
