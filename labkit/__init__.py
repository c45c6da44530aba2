"""labkit: plan, launch and read distributed GPT training runs with Megatron on Slurm, from notebooks or a terminal."""
from labkit.spec import RunSpec, SpecError, load_spec

__version__ = "0.1.0"
__all__ = ["RunSpec", "SpecError", "load_spec", "__version__"]
