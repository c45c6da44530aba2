"""The host time labkit's driver spends around the layers on a CPU (calibration.yaml cpu_host_s_per_pass and
cpu_host_s_per_step, measured by benchmarks/bench_host_overhead.py): charged per model chunk's pass and per step on
CPUs, and never on GPUs, whose asynchronous launches hide it."""
import dataclasses

import pytest

from labkit.estimate import default_calibration, estimate
from labkit.spec import load_spec


def spec(gpu: str, **parallel):
    return load_spec({"model": {"preset": "tiny", "num_layers": 4}, "precision": "fp32" if gpu == "cpu" else "bf16",
                      "parallel": {"tensor": 1, **parallel}, "batch": {"micro": 1, "global": 8},
                      "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 2}]}})


def seconds(s, per_pass: float, per_step: float) -> float:
    cal = dataclasses.replace(default_calibration(), cpu_host_s_per_pass=per_pass, cpu_host_s_per_step=per_step)
    return estimate(s, calibration=cal).iteration_time_s


def test_each_pass_of_each_micro_batch_and_each_step_is_charged_on_a_cpu():
    data_parallel = spec("cpu", data=2)  # 4 micro-batches a rank, one pass each
    without = seconds(data_parallel, 0.0, 0.0)
    assert seconds(data_parallel, 0.01, 0.0) - without == pytest.approx(4 * 0.01)
    assert seconds(data_parallel, 0.0, 0.05) - without == pytest.approx(0.05)
    # two model chunks per stage pass twice per micro-batch: the interleaved pipeline pays more
    plain, interleaved = spec("cpu", pipeline=2), spec("cpu", pipeline=2, virtual_stages=2)
    assert seconds(interleaved, 0.01, 0.0) - seconds(interleaved, 0.0, 0.0) > \
        seconds(plain, 0.01, 0.0) - seconds(plain, 0.0, 0.0) > 8 * 0.01


def test_gpus_pay_none_of_it():
    gpus = spec("A100-80GB", data=2)
    assert seconds(gpus, 0.01, 0.05) == seconds(gpus, 0.0, 0.0)


def test_only_megatron_cores_ddp_and_distributed_optimizer_pay_it_where_it_was_measured():
    fsdp2 = load_spec({"model": {"preset": "tiny", "untie_embeddings": True}, "precision": "fp32",
                       "parallel": {"data": 2}, "optimizer": {"zero_stage": 3}, "batch": {"micro": 1, "global": 8},
                       "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
    assert seconds(fsdp2, 0.01, 0.05) == seconds(fsdp2, 0.0, 0.0)
    ddp = spec("cpu", data=2)
    assert any(a.startswith("the CPU's host time around the layers: 1.5 ms per model chunk and micro-batch")
               for a in estimate(ddp).assumptions)
    assert not any("host time" in a for a in estimate(fsdp2).assumptions)
