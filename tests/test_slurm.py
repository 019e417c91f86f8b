"""The SLURM forms of a multi-node run compose to the same training command and the same rank environment as
torchrun's (which tests/test_fsdp.py runs for real on this machine): the sbatch example's `srun` line
(scripts/slurm/fsdp.sbatch), with the environment srun gives each task, and `hydra/launcher=slurm` (submitit), whose
generated sbatch script asks for the nodes, tasks and GPUs the trainer section names and runs one task per rank."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from attnzoo.training.config_checks import validate
from attnzoo.training.launch import global_rank, launched_externally, processes_to_launch
from attnzoo.training.rundir import LOCK_NAME, run_dir_lock
from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "fsdp.sbatch"


def sbatch_parts() -> tuple[dict, list[str]]:
    """(#SBATCH options, the srun command's attnzoo-train overrides) of the example script."""
    text = SBATCH.read_text()
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    joined = text.replace("\\\n", " ")  # continuation lines joined
    argv = shlex.split(re.search(r"^srun (.*)$", joined, re.M).group(1))
    assert argv[0] == ".venv/bin/attnzoo-train"
    return opts, [a for a in argv[1:] if not a.startswith(("hydra.run.dir=", "${RESUME"))]


def srun_env(procid: int, nodes: int, per_node: int) -> dict:
    """What srun sets in each task of `--nodes=N --ntasks-per-node=G` (the variables Lightning and attnzoo read)."""
    return {"SLURM_NTASKS": str(nodes * per_node), "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % per_node),
            "SLURM_NODEID": str(procid // per_node), "SLURM_JOB_NAME": "attnzoo-fsdp", "SLURM_JOB_ID": "4242",
            "SLURM_NODELIST": "gpu[001-002]", "SLURM_NTASKS_PER_NODE": str(per_node)}


@pytest.mark.parametrize("procid", [0, 9])
def test_the_sbatch_srun_line_composes_and_each_task_is_its_rank(procid, tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    opts, overrides = sbatch_parts()
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    assert int(opts["gpus-per-node"]) == per_node  # one task per GPU
    for key in [k for k in list(__import__("os").environ) if k.startswith(("SLURM_", "RANK", "LOCAL_RANK"))]:
        monkeypatch.delenv(key)
    for k, v in srun_env(procid, nodes, per_node).items():
        monkeypatch.setenv(k, v)
    # the command's config: the trainer asks for exactly the allocation (data=shards' folder is not here: text)
    cfg = compose_cfg([o for o in overrides if not o.startswith(("data=", "data.path="))] + ["data=text", "debug=smoke"],
                      tmp_path / "run")
    t = validate(cfg)["run"].trainer
    assert (t.strategy, t.devices, t.num_nodes) == ("fsdp", per_node, nodes)
    # srun started every rank: attnzoo launches no workers, and the rank is srun's
    assert launched_externally() and processes_to_launch(t) == 0 and global_rank() == procid
    env = SLURMEnvironment()
    assert SLURMEnvironment.detect() and env.world_size() == nodes * per_node
    assert (env.global_rank(), env.local_rank(), env.node_rank()) == (procid, procid % per_node, procid // per_node)
    assert env.main_address == "gpu001"  # every task rendezvous with the first node
    # global rank 0 alone holds the run-dir lock; the others share its run dir without one
    with run_dir_lock(tmp_path / "run"):
        assert (tmp_path / "run" / LOCK_NAME).exists() == (procid == 0)


def test_the_submitit_launcher_asks_for_the_trainers_allocation(tmp_path):
    """`attnzoo-train -m hydra/launcher=slurm trainer=fsdp trainer.devices=8 trainer.num_nodes=2`: hydra's submitit
    launcher gets nodes / tasks / GPUs from the trainer section, and the sbatch script submitit writes from them runs
    one srun task per GPU, each of which calls the same Hydra job (attnzoo.cli.train._run_job -> train())."""
    from hydra import compose, initialize_config_dir
    from submitit.slurm.slurm import _make_sbatch_string

    from attnzoo.config.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "trainer=fsdp", "trainer.devices=8",
                                          "trainer.num_nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    script = _make_sbatch_string(command="python -u -m submitit.core._submit job", folder=tmp_path,
                                 nodes=launcher.nodes, ntasks_per_node=launcher.tasks_per_node,
                                 gpus_per_node=launcher.gpus_per_node, cpus_per_task=launcher.cpus_per_task,
                                 time=launcher.timeout_min, signal_delay_s=launcher.signal_delay_s)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script, script
    assert re.search(r"^srun .*submitit\.core\._submit", script, re.M)
