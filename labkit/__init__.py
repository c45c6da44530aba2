"""labkit: plan, launch and read distributed GPT training runs with Megatron on Slurm, from notebooks or a terminal."""
from labkit.spec import RunSpec, SpecError, load_spec

from importlib.metadata import version as _version

__version__ = _version("labkit")
__all__ = ["RunSpec", "SpecError", "load_spec", "__version__"]
