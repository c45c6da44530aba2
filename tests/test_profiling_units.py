"""Profiling readers on a small hand-written GPU trace with known answers (kernel categories, tensor cores, NCCL
process groups, overlap arithmetic), and the naming rules. Real CPU traces are read in test_profiling.py."""
from __future__ import annotations

import gzip
import json

import pytest

from labkit.profiling import tensorboard as tb
from labkit.profiling import trace as tr

MB = 2**20
GEMM_BF16 = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_kernel__5x_cublas"
SGEMM = "volta_sgemm_128x64_nn"
FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 4, false, cutlass::bfloat16_t>>"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"
NCCL_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _op(name, ts, dur, cat="cpu_op", tid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation, kernel, start, dur, cat="kernel"):
    return [_op("cudaLaunchKernel", ts, 5, cat="cuda_runtime", correlation=correlation),
            {"ph": "X", "cat": cat, "name": kernel, "pid": 0, "tid": 7, "ts": start, "dur": dur,
             "args": {"correlation": correlation, "device": 0, "stream": 7}}]


def _memory(ts, allocated_mb, device_type=1):
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 7, "tid": 100, "ts": ts,
            "args": {"Total Allocated": allocated_mb * MB, "Total Reserved": 512 * MB, "Bytes": MB,
                     "Device Type": device_type, "Device Id": 0}}


def _gpu_trace() -> dict:
    """Two steps (0-1000, 1000-2000 µs) on rank 1 of 4 (tensor 2 x data 2) of an NCCL run."""
    events = [
        _op("ProfilerStep#5", 0, 1000, cat="user_annotation"),
        _op("ProfilerStep#6", 1000, 1000, cat="user_annotation"),
        _op("aten::mm", 10, 50), *_launch(20, 1, GEMM_BF16, 100, 300),
        _op("c10d::allreduce_", 100, 40, **{"Input Dims": [[[2048, 4, 1024]]]}),
        _op("record_param_comms", 105, 30, **{"Collective name": "allreduce", "Process Group Name": "3",
                                              "Process Group Description": "TENSOR_MODEL_PARALLEL_GROUP",
                                              "Process Group Ranks": "[0, 1]"}),
        *_launch(110, 2, NCCL_ALL_REDUCE, 300, 200),
        _op("aten::add_", 590, 20), *_launch(595, 3, ELEMENTWISE, 600, 100),
        # described only by its ranks: dp for this layout
        _op("c10d::allreduce_", 1050, 50, **{"Input Dims": [[[1000000]]]}),
        _op("record_param_comms", 1055, 40, **{"Process Group Name": "9", "Process Group Ranks": "[1, 3]"}),
        *_launch(1060, 4, NCCL_ALL_REDUCE, 1100, 400),
        _op("autograd::engine::evaluate_function: MmBackward0", 1250, 100),  # step 6's backward pass begins
        _op("aten::mm", 1450, 30), *_launch(1455, 5, SGEMM, 1500, 300),
        # named by the trace's process-group table (pg 5 is Megatron's data-parallel group); no kernel of its own
        _op("c10d::broadcast_", 1600, 10, **{"Input Dims": [[[16]]]}),
        _op("record_param_comms", 1602, 6, **{"Process Group Name": "5"}),
        _op("aten::_flash_attention_forward", 1700, 40), *_launch(1705, 6, FLASH, 1800, 100),
        *_launch(1940, 7, "Memcpy DtoD (Device -> Device)", 1950, 20, cat="gpu_memcpy"),
        _memory(10, 100), _memory(500, 300), _memory(900, 150), _memory(1200, 350), _memory(1900, 120),
        _memory(1300, 9999, device_type=0),  # host memory: not the curve of a GPU trace
    ]
    return {"schemaVersion": 1, "traceEvents": events,
            "distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 4, "pg_count": 3, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]},
                {"pg_name": "3", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 1]},
                {"pg_name": "5", "pg_desc": "DATA_PARALLEL_GROUP", "ranks": [1, 3]}]}}


@pytest.fixture
def gpu(tmp_path):
    path = tmp_path / "rank1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_gpu_trace(), f)
    return tr.load_trace(path)


def test_gpu_trace_steps_kernels_and_tensor_cores(gpu):
    assert (gpu.rank, gpu.world_size, gpu.backend, gpu.device) == (1, 4, "nccl", "cuda")
    assert tr.steps(gpu).to_dict("list") == {"step": [5, 6], "start_ms": [0.0, 1.0], "duration_ms": [1.0, 1.0]}
    k = tr.kernels(gpu).set_index("kernel")
    assert k.loc[GEMM_BF16, "category"] == "matmul" and k.loc[GEMM_BF16, "tensor_core"]
    assert k.loc[SGEMM, "category"] == "matmul" and not k.loc[SGEMM, "tensor_core"]
    assert k.loc[FLASH, "category"] == "attention" and k.loc[FLASH, "tensor_core"]
    assert k.loc[ELEMENTWISE, "category"] == "elementwise"
    assert k.loc[NCCL_ALL_REDUCE, ["category", "calls", "total_ms"]].tolist() == ["communication", 2, 0.6]
    assert tr.tensor_core_share(gpu) == pytest.approx(400 / 1400)
    parts = tr.breakdown(gpu).set_index("category")["time_ms"]
    assert parts.to_dict() == pytest.approx({"matmul": 0.6, "attention": 0.1, "elementwise": 0.1, "normalization": 0,
                                             "communication": 0.6, "memory": 0.02, "other": 0})


def test_gpu_compute_communication_overlap(gpu):
    row = tr.compute_communication(gpu).iloc[0]
    # compute kernels cover 820 µs, NCCL 600 µs, of which 100 µs run together, within a 2000 µs profiled span
    assert row[["span_ms", "computation_ms", "overlapping_ms", "communication_ms", "other_ms"]].tolist() == \
        pytest.approx([2.0, 0.72, 0.1, 0.5, 0.68])


def test_gpu_communication_groups_from_process_group_records(gpu):
    table = tr.communication(gpu, tensor=2).set_index(["collective", "group"])
    assert table.loc[("all_reduce", "tp"), ["calls", "time_ms", "elements"]].tolist() == [1, 0.2, 2048 * 4 * 1024]
    assert table.loc[("all_reduce", "dp"), ["calls", "time_ms", "elements"]].tolist() == [1, 0.4, 1000000]
    assert table.loc[("broadcast", "dp"), ["calls", "time_ms"]].tolist() == [1, 0.0]
    # without the layout, ranks [1, 3] name no group of a 4-rank world
    assert set(tr.communication(gpu)["group"]) == {"tp", "dp", "unknown"}
    by_group = tr.communication_by_group(gpu, tensor=2).set_index("group")
    assert by_group.loc["dp", "share"] == pytest.approx(0.2)
    assert tr.communication_calls(gpu, tensor=2)["group"].tolist() == ["tp", "dp", "dp"]


def test_gpu_memory_curve_uses_device_memory(gpu):
    curve = tr.memory_curve(gpu)
    assert curve["allocated_mb"].tolist() == [100, 300, 150, 350, 120]
    assert curve["step"].tolist() == [5, 5, 5, 6, 6]
    per_step = tr.memory_per_step(gpu)
    assert per_step[["step", "start_mb", "peak_mb", "growth_mb"]].to_dict("list") == {
        "step": [5, 6], "start_mb": [100, 150], "peak_mb": [300, 350], "growth_mb": [200, 200]}
    # step 6's backward pass starts at 1250 µs, when 350 MB are allocated: 200 MB more than at its start
    assert per_step["saved_mb"].isna().tolist() == [True, False] and per_step["saved_mb"].iloc[1] == 200


def test_cpu_fallback_steps_from_optimizer_steps(tmp_path):
    events = [_op("aten::mm", 0, 100), _op("Optimizer.step#AdamW.step", 100, 20, cat="user_annotation"),
              _op("aten::mm", 130, 100), _op("Optimizer.step#AdamW.step", 240, 20, cat="user_annotation")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    steps = tr.steps(tr.load_trace(path))
    assert steps.to_dict("list") == {"step": [0, 1], "start_ms": [0.0, 0.12], "duration_ms": [0.12, 0.14]}


def test_empty_profiler_step_is_not_a_step(tmp_path):
    events = [_op("ProfilerStep#0", 0, 100, cat="user_annotation"), _op("aten::mm", 10, 50),
              _op("ProfilerStep#1", 100, 1, cat="user_annotation")]  # opened by the last step(), closed by stop()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert tr.steps(tr.load_trace(path))["step"].tolist() == [0]


def test_self_time_subtracts_nested_operators(gpu):
    ops = tr.operators(gpu).set_index("operator")
    assert ops.loc["c10d::allreduce_", ["calls", "total_ms", "self_ms"]].tolist() == pytest.approx([2, 0.09, 0.02])
    assert ops.loc["record_param_comms", "category"] == "communication"


@pytest.mark.parametrize("name, collective", [
    ("c10d::allreduce_", "all_reduce"), ("c10d::allreduce_coalesced_", "all_reduce"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::_allgather_base_", "all_gather"),
    ("gloo:all_gather", "all_gather"), ("c10d::broadcast_", "broadcast"), ("c10d::recv_", "send_recv"),
    ("gloo:send", "send_recv"), ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"), ("nccl:all_to_all", "all_to_all"),
    ("c10d::barrier", "barrier"), ("aten::mm", None), ("aten::all", None),
])
def test_collective_names(name, collective):
    assert tr.collective_of(name) == collective


@pytest.mark.parametrize("name, category", [
    ("aten::addmm", "matmul"), ("AddmmBackward0", "matmul"), ("aten::baddbmm", "matmul"),
    ("LinearWithGradAccumulationAndAsyncCommunication", "matmul"), ("aten::_softmax", "attention"),
    ("aten::_scaled_dot_product_flash_attention", "attention"), ("aten::gelu_backward", "elementwise"),
    ("aten::_to_copy", "elementwise"), ("aten::_foreach_mul_", "elementwise"),
    ("aten::native_layer_norm", "normalization"),
    ("c10d::allreduce_", "communication"), ("aten::embedding", "other"), ("aten::as_strided", "other"),
    ("aten::_log_softmax", "other"), ("aten::_log_softmax_backward_data", "other"),
])
def test_operator_categories(name, category):
    assert tr.operator_category(name) == category


def test_megatron_group_descriptions():
    assert tr.group_of_description("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert tr.group_of_description("DATA_PARALLEL_GROUP_WITH_CP") == "dp"
    assert tr.group_of_description("PIPELINE_MODEL_PARALLEL_GROUP") == "pp"
    assert tr.group_of_description("EMBEDDING_GROUP") == "embedding"
    assert tr.group_of_description("EXPERT_DATA_PARALLEL_GROUP") == "ep"
    assert tr.group_of_description("MODEL_PARALLEL_GROUP") == "model"
    assert tr.group_of_description("default_pg") == "world"
    assert tr.group_of_description(None) is None


def test_layout_heuristic_without_process_group_records(tmp_path):
    events = [_op("c10d::allreduce_", 0, 10, **{"Input Dims": [[[64, 2, 32]]]}),
              _op("c10d::allreduce_", 20, 10, **{"Input Dims": [[[5000]]]}),
              _op("c10d::send", 40, 10, **{"Input Dims": [[[64, 2, 32]]]})]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 8}}))
    t = tr.load_trace(path)
    assert tr.communication_calls(t, tensor=2, pipeline=2)["group"].tolist() == ["tp", "dp", "pp"]
    assert tr.communication_calls(t, tensor=1, pipeline=1)["group"].tolist() == ["dp", "dp", "pp"]
    assert tr.communication_calls(t, tensor=8)["group"].tolist() == ["tp", "tp", "pp"]


def test_the_moe_token_dispatch_is_expert_traffic_though_tensor_parallels_mappings_make_the_call(tmp_path):
    """megatron-core's dispatcher calls tensor_parallel/mappings.py's all_to_all over the expert group: the frame
    outside names the group; the same mapping under attention stays tensor-parallel traffic."""
    def frame(name, ts, dur):
        return _op(name, ts, dur, cat="python_function")

    events = [frame("megatron/core/transformer/moe/token_dispatcher.py(700): token_dispatch", 0, 100),
              frame("megatron/core/tensor_parallel/mappings.py(520): all_to_all", 10, 50),
              _op("c10d::alltoall_base_", 20, 10, **{"Input Dims": [[[48, 64]]]}),
              # its backward pass, which autograd runs without the dispatcher's frames
              frame("megatron/core/tensor_parallel/mappings.py(453): backward", 120, 50),
              _op("c10d::alltoall_base_", 130, 10, **{"Input Dims": [[[48, 64]]]}),
              frame("megatron/core/transformer/attention.py(900): forward", 200, 100),
              frame("megatron/core/tensor_parallel/mappings.py(330): reduce_from_tensor_model_parallel_region", 210,
                    50),
              _op("c10d::allreduce_", 220, 10, **{"Input Dims": [[[64, 2, 32]]]})]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 4}}))
    assert tr.communication_calls(tr.load_trace(path), tensor=2)["group"].tolist() == ["ep", "ep", "tp"]


def test_memory_timeline_reads_categories(tmp_path):
    path = tmp_path / "rank0.memory_timeline.json"
    # [times in µs, sizes]: column 0 unused, then parameter, optimizer_state, input, temporary, activation, ...
    path.write_text(json.dumps([[1000, 3000], [[0, MB, 0, 0, 0, 4 * MB, 0, 0, 0], [0, MB, 0, 0, 0, 2 * MB, MB, 0, 0]]]))
    timeline = tr.memory_timeline(path)
    assert timeline["time_ms"].tolist() == [0, 2]
    assert timeline["activation_mb"].tolist() == [4, 2] and timeline["gradient_mb"].tolist() == [0, 1]
    assert timeline["total_mb"].tolist() == [5, 4]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="export_memory_timeline"):
        tr.memory_timeline(tmp_path / "bad.json")


def test_memory_timeline_categories_follow_torch():
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    order = sorted(_CATEGORY_TO_INDEX, key=_CATEGORY_TO_INDEX.get)
    assert tuple("unknown" if c is None else c.name.lower() for c in order) == tr.MEMORY_TIMELINE_CATEGORIES


def test_missing_files_say_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tensorboard-dir"):
        tb.read_scalars(tmp_path)
    with pytest.raises(FileNotFoundError, match="--profile"):
        tr.load_traces(tmp_path)
    (tmp_path / "not_a_trace.json").write_text("[]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        tr.load_trace(tmp_path / "not_a_trace.json")


def test_summary_cli_on_a_missing_run(tmp_path, capsys):
    from labkit.cli import main

    assert main(["profiling", "summary", str(tmp_path / "nowhere")]) == 2
    assert "no such trace file or run directory" in capsys.readouterr().err


def test_tensorboard_command_quotes_the_path():
    assert tb.tensorboard_command("runs/my run") == "tensorboard --logdir 'runs/my run'"
    assert tb.tensorboard_command("runs/a", port=6007, bind_all=True) == \
        "tensorboard --logdir runs/a --port 6007 --bind_all"


def test_gpu_views_mark_tensor_core_kernels(gpu):
    from labkit.profiling import views

    fig = views.kernel_figure(gpu)
    labels = [label for d in fig.data for label in d.y]
    assert any(label.startswith("[TC] ") and "xmma_gemm_bf16" in label for label in labels)
    assert any(label.startswith(SGEMM) for label in labels)
    assert "tensor cores 28.6% of kernel time" in fig.layout.title.text
    row = views.comparison_table({"bf16": gpu}).iloc[0]
    assert row["tensor_core_share"] == pytest.approx(400 / 1400)
    assert row["communication_share"] == pytest.approx((500 + 100) / 2000)
    groups = views.communication_group_figure(gpu, tensor=2)
    assert {d.name: sum(d.x) for d in groups.data} == pytest.approx({"tp": 0.2, "dp": 0.4})
