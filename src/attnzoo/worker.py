"""One DDP worker process (`python -m attnzoo.worker <job.yaml>`), started by `attnzoo.launch` with the
torch.distributed environment set: it trains the job's resolved config as its rank."""
from __future__ import annotations

import sys

from omegaconf import OmegaConf


def main() -> None:
    from .train import train

    train(OmegaConf.load(sys.argv[1]))


if __name__ == "__main__":
    main()
