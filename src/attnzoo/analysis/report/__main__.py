"""`python -m attnzoo.analysis.report <multirun dir>`: the same as attnzoo-report."""
from attnzoo.analysis.report.cli import main

main()
