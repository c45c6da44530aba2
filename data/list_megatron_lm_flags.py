"""Print the flags Megatron-LM's argument parser defines, one per line (labkit/data/megatron_lm_flags.txt).

    python data/list_megatron_lm_flags.py CHECKOUT > flags.txt

CHECKOUT is a Megatron-LM source tree at the pinned release. The parser is built the way Megatron-LM builds it
(add_megatron_arguments) and its option strings are listed. Modules the parser's imports touch but never use while
defining flags (GPU kernels, logging services, optional checkpoint formats) are replaced by empty stand-ins, so this
runs on a machine without them.
"""
import argparse
import importlib.abc
import importlib.machinery
import sys
import warnings
from unittest import mock

STAND_INS = ("megatron.core.transformer.custom_layers.batch_invariant_kernels", "pydantic", "regex",
             "nvidia_resiliency_ext", "einops", "flashattn_hopper", "wandb", "onelogger", "tensorstore", "zarr",
             "modelopt", "nvtx")


class StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name in STAND_INS or name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock()
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    sys.meta_path.insert(0, StandIns())
    warnings.filterwarnings("ignore")
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    print("\n".join(sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})))


if __name__ == "__main__":
    main()
