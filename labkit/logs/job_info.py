"""The job-info lines a labkit job script prints into each node's log before training (`WORLD_SIZE: 4`, one
`KEY: value` a line, as FASOP's scripts do: github AvatarHwang/FASOP). The keys are named once, here, for the script
that writes them (labkit.jobs.render), the parser that reads them (labkit.logs.parse) and the diagnosis that compares
them with the spec (labkit.jobs.diagnose)."""
import re
from typing import Iterable

# Values of the run, from its spec, in the order the script prints them.
KEYS = ("NNODES", "WORLD_SIZE", "GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE", "TENSOR_MP_SIZE", "PIPELINE_MP_SIZE",
        "DP_SIZE", "PARTITION", "MODEL", "NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH", "PRECISION")
# Values of the node printing them (templates/node.sh.j2 writes these before KEYS).
NODE_KEYS = ("NODE", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")
# The KEYS that describe the parallel layout, under the names ParsedLog.parallel gives them.
PARALLEL = {"WORLD_SIZE": "world_size", "DP_SIZE": "data", "TENSOR_MP_SIZE": "tensor", "PIPELINE_MP_SIZE": "pipeline",
            "NNODES": "nodes", "GLOBAL_BATCH_SIZE": "global_batch_size", "MICRO_BATCH_SIZE": "micro_batch_size",
            "PARTITION": "partition"}

_ECHOED = re.compile(r"^(" + "|".join(NODE_KEYS + KEYS) + r"): (.*)$")
_WORLD = re.compile(r"using world size: (\d+), data-parallel size: (\d+),.*?tensor-model-parallel size: (\d+), "
                    r"pipeline-model-parallel size: (\d+)")
_WORLD_KEYS = ("LOG_WORLD_SIZE", "LOG_DP_SIZE", "LOG_TENSOR_MP_SIZE", "LOG_PIPELINE_MP_SIZE")


def node_info(lines: Iterable[str]) -> dict[str, str]:
    """One node's `KEY: value` job-info lines (the first of each), plus the parallel sizes the driver's log reports
    (as LOG_WORLD_SIZE, LOG_DP_SIZE, ...), kept apart so a diagnosis can tell the script's values from the driver's."""
    values: dict[str, str] = {}
    for line in lines:
        echoed = _ECHOED.match(line)
        if echoed and echoed.group(1) not in values:
            values[echoed.group(1)] = echoed.group(2).strip()
        world = _WORLD.search(line)
        if world:
            values.update(zip(_WORLD_KEYS, world.groups()))
    return values
