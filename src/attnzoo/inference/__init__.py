"""Using a trained run: load, generate, evaluate, lm-eval."""
