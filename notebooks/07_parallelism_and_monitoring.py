# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 07: 3D parallelism and monitoring: three layouts, their logs, a failure, the dashboard
#
# **Objectives.** By the end of this lab you can
# - split the same model and batch three ways over two nodes (data, tensor and pipeline parallel) and predict what
#   each costs in memory, time and communication;
# - draw the pipeline's 1F1B schedule and its bubble;
# - follow a job through its per-node logs and the monitor (`get_result.sh` in
#   [FASOP's Megatron-LM scripts](https://github.com/AvatarHwang/FASOP)), and check that what each node says about its
#   layout matches the spec;
# - find the communication of each parallel group (tp, pp, dp) in the profiler;
# - tell why a job failed from its logs, with a job that fails on purpose;
# - pick runs and views in the run dashboard.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of each node ("A100-80GB" on a cluster)
nodes = 2                # one GPU (process) per node: every layout below uses 2 ranks
iterations = 6
log_interval = 1
bad_data_path = "/nonexistent/corpus_text_document"  # the deliberately failing job trains on this

# %%
from labkit.diagrams import pipeline_schedule, show
from labkit.estimate import bubble_fraction, estimate
from labkit.estimate.compare import compare
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.report import format_report, report, widget
from labkit.jobs.sweep import Sweep, profiled
from labkit.messages import say
from labkit.paths import example, runs_dir
from labkit.jobs import dashboard
from labkit.logs.views import comparison_table, timer_breakdown_figure
from labkit.plan.views import schedule_figure
from labkit.profiling import trace
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 7.1 One model, three layouts
#
# Two ranks, one per node, and a global batch of 8 at micro-batch 2:
# - **dp2** (data parallel): each rank holds the whole model and half the batch; gradients are all-reduced;
# - **tp2** (tensor parallel): each rank holds half of every weight matrix; activations are all-reduced inside
#   every layer, twice forward and twice backward;
# - **pp2** (pipeline parallel): each rank holds one of the two layers (plus the embedding or the output);
#   activations go forward and gradients backward between the stages, micro-batch by micro-batch.
#
# Before the estimate, your guesses: which layout keeps the fewest weight bytes per rank, and which runs fastest
# here?

# %% tags=["prediction"]
my_prediction = {
    "fewest weights per rank": ...,  # "dp2", "tp2" or "pp2"
    "fastest here": ...,
}

# %%
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": log_interval,
    "cluster": {"nodes": [{"gpu": gpu, "count": nodes, "gpus_per_node": 1}]}})
layouts = {"dp2": {}, "tp2": {"parallel.tensor": 2}, "pp2": {"parallel.pipeline": 2}}
specs = {name: base.replace(**changes) for name, changes in layouts.items()}
compare(specs)[["tp", "pp", "dp", "num_micro_batches", "iteration_ms", "weights_mib", "activations_mib",
                "total_mib"]].round(3)

# %% [markdown]
# Tensor and pipeline parallelism halve the weights each rank holds; data parallelism halves nothing but the batch.
# Which one communicates most often? Predict before 7.5.
#
# ## 7.2 The pipeline schedule
#
# With 2 stages and 4 micro-batches per iteration, 1F1B: stage 0 runs its forwards until stage 1 can start, then
# each stage alternates one forward and one backward. The idle ramps at both ends are the bubble: $p - 1$
# micro-batches' worth of forward and backward on each stage, for $p$ stages and $m$ micro-batches. Narayanan et al.
# (SC21, arXiv:2104.04473, section 2.2.1) write it as $(p - 1) / m$, the bubble's time over the ideal (bubble-free)
# time; as a share of the whole iteration, bubble included, it is $(p - 1) / (m + p - 1)$, what is printed below.
# For $m \gg p$ the two agree.

# %%
pp = specs["pp2"]
est = estimate(pp)
schedule_figure(est.pipeline, title=f"pp2: 1F1B over {pp.num_micro_batches} micro-batches (as estimated)").show()
print(say("lab07.bubble", share=bubble_fraction(pipeline_schedule(pp.parallel.pipeline, pp.num_micro_batches))))

# %% [markdown]
# More micro-batches shrink the bubble; the interleaved schedule (several model chunks per stage, Megatron's virtual
# stages: `parallel.virtual_stages`) shrinks it further, at the price of more messages:

# %%
show("pipeline_schedules")

# %% [markdown]
# ## 7.3 Submit the three, and one that will fail
#
# The three layouts train together, each profiled on its first rank for one iteration. A fourth job points at a data
# path that does not exist: a mistake worth recognising from the logs alone.

# %%
jobs = backend_named(backend)
sweep = Sweep.submit(jobs, {name: profiled(spec, max(1, iterations - 1)) for name, spec in specs.items()},
                     prefix="lab07")
broken = jobs.submit(base.replace(name="lab07-bad-data", data={"mock": False, "path": bad_data_path},
                                  cluster={"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]}))
sweep.jobs["pp2"]

# %% [markdown]
# The monitor (like FASOP's `get_result.sh`): each node's last lines, the job information each node printed checked
# against the spec, and the iteration times so far. It refreshes until the job ends.

# %% tags=["nbval-ignore-output", "widgets"]
widget(sweep.jobs["pp2"])

# %%
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# ## 7.4 Per-node logs
#
# Every node writes `LOGDIR/JOBID/NODE.out`, `.err` and `.gpu` (GPU samples, where `nvidia-smi` exists):

# %%
for node, files in sweep.jobs["pp2"].node_logs().items():
    print(f"{node}: {', '.join(sorted(path.name for path in files.values()))}")

# %% [markdown]
# The monitor's report of the finished pipeline run: each node's last lines (node 1 holds the last stage, whose
# timers close the log), what each node said about its layout against the spec, and the iteration times.

# %%
print(format_report(report(sweep.jobs["pp2"], lines=3), color=False))

# %% [markdown]
# ## 7.5 The layouts side by side, measured
#
# Here every "node" shares this machine's cores with the other runs, so times say less than they would on a
# cluster; the memory and the communication pattern are the layouts' own.

# %%
comparison_table(sweep.logs, baseline="dp2", specs=sweep.specs)[
    ["iteration_ms", "speedup", "num_micro_batches", "max_allocated_mb"]]

# %% [markdown]
# Your guesses beside the estimate and the measurement (the log's memory line on a CPU is the whole process, so the
# weights per rank come from the estimate alone):

# %%
estimated, measured = compare(specs), comparison_table(sweep.logs, specs=sweep.specs)
prediction_table(my_prediction, estimated={
    "fewest weights per rank": " or ".join(estimated.index[estimated["weights_mib"] == estimated["weights_mib"].min()]),
    "fastest here": estimated["iteration_ms"].idxmin()}, measured={"fastest here": measured["iteration_ms"].idxmin()})

# %%
timer_breakdown_figure(sweep.logs).show()

# %% [markdown]
# ## 7.6 Communication per parallel group
#
# The profiler names each collective's group from the Megatron code that called it. Every layout runs megatron-core's
# whole code path, so a group of one rank shows its calls too (they return at once). In the one profiled iteration,
# with $m$ micro-batches per rank and $L$ layers:
# - `dp`: the gradient all-reduce, once per iteration: DDP keeps the tiny model's gradients in one bucket and
#   all-reduces it in one call after the last micro-batch's backward (`finish_grad_sync`). dp2's other two `dp` calls
#   are one number each that labkit's driver all-reduces for its log: the loss averaged over the data-parallel ranks,
#   and whether any rank's loss is NaN. The trace records no group for those two, and labkit names it from the layout:
#   `dp` in dp2, `tp` in tp2.
# - `tp`: megatron-core's vocab-parallel cross entropy all-reduces three numbers per token over the tensor group in
#   every micro-batch (the largest logit, the target's logit, the sum of exponentials): dp2's $3m = 6$ `tp` calls,
#   over a tensor group of one rank. tp2 adds its layers': in each micro-batch's forward one all-reduce per
#   row-parallel linear (attention's output projection and the MLP's second linear, 2 per layer) and one for the
#   embedding; in its backward one per column-parallel linear (QKV and the MLP's first linear) and one for the output
#   layer. That is $(4L + 2 + 3)m + 2 = 54$ calls at $L = 2$, $m = 4$, the 2 being the log's two numbers.
# - `model`: the gradient norm for clipping (`--clip-grad`): the squared norm all-reduced over the model-parallel
#   group (the tensor x pipeline ranks; one rank in dp2) before the step.
# - `pp` and `embedding` (pp2): the sends and receives between the stages, and the tied embedding's gradient
#   all-reduced between the first and the last stage.
# - `world`: Megatron's timers gathering every rank's times to print their (min, max), once per logged iteration. On
#   this machine it is often the biggest line, as the call waits there for the slowest rank to arrive; the waiting is
#   not communication, and it is no parallel group's traffic.

# %%
groups = {}
for name, spec in sweep.specs.items():
    groups[name] = trace.communication_by_group(sweep.traces(name), tensor=spec.parallel.tensor,
                                                pipeline=spec.parallel.pipeline)
    print(f"{name}:\n{groups[name].round(3).to_string(index=False)}\n")
tp_row = groups["tp2"].set_index("group").loc["tp"]
print(say("lab07.tp_all_reduce", ms=tp_row["time_ms"] / tp_row["calls"]))

# %% tags=["check-claim"]
assert {"dp", "world"} <= set(groups["dp2"]["group"]) and "tp" in set(groups["tp2"]["group"]), groups
assert "pp" in set(groups["pp2"]["group"]), groups["pp2"]
calls = {name: dict(zip(table["group"], table["calls"])) for name, table in groups.items()}  # rank 0's
layers, m = base.model.num_layers, sweep.specs["tp2"].num_micro_batches
assert calls["dp2"]["dp"] == 3 and calls["dp2"]["tp"] == 3 * sweep.specs["dp2"].num_micro_batches, calls
assert calls["tp2"]["tp"] == (4 * layers + 2 + 3) * m + 2, calls

# %%
tp2 = sweep.specs["tp2"]
profile_views.communication_group_figure(sweep.traces("tp2"), tensor=tp2.parallel.tensor).show()

# %% [markdown]
# tp2 usually runs slowest here, though the estimate puts it within about a millisecond of dp2. Its ranks meet in
# every all-reduce above, inside the forward and the backward, where the next operation needs the sum: dp2's meet a
# handful of times, after the backward. The estimate prices each of tp2's all-reduces as two gloo processes alone on
# the cores measured it (the `cpu` entry of `labkit/data/gpus.yaml`: `message_latency_s` 0.1 ms and
# `intra_node_gbps` 11, about 0.1 ms for a layer's activations); here three runs' six ranks share this machine's
# cores, and a rank that reaches an all-reduce waits until its partner is scheduled again, a millisecond or more each
# time (the line printed above). On GPUs with NVLink such an all-reduce takes microseconds, and tensor parallelism
# within a node costs little.

# %% [markdown]
# ## 7.7 Why did it fail?
#
# The monitor reads a failed job's logs for the usual causes (out of memory, NaN loss, NCCL/gloo errors, time limit,
# cancellation, a bad data path, a node failure) and names the line that shows it.

# %%
state = broken.wait(progress=False)
print(f"{broken.record.run_id}: {state}")
print(say("lab07.cause", cause=broken.cause()))

# %%
print(format_report(report(broken, lines=3), color=False))

# %% [markdown]
# ## 7.8 The run dashboard (optional)
#
# Every run above is in the run index (`labkit runs` lists it too). The dashboard picks runs and a view (loss,
# iteration time, timers, memory per rank, the per-rank timeline, the comparison table), and refreshes while a
# chosen run is still running. Its views are plain functions, here the comparison of this lab's three layouts:

# %%
chosen = [job.record.run_id for job in sweep.jobs.values()]
dashboard.view("comparison table", *dashboard.load_runs(chosen, runs_dir()))[
    ["iteration_ms", "num_micro_batches", "max_allocated_mb"]]

# %% tags=["nbval-ignore-output", "widgets"]
board = dashboard.Dashboard(root=runs_dir()).show()
board.runs.value = tuple(chosen)

# %% [markdown]
# ## 7.9 Tensor and pipeline parallelism from scratch (homework)
#
# Two ideas behind the layouts above, each in about ten lines, run as two processes on this machine's gloo (as the
# driver's ranks do), and each checked against megatron-core doing the same in the same processes.
#
# **Column- then row-parallel linear** (Megatron's MLP, Shoeybi et al. arXiv:1909.08053): the first weight is split
# by its output rows, so each rank computes its own slice of the hidden activations with no communication; the
# second is split by its input columns to match, so each rank computes a partial output, and one all-reduce sums
# them. One all-reduce per forward, whatever the width.

# %%
import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist


def mlp_from_scratch(rank, world, x, w1, w2):
    w1_mine = w1.chunk(world, dim=0)[rank]  # column-parallel: my share of the hidden units
    w2_mine = w2.chunk(world, dim=1)[rank]  # row-parallel: the same share of the inputs
    hidden_mine = x @ w1_mine.t()           # no communication
    partial = hidden_mine @ w2_mine.t()     # my hidden units' contribution to every output
    dist.all_reduce(partial)                # the one all-reduce: the sum over ranks
    return partial, (w1_mine, w2_mine)


# %% [markdown]
# **1F1B** (Narayanan et al. SC21, arXiv:2104.04473): stage $i$ of $p$ runs $p - i - 1$ forwards to fill the pipeline,
# then alternates one forward and one backward, then drains the backwards it still owes.


# %%
def one_f_one_b(stage, stages, micro_batches):
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(micro_batches - warmup, micro_batches)]


print(one_f_one_b(0, 2, 4))


# %% [markdown]
# The check: two processes join one gloo group. Each runs the MLP from scratch, then megatron-core's
# `ColumnParallelLinear` and `RowParallelLinear` holding the same shards; then megatron-core's 1F1B schedule over
# two pipeline stages, noting each forward as it starts and each backward as it passes through the stage.

# %%
def check_against_megatron(rank, world, store, micro_batches, results):
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as labkit's tensor-parallel jobs set it (megatron-core asks)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from labkit.train import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)  # every rank draws the same full weights and input
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    mine, (w1_mine, w2_mine) = mlp_from_scratch(rank, world, x, w1, w2)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the random stream megatron-core initialises shards from
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=world, tensor_model_parallel_size=world,
                               cuda_graph_scope=[])
    column = tensor_parallel.ColumnParallelLinear(8, 16, config=config, init_method=lambda w: None, bias=False,
                                                  gather_output=False)
    row = tensor_parallel.RowParallelLinear(16, 8, config=config, init_method=lambda w: None, bias=False,
                                            input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        column.weight.copy_(w1_mine)
        row.weight.copy_(w2_mine)
    megatron, _ = row(column(x)[0])
    tensor_ok = torch.allclose(mine, megatron) and torch.allclose(mine, x @ w1.t() @ w2.t(), atol=1e-5)

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    order = []

    class NoteBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, k):
            ctx.k = k
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            order.append(("B", ctx.k))
            return grad, None

    class Stage(torch.nn.Linear):  # what megatron-core's schedule asks of a model chunk
        model_type = ModelType.encoder_or_decoder
        config = TransformerConfig(num_layers=world, hidden_size=4, num_attention_heads=1, cuda_graph_scope=[],
                                   pipeline_model_parallel_size=world, pipeline_dtype=torch.float32)

        def set_input_tensor(self, tensor):  # the activations the previous stage sent
            self.received = tensor[0] if isinstance(tensor, list) else tensor

    stage, started = Stage(4, 4), iter(range(micro_batches))

    def forward_step(data_iterator, model):
        k = next(started)
        order.append(("F", k))
        out = model(torch.randn(1, 1, 4) if rank == 0 else model.received)
        return NoteBackward.apply(out, k), lambda out: (out.square().mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[stage],
                                num_microbatches=micro_batches, seq_length=1, micro_batch_size=1, forward_only=False)
    results.put((rank, tensor_ok, order))
    dist.destroy_process_group()


fork = multiprocessing.get_context("fork")  # the ranks start as copies of this notebook's process
results, store = fork.Queue(), tempfile.mkdtemp() + "/group"
ranks = [fork.Process(target=check_against_megatron, args=(rank, 2, store, 4, results)) for rank in range(2)]
for process in ranks:
    process.start()
checked = {rank: (tensor_ok, order) for rank, tensor_ok, order in (results.get(timeout=120) for _ in ranks)}
for process in ranks:
    process.join()
for rank, (tensor_ok, order) in sorted(checked.items()):
    assert tensor_ok and order == one_f_one_b(rank, 2, 4), (rank, order)
    print(say("lab07.rank_checked", rank=rank, order=order))

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** On 2 nodes of 4 GPUs with tensor parallel 2 and pipeline parallel 2, what is the data-parallel
# size?

# %%
answer_1 = ...

# %%
eight = base.replace(**{"parallel.tensor": 2, "parallel.pipeline": 2,
                        "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 4}]}})
check("07.1", answer_1, spec=eight)

# %% [markdown]
# **Exercise 2 (homework).** Which parallel group carries the gradient all-reduce at the end of every iteration? Answer `"tp"`,
# `"pp"` or `"dp"`.

# %%
answer_2 = ...

# %%
check("07.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** What share of an iteration is the 1F1B bubble with 8 pipeline stages and 16 micro-batches? (A
# fraction between 0 and 1 of the whole iteration, not SC21's bubble-over-ideal ratio; the diagram above drew 4
# stages and 8 micro-batches.)

# %%
answer_3 = ...

# %%
check("07.3", answer_3)
