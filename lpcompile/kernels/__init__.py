"""Hand-written kernels, by device."""
