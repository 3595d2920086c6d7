"""Demo, experiments and training loops built on lpcompile (not part of the package)."""
