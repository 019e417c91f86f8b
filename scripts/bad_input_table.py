"""Regenerate the bad-input table of docs/reliability.md from the cases tests/test_bad_input.py checks:
each case is run through `train()` as the test runs it, and its real one-line message is written down.

    .venv/bin/python scripts/bad_input_table.py          # rewrites the table between the markers
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- bad-input table: begin (scripts/bad_input_table.py) -->", "<!-- bad-input table: end -->"
# checked by other tests (the CLI before Hydra, a live lock, a disk filling up, a refused resume)
EXTRA = [
    ("`model/mixer=softmaxx` (any unknown option of a config group)", "model/mixer: unknown option 'softmaxx'; allowed: deltanet, gated_deltanet, gqa, linear_attention, mha, mla, moba, mqa, nsa, sliding_window"),
    ("`model.n_head=4` (a misspelt key, no `+`)", "model.n_head: unknown key; did you mean model.n_heads? allowed keys: ... (add a new key with +model.n_head=4)"),
    ("`attnzoo-sweep mixers model.n_head=4` (a misspelt key in a sweep, also as a grid `model.n_head=4,8`)", "model.n_head: unknown key; did you mean model.n_heads? allowed keys: ... (add a new key with +model.n_head=4)"),
    ("`hparams_search=optuna` with `optim.lr: tag(log, interval(0, 3e-2))` in `hydra.sweeper.params`", "hydra.sweeper.params.optim.lr: tag(log, interval(0, 3e-2)) is a log range with low <= 0; allowed: 0 < low <= high"),
    ("`hparams_search=optuna` with `interval(0.1, 0.01)` (low > high)", "hydra.sweeper.params.optim.lr: interval(0.1, 0.01) has low > high; allowed: low <= high"),
    ("`hparams_search=optuna hydra.sweeper.n_trials=0`", "hydra.sweeper.n_trials: 0; allowed: an integer >= 1 (trials in the study)"),
    ("`attnzoo-sweep scaling trainer.max_flops=1e9,-5` (a grid value a job would refuse; tests/test_bad_input.py)", "trainer.max_flops: must be positive or null, got -5.0 (the grid's trainer.max_flops=-5: no job has run)"),
    ("`paths.output_dir=` on a disk with < 64 MiB free", "paths.output_dir: <dir>: only 5.0 MiB free on its filesystem; allowed: >= 64 MiB free (checkpoints, logs)"),
    ("the disk fills up during the run (one process or FSDP's sharded save)", "paths.output_dir: no space left writing <ckpt> (No space left on device); the last complete checkpoint is kept; allowed: free space, then resume with --resume <run dir>"),
    ("`attnzoo-data prepare` onto a disk that fills up", "OUT: no space left writing <out> (No space left on device); K of N parts are finished and kept in <out>/.work; allowed: free space, then the same command again to complete it"),
    ("a second `attnzoo-data prepare` into an OUT being prepared", "OUT: <out> is being prepared by another process (its lock <out>/.work/.lock is held); allowed: wait for it to finish (a rerun then finds it prepared), or another OUT"),
    ("a second run into a live run's dir", "hydra.run.dir: <dir> is in use by a live run (pid N on host); allowed: another hydra.run.dir, ..."),
    ("`ckpt_path=last` with another model config", "ckpt_path: <ckpt> was trained with another model/data config: model.mixer.name ('gqa' -> 'mla'); allowed: the run's own values (attnzoo-train --resume RUN_DIR reuses them)"),
    ("`ckpt_path=last optim=adamw` resuming an `optim=muon` run (tests/test_muon.py)", "optim.name: <ckpt> holds the optimizer state of optim=muon, which optim=adamw cannot continue; allowed: optim=muon, or a new run"),
    ("`ckpt_path=last trainer.max_steps=8` extending a 4-step run on the cosine schedule (tests/test_resume.py)", "trainer.max_steps: <ckpt> took its 4 steps on the cosine schedule of a 4-step run; this run's schedule (cosine, 8 steps) gives those steps other learning rates, so it would not equal a 8-step run; allowed: the checkpoint's trainer.max_steps=4 and scheduler (or a new run of the longer length; a schedule that does not depend on the length, scheduler=constant or noam, extends exactly)"),
    ("`--resume DIR` on a dir that is not a run", "--resume: <dir> is not a run directory (no .hydra/overrides.yaml)"),
    ("`attnzoo-report` on a job with a broken summary.json", "one stderr line per bad job; the report is still built"),
    ("`model/mixer=retnet model.mixer.n_heads=0` (a mixer's own n_heads / head_dim / v_head_dim below 1, every mixer; tests/test_bad_input.py)", "model.layers[0].mixer.n_heads: got 0; allowed: an integer >= 1, or null (the model's)"),
    ("`attnzoo-ckpt consolidate SRC FILE/x.ckpt` (under a file; tests/test_checkpoint_safety.py)", "DST: <file>/x.ckpt cannot be written (<file> is a file, not a directory); allowed: a path under a writable directory"),
    # command-line tools (tests/test_bad_input_cli.py, tests/test_kept_files.py): refused before the run is read
    ("`attnzoo-data prepare SRC FILE/out` (under a file; tests/test_data_prepare.py)", "OUT: <file>/out cannot be created: <file> is a file; allowed: a new or empty directory under a writable folder, or a folder attnzoo-data prepared"),
    ("`attnzoo-data prepare SRC OUT --tokenizer-file F --tokenizer-model DIR` (two tokenizer sources; tests/test_data_prepare.py)", "--tokenizer-model: given with --tokenizer file, which does not read it; allowed: one tokenizer source (--tokenizer-file or --tokenizer-model, or neither for bpe)"),
    ("`attnzoo-data prepare hf:NAME OUT` with the hub out of reach (offline; tests/test_data_prepare.py)", "SRC: hf:NAME cannot be opened from the Hugging Face hub (Couldn't reach 'NAME' on the Hub (OfflineModeIsEnabled)); allowed: a hub dataset this machine reaches (or has in its datasets cache, with HF_HUB_OFFLINE=1), or a local copy: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, a datasets save_to_disk folder"),
    ("`data=shards data.path=OUT`, a chunk holding token ids outside the vocabulary (tests/test_shards.py; checked per batch in the training process)", "data.path: <out> holds token id 999, outside the model's vocabulary of 300 ids (a corrupt chunk, or one another tokenizer wrote); allowed: a folder attnzoo-data prepare wrote (prepare it again)"),
    ("`attnzoo-data info OUT` without OUT/tokenizer.json (or a split's index.json; as data=shards; tests/test_data_prepare.py)", "OUT: <out> has no tokenizer.json; allowed: a folder written by `attnzoo-data prepare SRC OUT`"),
    ("`attnzoo-generate RUN x --max-new-tokens N` past `model.max_seq_len` with rope / alibi / sinusoidal / no positions (tests/test_bad_input_cli.py)", "--max-new-tokens: the prompt (4 tokens) + 37 new tokens exceed model.max_seq_len=40 (rope positions: lengths the model is not sized for); allowed: <= 36, or --extrapolate to generate past it"),
    ("`attnzoo-export RUN OUT` onto a full disk", "OUT_DIR: cannot write <out> (No space left on device); nothing was written"),
    ("`attnzoo-export RUN FILE` (the output path is a file)", "OUT_DIR: <file> is a file; allowed: a new or empty directory"),
    ("`attnzoo-export RUN FILE/export` (under a file)", "OUT_DIR: <file>/export cannot be created (<file> is a file, not a directory); allowed: a path under a writable directory"),
    ("`attnzoo-bench train --mixer nope` (any `attnzoo.load_config` caller; tests/test_bad_input_cli.py)", "model/mixer: unknown option 'nope'; allowed: deltanet, gated_deltanet, gla, gqa, ..."),
    ("`attnzoo-generate RUN x --temperature -0.5`", "--temperature: must be >= 0 (0: greedy), got -0.5"),
    ("`attnzoo-generate RUN x --top-p 1.5` (or 0)", "--top-p: must be in (0, 1] (1: no nucleus cut), got 1.5"),
    ("`attnzoo-generate RUN x --top-k -1`", "--top-k: must be >= 0 (0: no top-k cut), got -1"),
    ("`attnzoo-generate RUN x --device tpu`", "--device: unknown device 'tpu'; allowed: cpu"),
    ("`attnzoo-generate RUN --prompts FILE` with no non-blank line", "--prompts: <file> holds no prompt (no non-blank line); allowed: one prompt per line"),
    ("`attnzoo-generate RUN \"def \" --max-new-tokens 37` with learned positions, max_seq_len 40", "--max-new-tokens: the prompt (4 tokens) + 37 new tokens exceed the learned position table (model.max_seq_len=40); allowed: <= 36"),
    ("`attnzoo-eval RUN --context-lengths 64 0 -5`", "--context-lengths: got 0 -5; allowed: lengths >= 2 (a prediction needs a token before it)"),
    ("`attnzoo-eval RUN --max-batches 0`", "--max-batches: must be >= 1, got 0; allowed: omit it for every batch"),
    ("`attnzoo-eval RUN --out FILE/eval.json` (under a file)", "--out: <file>/eval.json cannot be written (<file> is a file, not a directory); allowed: a path under a writable directory"),
    ("`attnzoo-bench --threads 0 SUBCOMMAND`", "--threads: must be >= 1, got 0; allowed: omit it for torch's default"),
    ("`attnzoo-bench --out FILE/bench SUBCOMMAND` (under a file)", "--out: <file>/bench cannot be created (<file> is a file, not a directory); allowed: a folder under a writable directory"),
    # attnzoo-data (tests/test_data_prepare.py): refused before any file is tokenized or written
    ("`attnzoo-data prepare SRC OUT` with SRC missing", "SRC: <src> does not exist; allowed: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, a datasets save_to_disk folder, or hf:NAME"),
    ("`attnzoo-data prepare SRC OUT` with no input file in SRC", "SRC: <src> holds no input file (only: notes.md); allowed: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, ..."),
    ("`attnzoo-data prepare SRC OUT` with only empty files", "SRC: <src>: every input file is empty; allowed: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, ..."),
    ("`attnzoo-data prepare SRC OUT`, a .jsonl without the text field", "--text-field: <src>/a.jsonl line 1 has no string field 'text' (its fields: body); allowed: --text-field NAME"),
    ("`attnzoo-data prepare SRC OUT`, a binary file among the inputs", "SRC: <src>/c.txt is binary (a NUL byte at offset 8), not UTF-8 text; allowed: UTF-8 text files, or move it out of SRC"),
    ("`attnzoo-data prepare SRC OUT`, a tokenizer over uint32", "--tokenizer: the tokenizer has 4,294,967,297 ids, over uint32 (4,294,967,296); allowed: a vocabulary of at most 2**32 ids"),
    ("`attnzoo-data prepare SRC2 OUT` into an OUT prepared from SRC", "SRC: <out> was prepared from another source (<src>, fingerprint 1a2b3c4d5e6f; this SRC: <src2>, 6f5e4d3c2b1a); allowed: the same SRC, or another OUT"),
    ("`attnzoo-data prepare SRC OUT` with another tokenizer (or `--val-fraction`, `--seed`, `--text-field`) than OUT's", "--tokenizer: <out> was prepared with another tokenizer (kind=file, sha256=..., ...; asked: kind=bpe, vocab_size=300, ...); allowed: the same tokenizer options, or another OUT"),
    ("`attnzoo-data prepare SRC DIR` (DIR holds other files)", "OUT: <dir> is not empty and not a folder attnzoo-data prepared; allowed: a new or empty directory, or a folder attnzoo-data prepared"),
    ("`attnzoo-data info DIR` (not a prepared folder)", "OUT: <dir> has no manifest.json: not a prepared folder; allowed: a folder written by attnzoo-data prepare"),
    ("`attnzoo-data info OUT` (or prepare) on a manifest from a newer attnzoo", "OUT: <out>/manifest.json is version 99 (attnzoo 9.0); this attnzoo reads version <= 1; allowed: a newer attnzoo, or prepare it again"),
    # data=shards (tests/test_shards.py): refused before any work
    ("`data=shards` without `data.path`", "data.path: is required with data=shards; allowed: a folder written by `attnzoo-data prepare SRC OUT` (or data.source=SRC, prepared on first use)"),
    ("`data=shards data.source=SRC data.path=OUT` (both)", "data.source: 'SRC' given with data.path='OUT'; allowed: one of them (a prepared folder, or a source prepared on first use)"),
    ("`data=shards data.source=SRC +data.prepare.vocab_sise=300`", "data.prepare: unknown option 'vocab_sise'; allowed: chunk_bytes, eos_token, num_workers, sample_bytes, sample_docs, seed, split, text_field, tokenizer, tokenizer_file, tokenizer_model, txt_docs, unit_bytes, val_fraction, vocab_size"),
    ("`data=shards data.source=SRC +data.prepare.vocab_size=100`", "data.prepare.vocab_size: got 100; allowed: >= 260 (256 bytes + specials)"),
    ("`model.init_from=DIR data=shards data.path=OUT`, OUT prepared with another tokenizer", "data.path: <out> was prepared with another tokenizer than <dir>/tokenizer.json, so its ids are not the model's; allowed: a corpus prepared with `attnzoo-data prepare SRC OUT --tokenizer-model <dir>`"),
    ("`data=shards data.source=DIR` (missing)", "data.source: <dir> does not exist; allowed: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, a datasets save_to_disk folder, or hf:NAME"),
    ("`data=shards data.path=DIR` (not a prepared folder)", "data.path: <dir> has no manifest.json: not a prepared folder; allowed: a folder written by attnzoo-data prepare"),
    ("`data=shards data.path=OUT`, OUT's prepare did not finish", "data.path: <out>/manifest.json is not complete; allowed: run attnzoo-data prepare again to finish it"),
    ("`data=shards data.path=OUT`, a manifest from a newer attnzoo", "data.path: <out>/manifest.json is version 2 (attnzoo 9.0); this attnzoo reads version <= 1; allowed: a newer attnzoo, or prepare it again"),
    ("`data=shards data.packing=true data.seq_len=1913`, every document shorter", "data.seq_len: 1913 is longer than every document of <out> (the longest: 1912 tokens): with data.packing=true no token would see more than 1912 tokens of context; allowed: <= 1912, or data.packing=false"),
    ("`data=shards data.vocab_size=100` (fewer rows than OUT's tokenizer)", "data.vocab_size: 100 embedding rows, fewer than <out>'s tokenizer (300 tokens); allowed: >= 300, or null (the manifest's)"),
    # data=shards data.mixture (tests/test_shards_mixture.py): the refusals that read the prepared folders
    ("`data=shards data.mixture={a: {path: A, ...}, b: {path: B, ...}}`, B prepared with another tokenizer", "data.mixture.b.path: <b> was prepared with another tokenizer than data.mixture.a (<a>: tokenizer.json sha256 cf71e504b70e vs 6aeb77c4cec7), so the same id would be another token; allowed: folders prepared with one tokenizer (`attnzoo-data prepare SRC OUT --tokenizer-file <a>/tokenizer.json`)"),
    ("`data=shards data.mixture=...`, B prepared with another `--eos-token`", "data.mixture.b.path: <b> ends its documents with id 1, data.mixture.a with 0 (another --eos-token); allowed: folders prepared with one end-of-text token"),
    ("`data=shards data.mixture=... data.packing=true data.seq_len=179`, every document of every source shorter", "data.seq_len: 179 is longer than every document of every source (the longest: 178 tokens): with data.packing=true no token would see more than 178 tokens of context; allowed: <= 178, or data.packing=false"),
    ("`data=shards data.mixture=... data.seq_len=306`, a source's val split shorter than one block", "data.seq_len: <a>'s val split (306 tokens) holds 0 blocks of seq_len + 1 = 307 tokens, fewer than one; allowed: a smaller data.seq_len / data.batch_size, or a larger corpus"),
    # issue 43 item 3 (tests/test_checkpoint_safety.py, test_bad_input_cli.py, test_data_prepare.py, test_bad_input.py)
    ("`attnzoo-ckpt consolidate SRC SRC/meta.pt` (DST inside the sharded folder: overwrote its meta.pt)", "DST: <src>/meta.pt is inside SRC <src>, which the file would overwrite or join; allowed: a path outside the checkpoint folder (e.g. model.ckpt)"),
    ("`attnzoo-ckpt info FILE` of a torch.save'd tensor (was a RuntimeError traceback)", "CKPT: <file> is not a training checkpoint (it holds an object of type Tensor, not a dict with state_dict and global_step); allowed: a checkpoint attnzoo-train wrote"),
    ("`attnzoo-generate RUN --prompts FILE`, FILE not UTF-8 (was a UnicodeDecodeError traceback)", "--prompts: <file> is not UTF-8 text (invalid byte at offset 3); allowed: a UTF-8 text file with one prompt per line"),
    ("`attnzoo-generate RUN --prompts DIR`", "--prompts: <dir> is a directory; allowed: a text file with one prompt per line"),
    ("`attnzoo-generate RUN x --kv-group-size 0` (also --kv-cache-dtype, --kv-residual, attnzoo-eval: before the checkpoint is read)", "--kv-group-size: must be >= 1 (tokens per key scale, channels per value scale), got 0"),
    ("`attnzoo-generate RUN x --batch-size 0`", "--batch-size: must be >= 1, got 0"),
    ("`attnzoo-generate RUN x --max-new-tokens -5`", "--max-new-tokens: must be >= 1, got -5"),
    ("`attnzoo-generate FOLDER x` (or attnzoo-eval), FOLDER a sharded checkpoint without meta.pt (was: \"has no checkpoints/last.ckpt\")", "checkpoint: <folder> is a sharded checkpoint whose save did not finish (no .metadata / meta.pt); allowed: a .ckpt file, a complete sharded checkpoint folder, or `last` with hydra.run.dir=<run dir>"),
    ("`attnzoo-data prepare SRC OUT`, a .txt that is not UTF-8 (no NUL byte)", "SRC: <src>/c.txt is not UTF-8 text (invalid byte at offset 3); allowed: UTF-8 text files, or move it out of SRC"),
    ("`attnzoo-data prepare SRC OUT`, a .parquet without the text column", "--text-field: <src>/a.parquet has no column 'text' (its columns: body); allowed: --text-field NAME"),
    ("`attnzoo-data prepare SRC OUT`, a .parquet whose text column holds numbers (was: \"holds no document\", after OUT was made)", "--text-field: <src>/a.parquet column 'text' holds int64, not text (its text columns: none); allowed: --text-field NAME of a string column"),
    ("`attnzoo-data prepare SRC OUT --eos-token NOSUCH` (bpe; was refused after training the BPE)", "--eos-token: 'NOSUCH' is not a special token of the BPE --tokenizer bpe trains; allowed: <|endoftext|>, or omit it"),
    ("`attnzoo-data prepare SRC OUT --val-fraction 1.5` (or nan)", "--val-fraction: got 1.5; allowed: 0 <= f < 1"),
    ("`attnzoo-data prepare SRC OUT --chunk-bytes 0`", "--chunk-bytes: got 0; allowed: >= 1024"),
    ("`attnzoo-data prepare SRC OUT --num-workers 0`", "--num-workers: got 0; allowed: >= 1"),
    ("`attnzoo-data info OUT` (or `data=shards data.path=OUT`), a manifest without `splits` (or a field of another kind; was a KeyError / TypeError traceback)", "OUT: <out>/manifest.json is damaged (splits is missing); allowed: a folder written by attnzoo-data prepare (prepare it again)"),
    ("`attnzoo-data info FILE` (or `data=shards data.path=FILE`)", "OUT: <file> is a file: not a prepared folder; allowed: a folder written by attnzoo-data prepare"),
    ("`trainer.fsdp.param_dtype=bf16` with trainer=cpu (no fsdp section; was \"allowed keys:  (add a new key with +...)\")", "trainer.fsdp.param_dtype: the trainer.fsdp options are read with trainer.strategy=fsdp, and this trainer preset has none; allowed: trainer=fsdp_cpu (or trainer=fsdp on GPUs) with trainer.fsdp.param_dtype=bf16"),
    ("`trainer.max_tokens=100` with 8 x 32 tokens a step", "trainer.max_tokens: 100 is below one batch (256 tokens a step: data.batch_size x data.seq_len x accumulation x data-parallel ranks); allowed: >= 256"),
]


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from attnzoo.config.errors import ConfigError
    from attnzoo.training.run import train
    from tests.conftest import compose_cfg
    from tests.test_bad_input import _cases, base_for

    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, overrides, field, _ in _cases(tmp):
            own_out = any(o.startswith("paths.output_dir=") for o in overrides)
            try:
                train(compose_cfg(base_for(overrides) + overrides, None if own_out else tmp / "run"))
                msg = "NOT REFUSED"
            except ConfigError as e:
                msg = str(e).replace(str(tmp), "<tmp>")
            shown = " ".join(o.replace(str(tmp), "<tmp>") for o in overrides)
            rows.append((f"{name}: `{shown}`", msg))
    rows += EXTRA
    bad = [r for r in rows if r[1] == "NOT REFUSED"]
    if bad:
        raise SystemExit(f"not refused: {bad}")
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    table = ["| # | input | message (one line, exit status 2) |", "|---|---|---|"]
    table += [f"| {i} | {esc(a)} | `{esc(b)}` |" for i, (a, b) in enumerate(rows, 1)]
    doc = ROOT / "docs" / "reliability.md"
    text = doc.read_text()
    block = BEGIN + "\n" + "\n".join(table) + "\n" + END
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda m: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    print(f"{len(rows)} rows written to {doc}")


if __name__ == "__main__":
    main()
