"""Today's stack in the spec: attention backends, communication overlap, FP8 and context parallelism, as Megatron-LM
names them, refused where the GPUs or the CPU driver cannot run them."""
import pytest

from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec
from labkit.spec.layout import layout_of


def h100(nodes=1, **sections):
    return {"model": {"preset": "llama2-7b"}, "batch": {"micro": 1, "global": 64},
            "cluster": {"nodes": [{"gpu": "H100-SXM", "count": nodes, "gpus_per_node": 8}]}, **sections}


def errors_of(spec: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    return info.value.errors


def test_fp8_is_refused_on_a100_naming_precision_and_the_gpu_and_renders_hybrid_on_h100():
    on_a100 = {**h100(), "precision": "fp8", "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1,
                                                                     "gpus_per_node": 8}]}}
    (error,) = [e for e in errors_of(on_a100) if e.startswith("precision:")]
    assert "A100-80GB" in error and "FP8 tensor cores" in error
    args = megatron_args(load_spec({**h100(), "precision": "fp8"}))
    assert args[args.index("--bf16"):args.index("--bf16") + 3] == ["--bf16", "--fp8-format", "hybrid"]


def test_kernels_render_megatron_lms_flags():
    spec = load_spec({**h100(), "parallel": {"tensor": 2, "sequence_parallel": True},
                      "optimizer": {"distributed": True},
                      "kernels": {"attention_backend": "unfused", "overlap_grad_reduce": True,
                                  "overlap_param_gather": True, "tp_comm_overlap": True}})
    args = megatron_args(spec)
    assert args[args.index("--attention-backend") + 1] == "unfused"
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"} <= set(args)
    assert "--attention-backend" not in megatron_args(load_spec(h100()))  # auto is Megatron-LM's default


@pytest.mark.parametrize("kernels, parallel, named", [
    ({"attention_backend": "triton"}, {}, "kernels.attention_backend"),
    ({"overlap_param_gather": True}, {}, "kernels.overlap_param_gather"),
    ({"tp_comm_overlap": True}, {"tensor": 2}, "kernels.tp_comm_overlap"),
])
def test_kernel_settings_megatron_would_refuse_name_their_field(kernels, parallel, named):
    assert any(e.startswith(named + ":") for e in errors_of({**h100(), "kernels": kernels, "parallel": parallel}))


def test_context_parallel_takes_its_share_of_the_world_in_megatrons_rank_order():
    spec = load_spec({**h100(nodes=2), "parallel": {"tensor": 2, "context": 2, "pipeline": 2}})
    assert spec.data_parallel == 2  # 16 GPUs / (tp 2 x cp 2 x pp 2)
    layout = layout_of(spec)
    assert (layout.context, layout.data) == (2, 2)
    assert layout.rank(tp=1, cp=1, dp=0, pp=0) == 3 and layout.rank(dp=1) == 4 and layout.rank(pp=1) == 8
    args = megatron_args(spec)
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert "--context-parallel-size" not in megatron_args(load_spec(h100()))


def test_context_parallel_needs_a_divisible_world_and_sequence_and_a_gpu():
    assert any(e.startswith("parallel.pipeline:") and "context 3" in e
               for e in errors_of({**h100(), "parallel": {"context": 3}}))
    assert any(e.startswith("parallel.context:") and "2 x 8" in e
               for e in errors_of({**h100(), "model": {"preset": "llama2-7b", "seq_length": 4088},
                                   "parallel": {"context": 8}}))
    on_cpu = {"model": {"preset": "tiny"}, "parallel": {"context": 2}, "batch": {"micro": 1, "global": 2}}
    # on CPUs only labkit's driver runs, which does not split sequences (a GPU plan is judged as Megatron-LM runs it)
    assert any(e.startswith("parallel.context: labkit's driver does not split sequences") for e in errors_of(on_cpu))


def test_sequence_parallelism_on_cpu_is_refused_before_the_driver_would_refuse_it():
    on_cpu = {"model": {"preset": "tiny"}, "parallel": {"tensor": 2, "sequence_parallel": True},
              "batch": {"micro": 1, "global": 2}}
    assert any(e.startswith("parallel.sequence_parallel:") and "CPU" in e for e in errors_of(on_cpu))
    assert load_spec({**h100(), "parallel": {"tensor": 2, "sequence_parallel": True}}).parallel.sequence_parallel
