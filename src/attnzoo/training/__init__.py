"""Training: LightningModules, callbacks, checkpoint I/O, loggers, launch, run dir, config checks, train()."""
