from attnzoo.bench.cli import main

main()
