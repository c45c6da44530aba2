"""The overlaps a plan assumes where its input does not write them: what the stack runs on the cluster's hardware,
each on wherever the chosen layout allows it, stated in the plan's text and JSON."""
import contextlib
import io
import json

import pytest
import yaml

from labkit import catalog
from labkit.cli import main
from labkit.estimate import default_calibration, estimate
from labkit.estimate.calibration import OVERLAPS, calibration_from_dict
from labkit.plan.inputs import planning_input, stack_overlaps
from labkit.plan.search import search
from labkit.spec import load_spec

H100 = {"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}
ALL_ON = {"stack": "megatron-core", "overlap_grad_reduce": True, "overlap_param_gather": True, "tp_comm_overlap": True}


def plan(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture
def h100(tmp_path):
    path = tmp_path / "h100.yaml"
    path.write_text(yaml.safe_dump(H100))
    return str(path)


def test_a_cluster_file_plans_with_the_default_stacks_overlaps_and_states_them(h100, capsys):
    out = plan(h100, "--model", "llama3-8b", "--global-batch", "64", "--top", "3")
    assert out["assumed"] == ALL_ON
    kernels, spec = out["spec"]["kernels"], out["spec"]
    assert kernels["overlap_grad_reduce"]
    assert kernels["overlap_param_gather"] == (spec["optimizer"]["zero_stage"] == 1)
    assert kernels["tp_comm_overlap"] == spec["parallel"]["sequence_parallel"]
    assert main(["plan", h100, "--model", "llama3-8b", "--global-batch", "64", "--top", "3"]) == 0
    assert ("assumed: kernels.stack megatron-core, overlap_grad_reduce on, overlap_param_gather on where the "
            "optimizer is sharded, tp_comm_overlap on where sequence parallelism is") in capsys.readouterr().out


def test_every_row_is_estimated_with_the_overlaps_its_layout_allows(h100):
    base, constraints = planning_input(h100, "gpt-7.5b", 64)
    rows = search(base, constraints=constraints, top=20).rows
    assert {r.zero_stage for r in rows} > {0} and {r.sequence_parallel for r in rows} == {True, False}
    for row in rows:
        kernels = row.spec.kernels
        assert kernels.overlap_grad_reduce
        assert kernels.tp_comm_overlap == row.sequence_parallel
        assert kernels.overlap_param_gather == (row.zero_stage == 1)  # FSDP2 (labkit's driver) gathers its own
        load_spec(row.spec.to_dict())  # a run spec the checks accept
    best = rows[0]
    assert estimate(best.spec).iteration_time_s == pytest.approx(best.estimated_s)


def test_a_cpu_cluster_assumes_no_overlap():
    out = plan("laptop", "--model", "tiny", "--global-batch", "8", "--top", "1")
    assert out["assumed"] == {"stack": "megatron-core", "overlap_grad_reduce": False, "overlap_param_gather": False,
                              "tp_comm_overlap": False}


def test_a_run_spec_keeps_the_overlaps_and_stack_it_writes(h100, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama3-8b"}, "batch": {"global": 64},
                                    "kernels": {"overlap_grad_reduce": False}, "cluster": H100}))
    out = plan(str(spec), "--top", "1")
    # the parameter gather needs the gradient reduce beside it; the tensor-parallel overlap is the stack's
    assert out["assumed"] == {**ALL_ON, "overlap_grad_reduce": False, "overlap_param_gather": False}
    spec.write_text(yaml.safe_dump({"model": {"preset": "llama3-8b"}, "batch": {"global": 64},
                                    "kernels": {"stack": "deepspeed-megatron-2020"}, "cluster": H100}))
    assert plan(str(spec), "--top", "1")["assumed"] == {"stack": "deepspeed-megatron-2020",
                                                        "overlap_grad_reduce": False, "overlap_param_gather": False,
                                                        "tp_comm_overlap": False}


def test_stack_overlaps_by_stack_and_hardware():
    assert stack_overlaps(None, on_gpus=True) == {k: v for k, v in ALL_ON.items() if k != "stack"}
    assert stack_overlaps("megatron-bridge", on_gpus=True) == stack_overlaps(None, on_gpus=True)
    assert not any(stack_overlaps("deepspeed-megatron-2020", on_gpus=True).values())
    # PyTorch's own stack prefetches FSDP2's gathers and reduces behind the backward, but DTensor's tensor-parallel
    # collectives wait on the GEMMs
    assert stack_overlaps("pytorch-native", on_gpus=True) == {"overlap_grad_reduce": True,
                                                             "overlap_param_gather": True, "tp_comm_overlap": False}
    assert set(default_calibration().stack("pytorch-native").overlaps) < set(OVERLAPS)


def test_every_stack_lists_the_overlaps_it_runs_by_their_kernels_names():
    data = catalog.calibration()
    assert all(set(default_calibration().stack(name).overlaps) <= set(OVERLAPS) for name in data["stacks"])
    for wrong in ("overlap_grad_reduce", ["overlap_grads"], None):
        stacks = {**data["stacks"], "megatron-core": {**data["stacks"]["megatron-core"], "overlaps": wrong}}
        with pytest.raises(ValueError, match="stacks.megatron-core.overlaps: .* is not a list of overlap_grad_reduce"):
            calibration_from_dict({**data, "stacks": stacks})
    assert not any(stack_overlaps(None, on_gpus=False).values())
    assert stack_overlaps(None, True, {"tp_comm_overlap": False}) == {"overlap_grad_reduce": True,
                                                                       "overlap_param_gather": True}
