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
# # Lab 06: Heterogeneous partitioning: plan the layout, then launch it
#
# **Objectives.** By the end of this lab you can
# - search every tensor/pipeline/data split, micro-batch, node order and uneven layer partition of a GPT on a mixed
#   A100 + A10 cluster (the problem [FASOP](https://github.com/AvatarHwang/FASOP) solves, Hwang et al., HPDC '24)
#   and read the ranked table;
# - trade time against money over cluster compositions on a Pareto chart;
# - draw the chosen layout's pipeline schedule;
# - launch a planned layout on the emulated heterogeneous cluster and compare the measured step with the estimate.

# %% tags=["parameters"]
backend = "local"           # "slurm" launches on the (local) Slurm's emulated a100 + a10 nodes
cluster = "a100-a10-hetero"  # 1 node x 4 A100-40GB + 7 nodes x 4 A10, FASOP's mixed cluster
model = "gpt2-xl"
global_batch = 64
max_nodes = 3               # the Pareto sweep: 0..max_nodes nodes of each GPU type (FASOP's chart: 8)
launch_iterations = 6

# %%
from labkit.diagrams import show
from labkit.estimate import estimate
from labkit.estimate.views import compare_measured
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.logs.derive import steady_state
from labkit.messages import say
from labkit.plan.inputs import Constraints
from labkit.plan.pareto import sweep
from labkit.plan.search import search
from labkit.plan.views import pareto_figure, ranked_table, schedule_figure
from labkit.paths import runs_dir
from labkit.spec import load_spec

# %% [markdown]
# FASOP's question first. GPT-2 XL has 48 transformer layers; put them on a pipeline of 8 stages, one per node of
# this cluster: one node of A100s, seven of A10s. Spread evenly, each stage takes 6. The A100-40GB's fp16 peak is
# 312 TFLOP/s, the A10's 125. How many layers should the A100 stage take so that no stage holds the others up?
# 6.1 answers it after the search.

# %% tags=["prediction"]
my_partition = {"layers on the A100 stage": ...}  # a number, 0 to 48

# %% [markdown]
# ## 6.1 Search
#
# The planner enumerates tensor sizes up to a node's GPUs, the pipeline and data sizes they leave, micro-batches,
# virtual stages, recompute and the distributed optimizer, and node orders up to symmetry. For each it finds the
# per-stage layer partition exactly (min-max over stages of different speeds) and prices the step with
# `labkit.estimate`: configurations that do not fit in memory are marked, not dropped.

# %%
base = load_spec({"name": f"{model}-on-{cluster}", "model": {"preset": model}, "precision": "fp16",
                  "batch": {"micro": 1, "global": global_batch}, "cluster": cluster})
plan = search(base, top=10)
print(say("lab06.search_summary", evaluated=plan.configs_evaluated, pruned=plan.configs_pruned,
          seconds=plan.search_seconds))
ranked_table(plan, top=10)

# %% [markdown]
# FASOP's Megatron-LM scripts ran `PARTITION="0-11-8-8-8-8-5-0"` (PP 8, DP 4) and measured 1.4 s per step on 32 A10s
# (1.37 to 1.42 s at iterations 20 to 50 of its log; the 10th, 4.5 s, still warming up). The rows above are
# interleaved (`vp` model chunks per stage, lab 07's virtual stages), whose partitions are even, and many differ only
# in where the A100 node sits in the pipeline.
# FASOP's question is about the plain pipeline: 8 stages, one per node, no interleaving. The same search with those
# fixed:

# %%
one_per_node = search(base, constraints=Constraints(pipeline=8, virtual_stages=1, tensor=1), top=5)
matched = one_per_node.best
a100_stage = next(i for i, gpu in enumerate(matched.placement) if gpu.startswith("A100"))
print(say("lab06.stage_times", partition="-".join(map(str, matched.partition)), placement=" ".join(matched.placement),
          times=", ".join(f"{1e3 * t:.1f}" for t in matched.stage_times_s)))
prediction_table(my_partition, estimated={"layers on the A100 stage": matched.partition[a100_stage]}, measured={})

# %% [markdown]
# The A100 stage takes more layers than any A10 stage, by its speed per layer at this micro-batch (about 1.4 times
# an A10's, well below the ratio of the peaks: one sequence at a time leaves much of an A100 idle), so that every
# stage takes about as long as the slowest.

# %% tags=["check-claim"]
assert matched.partition[a100_stage] > max(n for i, n in enumerate(matched.partition) if i != a100_stage), matched

# %% [markdown]
# **From scratch.** FASOP's partitioner is a min-max problem: choose the layers of each stage so that the slowest
# stage is as fast as it can be. With each GPU's measured forward time per layer (FASOP's profiles, shipped with
# labkit), a stage's forward and backward take its layers' time times $1 + 2$ (the backward costs about twice the
# forward), plus the embedding on the first stage and the output layer on the last. Dynamic programming over the
# stages finds the best split of the first $k$ layers for every $k$:

# %%
from labkit.estimate.profiles import find_profile


def stage_s(profile, layers, first, last):
    forward = layers * profile.layers_s[0] + (profile.embedding_s if first else 0) + (profile.output_s if last else 0)
    return forward * (1 + profile.backward_factor)


def min_max_partition(profiles, layers):
    """(the slowest stage's seconds, layers per stage) over the stages' profiles, in pipeline order."""
    last = len(profiles) - 1
    best = {k: (stage_s(profiles[0], k, True, last == 0), [k]) for k in range(layers + 1)}
    for i, profile in enumerate(profiles[1:], start=1):
        best = {k: min((max(best[k - n][0], stage_s(profile, n, False, i == last)), best[k - n][1] + [n])
                       for n in range(k + 1))
                for k in range(layers + 1)}
    return best[layers]


profiles = {gpu: find_profile(model, gpu, 1) for gpu in set(matched.placement)}
slowest_s, mine = min_max_partition([profiles[gpu] for gpu in matched.placement], matched.spec.model.num_layers)
print(say("lab06.from_scratch", mine="-".join(map(str, mine)), mine_ms=1e3 * slowest_s,
          planner="-".join(map(str, matched.partition)), planner_ms=1e3 * max(matched.stage_times_s)))
assert mine[a100_stage] == matched.partition[a100_stage]
assert abs(slowest_s - max(matched.stage_times_s)) < 0.02 * slowest_s

# %% [markdown]
# Where the two partitions differ, they tie: several splits share the same slowest stage, and the planner breaks the
# tie by the whole step's estimate (sends between stages, the bubble), which the from-scratch version leaves out.
#
# ## 6.2 Time or money: the Pareto front over cluster compositions
#
# Each composition of A100 and A10 nodes gets its best layout's time and price per step. A composition is on the
# **Pareto front** when no other one is both faster and cheaper: along the front, saving time costs money.

# %%
compositions = sweep(base, "A100-40GB", "A10", max_nodes=max_nodes)
pareto_figure(compositions).show()

# %%
compositions[compositions["pareto"]][["cluster", "estimated_s", "price_per_step", "tp", "dp", "pp", "mbs"]]

# %% [markdown]
# ## 6.3 The chosen layout's pipeline
#
# The best layout with a (non-interleaved) pipeline: each stage's forward and backward for one micro-batch, with the
# sends between stages, in 1F1B order. This is the schedule the planner timed the row with, so the last bar ends at
# the row's pipeline time. The slowest stage sets the pace, and the ramp at each end is the bubble. (The generic
# picture, 1F1B next to the interleaved schedule, is below.)

# %%
pipelined = next(r for r in plan.rows if r.pp > 1 and r.virtual_stages == 1 and not r.oom)
print(say("lab06.best_pipelined", tp=pipelined.tp, dp=pipelined.dp, pp=pipelined.pp, mbs=pipelined.mbs,
          partition="-".join(map(str, pipelined.partition)), step_s=pipelined.estimated_s,
          pipeline_s=pipelined.pipeline_s))
schedule_figure(pipelined.pipeline,
                stage_labels=[f"stage {i} ({g})" for i, g in enumerate(pipelined.spec.stage_gpus)]).show()

# %%
show("pipeline_schedules")

# %% [markdown]
# ## 6.4 Launch a planned layout and measure it
#
# A real GPT-2 XL needs real GPUs. To see the whole loop here, plan a small GPT (4 layers of width 256, 256 tokens)
# on a two-node slice of the same kind of cluster (one A100 node, one A10 node, one process each), take the best
# two-stage pipeline, and launch it: on the local Slurm's emulated a100 and a10 nodes with `backend = "slurm"`, or as
# two local processes. `Constraints` keeps what a spec fixes (here two pipeline stages) and searches the rest, as
# `labkit plan SPEC` does with the fields a spec file writes.

# %% [markdown]
# Your guess first: the two-stage pipeline of the small model below runs on this machine's CPU as two processes. How
# many seconds per iteration? The end of 6.4 sets it beside the estimate and the measurement.

# %% tags=["prediction"]
my_prediction = {"pipeline here, s per iteration": ...}  # a number

# %%
small = load_spec({"name": "planned-small", "batch": {"micro": 1, "global": 8}, "recompute": "none",
                   "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256,
                             "vocab_size": 1024},
                   "train": {"iters": launch_iterations, "log_interval": 1},
                   "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 1},
                                         {"gpu": "A10", "count": 1, "gpus_per_node": 1}]}})
small_plan = search(small, constraints=Constraints(pipeline=2, virtual_stages=1))
# A stage without transformer layers would leave its GPU idle (the table's `idle GPUs`): launch a sound layout.
row = next(r for r in small_plan.rows if r.idle_gpus == 0 and not r.oom)
spec = load_spec(row.spec.to_dict())
print(say("lab06.launching", partition=spec.partition_string, gpus=spec.stage_gpus))
job = backend_named(backend).submit(spec)
state = job.wait(progress=False)
assert str(state) == "COMPLETED", job.cause()

# %% [markdown]
# The emulated nodes train on CPU processes, so the comparison that means something here is with the estimate of the
# same layout on this machine's CPU. The catalog's CPU speed is a placeholder, so first measure it: `profile_model`
# (what `labkit profile --model SPEC` runs) times each layer of the model's forward pass here, beside a second
# process as in training, and the estimate builds the pipeline from those times. On a real cluster, compare with
# `row.estimated_s` directly.

# %%
from labkit.plan.profiler import profile_model

_, cpu_profile = profile_model(spec, micro_batch=spec.batch.micro, precision=spec.precision, repeats=8,
                               path=runs_dir() / "profiles" / "planned-small_cpu_tp1.json")
measured = steady_state(job.result().iterations).iteration_ms / 1000
on_cpu = estimate(spec.replace(cluster={"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}),
                  profiles={("cpu", 1): cpu_profile})
print(say("lab06.layer_forward", source=on_cpu.stage_sources[0], ms=1000 * cpu_profile.layers_s[0]))
compare_measured(on_cpu.iteration_time_s, measured)

# %%
prediction_table(my_prediction, estimated={"pipeline here, s per iteration": on_cpu.iteration_time_s},
                 measured={"pipeline here, s per iteration": measured})

# %% tags=["check-claim"]
assert 0.4 < on_cpu.iteration_time_s / measured < 1.5, (on_cpu.iteration_time_s, measured)

# %% [markdown]
# How close the estimate comes depends on what else the machine is doing: the layer profile and the run are timed at
# different moments, and on a machine shared with other work either can be slowed (a profile taken in a busy moment
# makes the estimate read high). On a CPU the estimate also charges what surrounds the layers, which a GPU's
# asynchronous launches would hide: 1.5 ms per model chunk and micro-batch, half in its forward and half in its
# backward, and 7.5 ms per step, on the machine where `benchmarks/bench_host_overhead.py` measured them (another CPU
# runs its host code at its own speed). With layers of 15 ms that is a small share of the step; with the `tiny`
# preset's 2 ms layers it is most of it. On a machine that other jobs shared, `benchmarks/bench_plan_closed_loop.py`
# ran 14 layouts of this model three times each, profiling again before each time, in three runs: the estimate is
# 5% to 6% off in the median and 17% at most, most layouts still reading low, and ranks the layouts roughly in the
# order they measure (Spearman's rank correlation 0.88, 0.75 and 0.61, where 1 is the same order and 0 none): the
# slowest layout takes 40% longer than the fastest, and one layout's runs differ by up to 45% on a busy machine. A
# single run on a busy machine, like the one above, can read well off.
#
# Both processes run on this one host, so they share its cores: the local backend gives each process its share
# (`OMP_NUM_THREADS` = cores / processes), as a Slurm node shares its own among its processes. Give each process every
# core instead (`spec.replace(**{"job.env": {"OMP_NUM_THREADS": str(os.cpu_count())}})`) and the threads of both
# processes fight for the same cores: the step then takes several times as long.

# %% [markdown]
# ## Exercise
#
# **Exercise 1.** In the ranked table of 6.1, how many pipeline stages does the fastest layout use?

# %%
answer_1 = ...

# %%
check("06.1", answer_1, plan=plan)
