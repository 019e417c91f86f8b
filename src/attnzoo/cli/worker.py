"""One DDP worker process, started by `attnzoo.training.launch` with the torch.distributed environment set: it
trains the job's resolved config as its rank (`launch.run_worker`). Forked from the launcher's fork server, or
started as `python -m attnzoo.cli.worker <job.yaml>` (ATTNZOO_WORKER_START=spawn)."""
from __future__ import annotations

import sys


def main() -> None:
    from attnzoo.training.launch import run_worker

    run_worker(sys.argv[1])


if __name__ == "__main__":
    main()
