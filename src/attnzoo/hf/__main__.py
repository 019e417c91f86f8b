"""`python -m attnzoo.hf RUN_DIR OUT_DIR` = attnzoo-export."""
from . import main

main()
