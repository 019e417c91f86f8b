"""The lm-evaluation-harness adapter (attnzoo.inference.lm_eval) on a char-level run trained here: each request
type against a direct computation from the model's logits, then lm_eval end to end on tiny local tasks
(multiple choice, generate_until, loglikelihood_rolling), offline, in process and through the command line."""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")  # the dev extra

from lm_eval.api.instance import Instance  # noqa: E402

from attnzoo.config.errors import ConfigError  # noqa: E402
from attnzoo.inference.lm_eval import AttnzooLM  # noqa: E402
from attnzoo.training.run import train  # noqa: E402
from tests.conftest import SESSION_CACHE, SMALL_TEXT, compose_cfg  # noqa: E402
from scripts.warm_run import run_python

ROOT = Path(__file__).resolve().parents[1]
TEXT = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "optim.lr=3e-3", "trainer.max_steps=12"]
EOT = 0  # <|endoftext|>: id 0 of the char tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval") / "run"
    train(compose_cfg(TEXT, out))
    return out


@pytest.fixture(scope="module")
def lm(run_dir):
    return AttnzooLM(path=str(run_dir), device="cpu", batch_size=3)


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) log-probabilities of the next token after each prefix, one unpadded sequence."""
    with torch.no_grad():
        return F.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def direct_loglikelihood(lm, context: str, continuation: str, max_length: int):
    """lm_eval's convention (TemplateLM._encode_pair, as HFLM): the context's trailing whitespace is scored
    as the start of the continuation; an empty context is <|endoftext|>."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = lm.run.encode(context) or [EOT]
    cont = lm.run.encode(continuation)
    seq = (ctx + cont)[-(max_length + 1):]
    lp = logprobs(lm.model, seq[:-1])[-len(cont):]
    target = torch.tensor(cont)
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def greedy(lm, prompt: str, n: int) -> str:
    ids = lm.run.encode(prompt)
    out = lm.model.generate(torch.tensor([ids]), n, temperature=0, eos_id=EOT)[0, len(ids):].tolist()
    return lm.run.decode(out)


def test_loglikelihood_is_the_continuations_logprob_and_greedy_flag(lm, run_dir):
    pairs = [("def f(x):\n    return", " x + 1"), ("class ", "Foo(object):"), ("", "import os"),
             ("for i in range(", "10):"), ("x = ", "qz#")]
    pairs.append(("def add(a, b):", greedy(lm, "def add(a, b):", 4)))  # greedy by construction
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    want = [direct_loglikelihood(lm, c, x, lm.max_length) for c, x in pairs]
    for (ll, g), (wll, wg) in zip(got, want):
        assert ll == pytest.approx(wll, abs=1e-5) and g == wg
    assert want[-1][1] and not all(g for _, g in want)  # both flags occur
    # contexts longer than max_length are left-truncated (batched, padded rows included)
    short = AttnzooLM(path=str(run_dir), device="cpu", batch_size=4, max_length=14)
    got = short.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    for (ll, g), (c, x) in zip(got, pairs):
        wll, wg = direct_loglikelihood(short, c, x, 14)
        assert ll == pytest.approx(wll, abs=1e-5) and g == wg
    with pytest.raises(ConfigError, match="a continuation of 13 tokens does not fit max_length=12"):
        AttnzooLM(path=str(run_dir), max_length=12).loglikelihood([request("loglikelihood", "class ", "Foo(object):")])


def test_loglikelihood_rolling_is_the_documents_loglikelihood_in_windows(lm, run_dir):
    doc = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    t = lm.run.encode(doc)
    for L, model in ((16, AttnzooLM(path=str(run_dir), device="cpu", batch_size=2, max_length=16)), (lm.max_length, lm)):
        # token t[i] is predicted from ([eot] + t)[max(0, b - L) : b] for the L-token chunk [a, b) holding it
        padded, want = [EOT] + t, 0.0
        for a in range(0, len(t), L):
            b = min(a + L, len(t))
            lp = logprobs(lm.model, padded[max(0, b - L):b])[-(b - a):]
            want += float(lp.gather(-1, torch.tensor(t[a:b])[:, None]).sum())
        (got,) = model.loglikelihood_rolling([request("loglikelihood_rolling", doc)])
        assert got == pytest.approx(want, abs=1e-5), L
    assert len(t) > 4 * 16  # several windows at L = 16


def test_generate_until_stops_at_the_stop_string_and_is_greedy(lm):
    full = greedy(lm, "def ", 24)
    stop = full[6:8]
    assert stop and stop in full
    got = lm.generate_until([
        request("generate_until", "def ", {"until": [stop], "max_gen_toks": 24, "do_sample": False}),
        request("generate_until", "def ", {"until": [], "max_gen_toks": 24}),
        request("generate_until", "def ", {"until": ["\x00never"], "max_gen_toks": 5, "do_sample": True,
                                          "temperature": 1.0}),
    ])
    assert got[0] == full[:full.index(stop)] and len(got[0]) < len(full)
    assert got[1] == full
    assert isinstance(got[2], str) and len(got[2]) <= 5


def test_generate_until_batches_prompts_of_other_lengths(lm):
    """Five requests with the same settings go as two batches (batch_size 3) of rows at their own positions: each
    text is the greedy completion of its prompt alone (eos included: a row that ends early does not stop the
    others)."""
    prompts = ["def ", "import os\nfor i in range(", "x", "class Foo(object):\n    ", "return "]
    got = lm.generate_until([request("generate_until", p, {"until": [], "max_gen_toks": 12}) for p in prompts])
    assert got == [greedy(lm, p, 12).split("<|endoftext|>")[0] for p in prompts]
    assert lm.decoder().path == "eager static cache" and lm.decoder().batch == 3


def test_refusals_are_one_line(run_dir, tmp_path):
    with pytest.raises(ConfigError, match="model_args: unknown nosuch"):
        AttnzooLM(path=str(run_dir), nosuch=1)
    with pytest.raises(ConfigError, match="does not exist"):
        AttnzooLM(path=str(tmp_path / "missing"))
    out = tmp_path / "enc"
    train(compose_cfg(["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "model=encoder", "trainer.max_steps=1",
                       "trainer.val_check_interval=1"], out))
    with pytest.raises(ConfigError, match="is a encoder model; allowed with lm_eval: a decoder LM") as e:
        AttnzooLM(path=str(out))
    assert "\n" not in str(e.value)
    train(compose_cfg(["debug=smoke", "data=mqar", "trainer.max_steps=1", "trainer.val_check_interval=1"],
                      tmp_path / "mqar"))
    with pytest.raises(ConfigError, match="trained on data=mqar; allowed with lm_eval: a text run"):
        AttnzooLM(path=str(tmp_path / "mqar"))


# ----------------------------------------------------------------------------- lm_eval end to end

MC = [{"question": "def f(x):\n    return", "choices": ["x + 1", "#qz!"], "label": 0},
      {"question": "import", "choices": ["@@@", " os"], "label": 1},
      {"question": "class A", "choices": ["(object):", "))(("], "label": 0}]
ROLL = [{"text": "def add(a, b):\n    return a + b\n"}, {"text": "for i in range(10):\n    print(i)\n" * 3}]
GEN_PROMPTS = ["def ", "class "]


def write_tasks(root: Path, gen_targets: list[str]) -> Path:
    """Three YAML tasks over local jsonl files (lm_eval's `json` dataset builder, no hub)."""
    d = root / "tasks"
    d.mkdir()
    data = {"mc": MC, "gen": [{"prompt": p, "target": t} for p, t in zip(GEN_PROMPTS, gen_targets)], "roll": ROLL}
    for name, rows in data.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = lambda name: (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / (name + '.jsonl')}\n"
                           f"  cache_dir: {root / 'hf_cache'}\ntest_split: test\n")
    (d / "mc.yaml").write_text(
        "task: attnzoo_tiny_mc\n" + common("mc") + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "gen.yaml").write_text(
        "task: attnzoo_tiny_gen\n" + common("gen") + "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\n"
        "doc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "roll.yaml").write_text(
        "task: attnzoo_tiny_roll\n" + common("roll") + "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: bits_per_byte\n")
    return d


@pytest.fixture
def offline(monkeypatch, tmp_path):
    import datasets
    import huggingface_hub

    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def expected_metrics(lm) -> tuple[dict, list[str]]:
    """acc, exact_match and bits_per_byte of the three tasks, from the adapter's own answers."""
    lls = lm.loglikelihood([request("loglikelihood", d["question"], " " + c) for d in MC for c in d["choices"]])
    acc = sum(max(range(2), key=lambda j: lls[2 * i + j][0]) == d["label"] for i, d in enumerate(MC)) / len(MC)
    outs = lm.generate_until([request("generate_until", p, {"until": ["\n"], "max_gen_toks": 12, "do_sample": False})
                              for p in GEN_PROMPTS])
    rolls = lm.loglikelihood_rolling([request("loglikelihood_rolling", d["text"]) for d in ROLL])
    bpb = -sum(rolls) / sum(len(d["text"].encode()) for d in ROLL) / math.log(2)
    return {"acc": acc, "exact_match": 0.5, "bits_per_byte": bpb}, [outs[0], outs[1] + "no"]


def test_simple_evaluate_on_local_tasks(lm, run_dir, tmp_path, offline):
    import lm_eval
    from lm_eval.tasks import TaskManager

    want, gen_targets = expected_metrics(lm)  # the first prompt's target is its greedy answer, the second's not
    tasks = write_tasks(tmp_path, gen_targets)
    res = lm_eval.simple_evaluate(model="attnzoo", model_args=f"path={run_dir},batch_size=4,device=cpu",
                                  tasks=["attnzoo_tiny_mc", "attnzoo_tiny_gen", "attnzoo_tiny_roll"],
                                  task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                  bootstrap_iters=0,
                                  log_samples=False)["results"]
    assert res["attnzoo_tiny_mc"]["acc,none"] == pytest.approx(want["acc"])
    assert res["attnzoo_tiny_gen"]["exact_match,none"] == pytest.approx(want["exact_match"])
    assert res["attnzoo_tiny_roll"]["bits_per_byte,none"] == pytest.approx(want["bits_per_byte"], rel=1e-6)


def test_command_line_is_lm_evals_own_with_the_model_registered(run_dir, tmp_path, monkeypatch, capsys):
    """`attnzoo-lm-eval` (pyproject's console script) = `python -m attnzoo.inference.lm_eval`: lm_eval's CLI
    with the same argv; a refused model is one line, exit 2."""
    import tomllib

    import lm_eval.__main__
    from attnzoo.inference.lm_eval import main

    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["attnzoo-lm-eval"]
    assert script == "attnzoo.cli.scripts:lm_eval"  # -> attnzoo.inference.lm_eval:main, behind the lean import
    seen = []

    def fake_cli():  # what lm_eval's CLI does with --model attnzoo --model_args ...: build the model from the registry
        from lm_eval.api.registry import get_model

        seen.append(list(sys.argv[1:]))
        get_model("attnzoo").create_from_arg_string(sys.argv[-1], {"device": "cuda:0", "batch_size": 1})

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets sys.argv, as a console script would
    argv = ["--model", "attnzoo", "--tasks", "x", "--model_args", f"path={tmp_path / 'nope'}"]
    with pytest.raises(SystemExit) as e:  # a missing run: refused before lm_eval's CLI (lm_eval_cli.precheck)
        main(argv)
    assert e.value.code == 2 and seen == []
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnzoo-lm-eval: error: checkpoint: ") and "\n" not in err
    argv = ["--model", "attnzoo", "--tasks", "x", "--model_args", f"path={run_dir},nosuch=1"]
    with pytest.raises(SystemExit) as e:  # refused by the model lm_eval's registry builds
        main(argv)
    assert e.value.code == 2 and seen == [argv]
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnzoo-lm-eval: error: model_args: unknown nosuch") and "\n" not in err, err
    main(["--model_args", f"path={run_dir},batch_size=4"])  # model_args win over the CLI's defaults; cpu fallback
    from lm_eval.api.registry import model_registry

    assert {"attnzoo", "hf", "vllm"} <= set(model_registry)  # lm_eval's own models still registered beside ours


@pytest.mark.slow  # lm_eval's CLI indexes its ~14k built-in task files first: ~30 s on a loaded CPU
def test_command_line_end_to_end(run_dir, tmp_path):
    tasks = write_tasks(tmp_path, ["x", "y"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "ATTNZOO_TEST_CACHE": str(SESSION_CACHE)}
    # the console script's own path: "attnzoo" registered lazily (lm_eval_cli), the class imported by lm_eval
    r = run_python(["-c", "from attnzoo.cli.scripts import lm_eval; lm_eval()", "--model", "attnzoo", "--model_args",
                    f"path={run_dir}", "--tasks", "attnzoo_tiny_mc,attnzoo_tiny_gen,attnzoo_passkey", "--include_path",
                    str(tasks), "--metadata", '{"max_seq_lengths": [256], "depths": [0.5], "num_samples": 1}',
                    "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "out")],
                   cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(result.read_text())["results"]
    assert "acc,none" in res["attnzoo_tiny_mc"] and "exact_match,none" in res["attnzoo_tiny_gen"]
    # the shipped attnzoo_niah tasks found beside the caller's --include_path, one prompt at the length asked for
    assert res["attnzoo_passkey"]["256,none"] in (0.0, 1.0) and res["attnzoo_passkey"]["512,none"] == -1


def test_lm_evals_own_tasks_are_indexed_only_when_a_name_may_need_them(tmp_path, monkeypatch):
    """attnzoo-lm-eval indexes lm_eval's ~15,000 task files (~10 s) only when a requested name is not a task of the
    caller's --include_path or of ours (or is a group, a foreign tag, a path): the light index gives the same tasks."""
    import lm_eval.tasks

    from attnzoo.inference import lm_eval_cli

    tasks = write_tasks(tmp_path, ["x"])
    (tasks / "group.yaml").write_text("group: my_group\ntask:\n  - attnzoo_tiny_mc\n")  # may name lm_eval's tasks
    built = []
    real = getattr(lm_eval.tasks.TaskManager, "attnzoo_base", lm_eval.tasks.TaskManager)

    class Recorder(real):  # lm_eval's own index left out here whatever is asked: the decision is what is checked
        def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
            built.append(include_defaults)
            super().__init__(verbosity, include_path, False, metadata)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recorder)
    for wanted, defaults in ((["attnzoo_tiny_mc", "attnzoo_passkey"], [False]), (["attnzoo_niah"], [False]),
                             (["hellaswag"], [False, True]), (["attnzoo_tiny_mc", "wikitext"], [False, True]),
                             (["my_group"], [False, True]), ([str(tasks / "mc.yaml")], [False, True]),
                             (None, [True])):
        built.clear()
        lm_eval_cli.add_our_tasks(wanted)
        manager = lm_eval.tasks.TaskManager(include_path=str(tasks))
        assert built == defaults, (wanted, built)
        assert "attnzoo_tiny_mc" in manager.all_tasks and "attnzoo_passkey" in manager.all_tasks
    assert lm_eval_cli.requested_tasks(["--model", "attnzoo", "--tasks", "a, b,"]) == ["a", "b"]
    assert lm_eval_cli.requested_tasks(["--tasks=a"]) == ["a"] and lm_eval_cli.requested_tasks([]) is None


def test_a_hybrid_with_recurrent_layers(tmp_path):
    """Gated DeltaNet + GQA: padded batches through the chunked recurrence score as single sequences, and
    generation from the recurrent state is model.generate's."""
    out = tmp_path / "hybrid"
    train(compose_cfg(["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "model=hybrid_gdn", "trainer.max_steps=4",
                       "trainer.val_check_interval=4"], out))
    lm = AttnzooLM(path=str(out), device="cpu", batch_size=4, max_length=24)
    pairs = [("def f(x):\n    return", " x + 1"), ("import", " os"), ("for i in range(10):\n    print", "(i)")]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    for (ll, g), (c, x) in zip(got, pairs):
        wll, wg = direct_loglikelihood(lm, c, x, 24)
        assert ll == pytest.approx(wll, abs=1e-5) and g == wg
    full = greedy(lm, "class ", 10)
    assert lm.generate_until([request("generate_until", "class ", {"until": [], "max_gen_toks": 10})]) == [full]


def test_offline_niah_tasks_are_attnzoo_evals_prompts_scored_as_ruler(lm, run_dir, offline):
    """The shipped tasks `attnzoo_<name>` (inference/lm_eval_tasks): each doc is attnzoo-eval --task niah's prompt
    for the same settings and seed (data/needles.make_samples on the run's tokenizer and corpus), and each length's
    column and `acc` are the string_match_all of the adapter's own greedy completions; a length outside the metric
    columns is refused in one line."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from attnzoo.data.needles import make_samples, score
    from attnzoo.inference.lm_eval_cli import TASKS_DIR
    from attnzoo.inference.lm_eval_tasks import niah_utils
    from attnzoo.inference.niah import haystack_text

    meta = {"path": str(run_dir), "max_seq_lengths": [512, 1024], "depths": [0.0, 1.0], "num_samples": 1}
    out = lm_eval.simple_evaluate(model=lm, tasks=["attnzoo_passkey", "attnzoo_niah_single_2"], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                                                           metadata=meta),
                                  gen_kwargs="max_gen_toks=8", log_samples=True)
    run = niah_utils._run(str(run_dir))
    for task in ("passkey", "niah_single_2"):
        want = make_samples([task], [512, 1024], [0.0, 1.0], 1, run.encode, haystack_text(run, None)[0], 0)
        docs = out["samples"][f"attnzoo_{task}"]
        assert [d["doc"]["input"] for d in sorted(docs, key=lambda d: d["doc_id"])] == [s.prompt for s in want]
        gens = lm.generate_until([request("generate_until", s.prompt, {"until": [], "max_gen_toks": 8})
                                  for s in want])
        scores = [score(g.strip(), s.answers) for g, s in zip(gens, want)]
        res = out["results"][f"attnzoo_{task}"]
        assert res["acc,none"] == pytest.approx(sum(scores) / 4)
        assert res["512,none"] == pytest.approx(sum(scores[:2]) / 2) and res["1024,none"] == pytest.approx(sum(scores[2:]) / 2)
        assert res["256,none"] == -1  # not asked for: RULER's convention
    doc = {"outputs": ["1234567", "7654321"], "max_length": 128}
    assert niah_utils.process_results(doc, [" 1234567 and 42"])["128"] == 0.5 == niah_utils.aggregate([0.5, -1])
    with pytest.raises(ConfigError, match=r"metadata.max_seq_lengths: got 300; allowed: powers of two 64 \.\. 131072"):
        niah_utils.passkey(path=str(run_dir), max_seq_lengths=[300])
    with pytest.raises(ConfigError, match="metadata.tokenizer: no tokenizer"):
        niah_utils.passkey(max_seq_lengths=[256])
