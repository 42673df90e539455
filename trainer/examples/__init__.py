"""Example training scripts (run them with torchrun); they share ``common``."""
