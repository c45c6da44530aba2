"""Checkpoints from and for other tools: `labkit checkpoint import-hf` and `export-hf` (labkit.checkpoint.hf)."""
