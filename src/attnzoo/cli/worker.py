"""One DDP worker process (`python -m attnzoo.cli.worker <job.yaml>`), started by `attnzoo.training.launch` with the
torch.distributed environment set: it trains the job's resolved config as its rank."""
from __future__ import annotations

import sys

from omegaconf import OmegaConf


def main() -> None:
    import os

    from attnzoo.training.launch import LAUNCHER_ENV
    from attnzoo.distributed.processes import die_with_parent

    if os.environ.get(LAUNCHER_ENV):  # first: a worker never outlives its launcher (no orphan after a SIGKILL)
        die_with_parent(int(os.environ[LAUNCHER_ENV]))
    from attnzoo.config.errors import ConfigError
    from attnzoo.training.run import train

    try:
        train(OmegaConf.load(sys.argv[1]))
    except ConfigError as e:  # a fault every rank reports alike (a full disk): one line, handed to the launcher
        from attnzoo.training.launch import write_worker_error

        write_worker_error(sys.argv[1], e)
        if not (os.environ.get(LAUNCHER_ENV) and os.environ.get("RANK") == "0"):  # rank 0's launcher says it
            print(f"attnzoo: error: {e}", file=sys.stderr)  # (the other ranks' stderr is their launch/ log)
        sys.exit(2)
    close_process_group()


def close_process_group() -> None:
    """Leave the process group together: without it, a rank that exits while another is still inside its
    last collective (rank 0 writes the summary after the final validation) makes gloo abort that other
    rank with SIGABRT at exit (seen as `exit code -6` on CI). A barrier, then an orderly destroy."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
