"""Pure-PyTorch kernels, each beside its slow, obviously-correct reference form."""
