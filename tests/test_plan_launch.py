"""A planned layout really runs: the planner's spec goes through the jobs layer to the local Slurm's a100 and a10 nodes."""
import pytest

from labkit.estimate import estimate
from labkit.jobs import SlurmBackend, State
from labkit.jobs.report import report
from labkit.plan.search import search
from labkit.spec import load_spec

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_planned_pipeline_runs_on_the_emulated_heterogeneous_cluster(tmp_path):
    base = load_spec({
        "name": "planned-tiny", "model": {"preset": "tiny"}, "batch": {"micro": 1, "global": 8},
        "precision": "fp32", "recompute": "none", "train": {"iters": 10, "log_interval": 5}, "data": {"mock": True},
        "job": {"master_port": 29781},
        "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 1},
                              {"gpu": "A10", "count": 1, "gpus_per_node": 1}]}})
    plan = search(base)
    # as the lab does: pick a row of the ranked table (here the best two-stage pipeline) and launch it
    row = next(r for r in plan.rows if r.pp == 2 and r.virtual_stages == 1 and not r.oom)
    spec = load_spec(row.spec.to_dict())
    assert spec.parallel.partition == row.partition and sum(row.partition) == 2
    job = SlurmBackend(runs_dir=tmp_path).submit(spec)
    state = job.wait(progress=False, timeout=300, poll_s=0.5)
    assert state == State.COMPLETED, report(job).cause
    info = report(job).info
    assert "n1" in info and len(info) == 2  # the a100 node and one a10 node
    iterations = job.result().iterations
    assert list(iterations["iteration"].drop_duplicates()) == [5, 10]
    assert iterations["lm_loss"].notna().all()
    assert estimate(spec).iteration_time_s == pytest.approx(row.estimated_s)
