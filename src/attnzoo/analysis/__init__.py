"""Analysis of runs and sweeps: length extrapolation, multirun sweeps, reports."""
