"""Model parts other than token mixers: FFNs, MoE, norms, positions, KV-cache containers, aux-loss hooks."""
