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
# # Lab 04: Gradient accumulation: a bigger global batch at the same micro-batch
#
# **Objectives.** By the end of this lab you can
# - say how Megatron turns a global batch into micro-batches: global = micro x data parallel x micro-batches, and
#   read the count back from the log (`setting number of micro-batches to constant N`);
# - predict, then measure, what accumulating more micro-batches costs: time per iteration grows, samples per second
#   grows a little (the optimizer step is shared), memory stays at one micro-batch's;
# - show that accumulation computes the same step: a global batch of 8 as 4 micro-batches of 2 gives the same loss
#   as one micro-batch of 8, in fp32.
#
# This is section 4.3 of the NVIDIA DLI workshop *Model Parallelism: Building and Deploying Large Neural Networks*:
# keep `MICRO_BATCH_SIZE` and raise `GLOBAL_BATCH_SIZE`.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of the one-GPU runs below ("A100-80GB" on a cluster)
iterations = 10
log_interval = 1
micro_batch = 2
global_batches = [2, 8, 16]   # at micro_batch: 1, 4 and 8 micro-batches per iteration
large_micro_batch = 8         # one micro-batch holding the same samples as global_batches[1]

# %%
from labkit.estimate.compare import compare
from labkit.answer_key import check
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import NO_DROPOUT, Sweep, profiled, with_flags
from labkit.messages import say
from labkit.paths import example, shipped_corpus
from labkit.logs.losses import loss_table
from labkit.logs.views import comparison_table, iteration_time_figure, loss_figure
from labkit.profiling import views as profile_views
from labkit.spec import load_spec

# %% [markdown]
# ## 4.1 From a global batch to micro-batches
#
# Each data-parallel rank runs forward and backward on `global / (micro x data parallel)` micro-batches, adding their
# gradients, then all ranks reduce the sum and take one optimizer step. To see accumulation alone, the runs here use
# one GPU (data parallel 1), in fp32 and without dropout (so that the same samples give the same numbers).

# %%
base = with_flags(load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": log_interval, "precision": "fp32", "batch.micro": micro_batch,
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]}}, data=shipped_corpus()), *NO_DROPOUT)
specs = {f"micro {micro_batch} x {global_batch // micro_batch}": base.replace(**{"batch.global": global_batch})
         for global_batch in global_batches}
equivalent = f"micro {micro_batch} x {global_batches[1] // micro_batch}"
specs[f"micro {large_micro_batch} x 1"] = base.replace(
    **{"batch.micro": large_micro_batch, "batch.global": global_batches[1]})
for name, spec in specs.items():
    print(say("lab04.batch_layout", name=name, global_batch=spec.batch.global_, micro=spec.batch.micro,
              data_parallel=spec.data_parallel, micro_batches=spec.num_micro_batches))

# %% [markdown]
# ## 4.2 Predict
#
# Your guesses first, before the estimate: how many times longer is an iteration of the most micro-batches than one
# of a single micro-batch, and which of the two runs that see the same samples per iteration (several small
# micro-batches, or one large one) processes more samples per second *on this machine*?

# %% tags=["prediction"]
my_prediction = {
    "time, most micro-batches / one": ...,  # a number, e.g. 3.5
    "more samples per second here": ...,    # one of the run names printed above
}

# %% [markdown]
# The estimate: time grows with the number of micro-batches, samples per second grows a little (one optimizer step
# for more samples), and activation memory does not grow at all: each micro-batch's activations are freed by its
# backward pass before the next one starts. Only the one large micro-batch needs more.

# %%
compare(specs)[["global_batch", "micro_batch", "num_micro_batches", "iteration_ms", "samples_per_s",
                "activations_mib", "total_mib"]].round(3)

# %% [markdown]
# ## 4.3 Run them
#
# One after another: runs that share this machine's cores slow each other by whatever the others happen to be doing
# at that moment, more than accumulation's own cost, and a time per iteration would then measure the neighbours. The
# two that see the same 8 samples per iteration are profiled for one iteration, to look at their memory.

# %%
profile_at = max(1, iterations - 1)
to_profile = (equivalent, f"micro {large_micro_batch} x 1")
jobs = backend_named(backend)
submitted = {}
for name, spec in specs.items():
    one = Sweep.submit(jobs, {name: profiled(spec, profile_at) if name in to_profile else spec}, prefix="lab04")
    print(f"{name}: {one.wait()[name]}")
    submitted.update(one.jobs)
sweep = Sweep(submitted)

# %% [markdown]
# ## 4.4 Micro-batch count and throughput
#
# `num_micro_batches` is what each run's log says (`setting number of micro-batches to constant N`, the line the
# workshop greps for).

# %%
comparison_table(sweep.logs, specs=sweep.specs)[
    ["global_batch_size", "num_micro_batches", "iteration_ms", "samples_per_s", "speedup"]]

# %% [markdown]
# Your guesses beside the estimate and the measurement:

# %%
fewest, most = (f"micro {micro_batch} x {g // micro_batch}" for g in (global_batches[0], global_batches[-1]))
estimated, measured = compare(specs), comparison_table(sweep.logs, specs=sweep.specs)
pair = [equivalent, f"micro {large_micro_batch} x 1"]
prediction_table(my_prediction, estimated={
    "time, most micro-batches / one": estimated.loc[most, "iteration_ms"] / estimated.loc[fewest, "iteration_ms"],
    "more samples per second here": max(pair, key=lambda name: estimated.loc[name, "samples_per_s"])}, measured={
    "time, most micro-batches / one": measured.loc[most, "iteration_ms"] / measured.loc[fewest, "iteration_ms"],
    "more samples per second here": max(pair, key=lambda name: measured.loc[name, "samples_per_s"])})

# %%
iteration_time_figure(sweep.logs).show()

# %% [markdown]
# In the estimate the time per iteration grows nearly in proportion to the micro-batches, and samples per second grow:
# the optimizer step and the other per-iteration costs are shared by more samples (the prediction in 4.2). On a shared
# CPU the measured growth moves with the machine's load from run to run (the table above is this run's), so this lab
# does not hold it to a number; on a cluster each run has its own GPUs and follows the estimate.
#
# On a GPU one micro-batch of 8 is faster than four of 2: larger matrices keep the tensor cores busier. On a CPU the
# order of the two moves with the machine: every operator's fixed cost per call is paid once instead of four times,
# which favours the micro-batch of 8, but it no longer fits the caches as well, and on a shared machine the load of
# the moment outweighs both (the table above is this run's; quiet runs here have had either one ahead). That is a
# property of the hardware, not of accumulation: compare on the GPU you will train on.

# %% [markdown]
# ## 4.5 Memory: one micro-batch at a time
#
# The workshop's memory trace showed four rises and falls per step with four accumulated micro-batches. The same in the
# profiled iteration: four small peaks for `micro 2 x 4`, one four times as tall for `micro 8 x 1`.

# %%
traces = {name: sweep.traces(name)[0] for name in to_profile}
profile_views.memory_figure(traces).show()

# %%
profile_views.comparison_table(traces)[["run", "step_ms", "peak_growth_mb", "saved_mb"]].round(3)

# %% [markdown]
# ## 4.6 The same step, computed two ways
#
# With the same seed, the same samples and no dropout, 4 micro-batches of 2 and 1 micro-batch of 8 compute the same
# gradient (Megatron averages the loss over micro-batches), so the same weights and the same loss at every
# iteration; only the order of floating-point additions differs.

# %%
losses = loss_table({name: sweep.logs[name] for name in to_profile})
losses

# %% tags=["check-claim"]
assert losses["spread"].max() < 1e-3, losses  # the same step, up to the order of additions

# %%
print(say("lab04.loss_spread", iterations=len(losses), spread=losses["spread"].max()))
loss_figure({name: sweep.logs[name] for name in to_profile}).show()

# %% [markdown]
# ## 4.7 Accumulation from scratch (homework)
#
# The loop behind `batch.global` / `batch.micro`, in a dozen lines: each micro-batch's loss is divided by their
# count and its gradient added to the last; with data parallelism, the all-reduce of the gradients is skipped
# (`no_sync`) for every micro-batch but the last, so a step pays for one all-reduce however many micro-batches it
# accumulates. A hook on the weight records, for each backward, whether it ran inside `no_sync`.

# %%
import contextlib

import torch

inside_no_sync, synced = [False], []


@contextlib.contextmanager
def no_sync():  # what DistributedDataParallel.no_sync does: hold the all-reduce back while inside
    inside_no_sync[0] = True
    yield
    inside_no_sync[0] = False


def accumulate(model, micro_batches):
    model.zero_grad()
    for i, (xs, ys) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync():
            loss = torch.nn.functional.mse_loss(model(xs), ys) / len(micro_batches)
            loss.backward()


# %% [markdown]
# Checked against megatron-core's own schedule for one pipeline stage (`forward_backward_no_pipelining`, what the
# driver runs at pipeline size 1), given the same `no_sync`, and against one backward over the whole batch.

# %%
import tempfile

import torch.distributed as dist
from labkit.train import cpu_compat

if not torch.cuda.is_available():
    cpu_compat.apply()
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

if not dist.is_initialized():  # a group of one process, so that megatron-core's schedule can run in this notebook
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/group", rank=0, world_size=1)
if not parallel_state.model_parallel_is_initialized():
    parallel_state.initialize_model_parallel(1, 1)


class Regression(torch.nn.Linear):  # the attributes megatron-core's schedule asks a model for
    model_type = ModelType.encoder_or_decoder
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, no_sync_func=no_sync,
                               cuda_graph_scope=[])  # no CUDA graphs (0.16's default names a deprecated scope)

    def set_input_tensor(self, tensor):  # a first pipeline stage receives no activations
        pass


torch.manual_seed(0)
model = Regression(16, 1)
model.weight.register_hook(lambda grad: synced.append(not inside_no_sync[0]))
inputs, targets = torch.randn(8, 16), torch.randn(8, 1)
micro_batches = list(zip(inputs.split(2), targets.split(2)))

accumulate(model, micro_batches)
mine, my_syncs = [p.grad.clone() for p in model.parameters()], synced[:]
synced.clear()
model.zero_grad()


def forward_step(data_iterator, model):
    xs, ys = next(data_iterator)
    return model(xs), lambda out: (torch.nn.functional.mse_loss(out, ys), {})


get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                            num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=2, forward_only=False)
megatron = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
torch.nn.functional.mse_loss(model(inputs), targets).backward()
assert all(torch.allclose(a, b) and torch.allclose(a, p.grad) for a, b, p in zip(mine, megatron, model.parameters()))
assert my_syncs == synced[:len(micro_batches)] == [False, False, False, True]
print(say("lab04.syncs", mine=my_syncs, megatron=synced[:len(micro_batches)]))

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** The workshop's run in section 4.3: 2 nodes with 2 GPUs each, data parallel only, micro-batch 4 and
# global batch 64. Build its spec from `base` (set `batch.micro`, `batch.global` and a `cluster` of 2 nodes with
# 2 `gpu`s each). How many micro-batches does each GPU accumulate?

# %%
answer_1 = ...

# %%
check("04.1", answer_1)

# %% [markdown]
# **Exercise 2 (homework).** At a global batch of 16, how many samples has a run consumed after 10 iterations (the log's
# `consumed samples`)?

# %%
answer_2 = ...

# %%
check("04.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** At a fixed micro-batch, what grows with the number of accumulated micro-batches? Answer
# `"activation memory"` or `"time per iteration"`.

# %%
answer_3 = ...

# %%
check("04.3", answer_3)
