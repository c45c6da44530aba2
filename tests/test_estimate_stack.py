"""kernels.stack: the training software an estimate charges for, chosen in the spec (labkit/data/calibration.yaml's
stacks), and the exposed share of tensor-parallel transfers under kernels.tp_comm_overlap."""
import dataclasses
import json

import pytest
import yaml

from labkit.cli import main
from labkit.estimate import default_calibration, estimate
from labkit.estimate.published import published_runs
from labkit.spec import SpecError, load_spec

GPT2 = {"name": "medium", "model": {"preset": "gpt2-medium"}, "parallel": {"tensor": 2, "pipeline": 2},
          "batch": {"micro": 1, "global": 16}, "precision": "fp16", "recompute": None,
          "cluster": {"nodes": [{"gpu": "V100-16GB", "count": 1, "gpus_per_node": 4}]}}


def test_a_spec_chooses_the_stack_and_a_bad_name_lists_the_choices():
    default = load_spec(GPT2)
    assert default.kernels.stack is None  # the calibration's default_stack, as estimate() charged before the key
    assert estimate(default).iteration_time_s == estimate(default, stack="megatron-core").iteration_time_s
    assert estimate(default).assumptions[0] == "software stack megatron-core (the default; set kernels.stack for another)"
    deepspeed = load_spec({**GPT2, "kernels": {"stack": "deepspeed-megatron-2020"}})
    assert estimate(deepspeed).iteration_time_s == estimate(default, stack="deepspeed-megatron-2020").iteration_time_s
    # DeepSpeed's unfused kernels, blocking pipeline transfers and per-all-reduce cost make the same step slower
    assert estimate(deepspeed).iteration_time_s > 1.05 * estimate(default).iteration_time_s
    with pytest.raises(SpecError) as err:
        load_spec({**GPT2, "kernels": {"stack": "deepspeed"}})
    assert any(e.startswith("kernels.stack: 'deepspeed' is not one of megatron-core, megatron-bridge, "
                            "deepspeed-megatron-2020, pytorch-native") for e in err.value.errors)


def test_the_estimate_command_charges_the_specs_stack_unless_told_another(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**GPT2, "kernels": {"stack": "deepspeed-megatron-2020"}}))

    def seconds(*flags):
        assert main(["estimate", str(path), "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        stated.append(out["assumptions"][0])
        return out["iteration_time_s"]

    stated = []

    spec = load_spec(str(path))
    assert seconds() == pytest.approx(estimate(spec).iteration_time_s)
    assert seconds("--stack", "megatron-core") == pytest.approx(estimate(spec, stack="megatron-core").iteration_time_s)
    assert seconds() > 1.05 * seconds("--stack", "megatron-core")
    # the estimate says which stack it charged, and where that came from
    assert stated[:2] == ["software stack deepspeed-megatron-2020 (kernels.stack)", "software stack megatron-core"]
    assert main(["estimate", str(path), "--stack", "deepspeed"]) == 2
    assert "--stack: 'deepspeed' is not one of megatron-core, megatron-bridge" in capsys.readouterr().err


def test_megatron_bridge_runs_the_same_layout_faster_by_its_fitted_compute_scale():
    """NVIDIA's Megatron-Bridge 25.09-26.02 recipes (megatron-core 0.14-0.16) ran faster than the constants fitted on
    NeMo 24.12-25.02 predict: their stack scales the analytic compute, and the Bridge rows it was fitted to are
    estimated with it."""
    cal = default_calibration()
    bridge = cal.stack("megatron-bridge")
    assert 0.8 < bridge.compute_scale < 1 and cal.stack().compute_scale == 1.0
    assert cal.sources["stacks.megatron-bridge"].startswith("fitted:")
    runs = [r for r in published_runs() if r.set == "megatron-bridge-h100"]
    assert len(runs) == 7 and all(r.spec.kernels.stack == "megatron-bridge" for r in runs)
    llama405 = next(r.spec for r in runs if "405B" in r.label)  # 126 layers on 8 x 8 chunks, embedding and loss
    # each counted as a layer
    assert llama405.parallel.account_for_embedding_in_pipeline_split and llama405.parallel.context == 2
    spec = next(r.spec for r in runs if r.label == "Bridge 25.09 Llama 3 70B")  # tensor 4, pipeline 8, 5 virtual
    newer, older = estimate(spec), estimate(spec, stack="megatron-core")
    assert newer.breakdown["compute"] == pytest.approx(bridge.compute_scale * older.breakdown["compute"], rel=0.02)
    assert newer.iteration_time_s < older.iteration_time_s


def test_mt_nlg_estimated_with_its_deepspeed_stack():
    """MT-NLG 530B (Smith et al., arXiv:2201.11990, section 2.4): DeepSpeed's pipeline on Megatron-LM of 2021, on 280
    to 420 DGX A100. megatron-core's constants read it 19-22% fast; its own stack within about 10%."""
    runs = [r for r in published_runs() if r.set == "mt-nlg"]
    assert [r.measured for r in runs] == [60.1, 50.2, 44.4] and all(r.held_out for r in runs)
    for run in runs:
        assert run.spec.kernels.stack == "deepspeed-megatron-2020"
        own = estimate(run.spec).iteration_time_s / run.measured - 1
        core = estimate(run.spec, stack="megatron-core").iteration_time_s / run.measured - 1
        assert core < -0.15 and abs(own) < 0.12 and abs(own) < abs(core) / 2, (run.label, own, core)


def test_tensor_parallel_overlap_leaves_the_fitted_fraction_exposed():
    """Llama 3 70B at tensor 4 on H100: with tp_comm_overlap the exposed transfers are the calibration's fitted share
    of them (the GEMMs could hide them all), between perfect overlap and none."""
    cal = default_calibration()
    assert 0 < cal.tp_overlap_exposed < 1 and cal.sources["tp_overlap_exposed"].startswith("fitted:")
    layout = {"tensor": 4, "pipeline": 8, "virtual_stages": 5, "sequence_parallel": True}
    spec = {"name": "l3", "model": {"preset": "llama3-70b"}, "parallel": layout, "batch": {"micro": 1, "global": 128},
            "precision": "fp8", "optimizer": {"distributed": True}, "recompute": None,
            "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/megatron-lm"},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 8, "gpus_per_node": 8}]}}
    overlapped = estimate(load_spec({**spec, "kernels": {"tp_comm_overlap": True}}))
    plain = estimate(load_spec(spec))
    perfect = estimate(load_spec({**spec, "kernels": {"tp_comm_overlap": True}}),
                       calibration=dataclasses.replace(cal, tp_overlap_exposed=0.0))
    exposed, total = overlapped.exposed_comm_s["tp"], overlapped.exposed_comm_s["tp"] + overlapped.hidden_comm_s["tp"]
    assert exposed == pytest.approx(cal.tp_overlap_exposed * total, rel=1e-6)
    assert total == pytest.approx(plain.exposed_comm_s["tp"], rel=1e-6)
    assert perfect.exposed_comm_s["tp"] == 0
    assert perfect.iteration_time_s < overlapped.iteration_time_s < plain.iteration_time_s


def test_the_pytorch_native_stack_reads_pytorch_fsdp2_runs_closer_than_megatron_cores_constants():
    """KempnerForge's FSDP2 and DTensor runs on H200 (the rows its three constants were fitted to): with its own stack
    each reads within a fifth, half of them within 5%; megatron-core's constants read its pure FSDP rows slow and its
    tensor-parallel ones fast."""
    runs = [r for r in published_runs() if r.set == "pytorch-native-h200"]
    assert len(runs) == 13 and {r.spec.kernels.stack for r in runs} == {"pytorch-native"}
    native = [estimate(r.spec).iteration_time_s / r.measured - 1 for r in runs]
    core = [estimate(r.spec, stack="megatron-core").iteration_time_s / r.measured - 1 for r in runs]
    median = lambda errors: sorted(abs(e) for e in errors)[len(errors) // 2]  # noqa: E731
    assert median(native) < 0.06 and max(map(abs, native)) < 0.2
    assert median(core) > 0.1 and max(map(abs, core)) > 0.25
    assert default_calibration().sources["stacks.pytorch-native"].startswith("fitted:")
