"""Distribution: context parallelism and the process trees of launched workers."""
