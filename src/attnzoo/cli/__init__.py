"""Console-script entry points; each is thin and calls a library below.

Importing this package (every console script and `python -m attnzoo.cli.*`, the DDP / FSDP workers included)
keeps Lightning's import lean: torchmetrics' optional back-ends stay unimported (attnzoo/_lean_imports.py).
Library code never imports it, so a user's process that imports attnzoo keeps torchmetrics whole."""
from attnzoo._lean_imports import trim

trim()
