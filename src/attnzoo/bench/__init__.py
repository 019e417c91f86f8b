"""`attnzoo-bench SUBCOMMAND`: benchmarks that write numbers (JSON + a markdown table), never assertions.

Each subcommand is a module in this package defining:
    HELP: str                               one-line description
    add_arguments(parser) -> None           its flags
    run(args) -> dict                       {"title": str, "columns": [...], "rows": [dict, ...], "notes": [...]}
Every result is written to `<out>/<subcommand>.json` and `<out>/<subcommand>.md` (default out: bench_results/).
"""
