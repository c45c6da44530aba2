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
# # Lab 09: Data parallelism and ZeRO: who holds which bytes of the model state
#
# **Objectives.** By the end of this lab you can
# - say what each ZeRO stage shards over the data-parallel ranks (Rajbhandari et al.,
#   [arXiv:1910.02054](https://arxiv.org/abs/1910.02054)): stage 1 the optimizer state, stage 2 the gradients too,
#   stage 3 the parameters too; and predict the bytes per rank at each;
# - build data parallelism's gradient all-reduce, and ZeRO-1's reduce-scatter, sharded update and all-gather, from
#   scratch in two gloo processes, and show that both take the same step as one process on the whole batch;
# - run a tiny GPT at stages 0-3 (`optimizer.zero_stage`) and check that the losses agree and that each rank holds
#   what the estimate says;
# - tell what sequence parallelism (Korthikanti et al., [arXiv:2205.05198](https://arxiv.org/abs/2205.05198)) saves
#   at tensor parallel 2, and why this machine cannot show it.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of each rank ("A100-80GB" on a cluster)
data_parallel = 2        # ranks, one per GPU (process)
iterations = 3

# %%
import multiprocessing
import warnings

import pandas as pd
import torch
import torch.distributed as dist

from labkit.answer_key import check
from labkit.estimate.memory import activation_bytes_per_layer, bytes_per_param, model_state_bytes
from labkit.estimate.params import Shape
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep
from labkit.logs.losses import loss_table
from labkit.messages import say
from labkit.net import free_port
from labkit.paths import example
from labkit.spec import load_spec
from labkit.train.model_state import measure_model_state

# %% [markdown]
# ## 9.1 Predict: the model state per rank
#
# Plain data parallelism keeps a whole copy of the model state on every rank: the weights, their gradients and the
# optimizer's state (Adam's two moments; in 16-bit training also fp32 master weights). ZeRO splits it over the $N_d$
# data-parallel ranks, one more piece at each stage. Its accounting, the one lab 02 uses: $2 + 2 + K$ bytes per
# parameter, 16-bit weights and gradients and $K = 12$ bytes of mixed-precision Adam state (fp32 master weights and
# two moments), so $16$ replicated, $2 + 2 + 12/N_d$ at stage 1, $2 + 14/N_d$ at stage 2 and $16/N_d$ at stage 3.
#
# A spec asks for a stage with `optimizer.zero_stage`; labkit's driver runs each as follows:
#
# | stage | runs as | held on each rank between steps |
# |---|---|---|
# | 0 | megatron-core's `DistributedDataParallel` | everything |
# | 1 | megatron-core's distributed optimizer (`--use-distributed-optimizer`) | whole weights and gradients, $1/N_d$ of the optimizer state |
# | 2 | PyTorch FSDP2 through megatron-core, no unit resharded after its forward or backward (`reshard_after_forward=False`, `set_reshard_after_backward(False)`), the updated shards all-gathered after each step | whole weights, $1/N_d$ of the gradients and optimizer state |
# | 3 | PyTorch FSDP2, each unit resharded after its forward and backward | $1/N_d$ of everything |
#
# (Megatron-LM's own `pretrain_gpt.py`, `job.entrypoint: megatron-lm`, runs stages 2 and 3 as Megatron-FSDP instead.)
#
# The runs below: the `tiny` GPT (its embeddings untied, which FSDP2 needs), fp32 with Adam (4 bytes of weight,
# 4 of gradient, 8 of moments per parameter), on 2 data-parallel ranks, without dropout so that every stage sees the
# same numbers.

# %%
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": 1, "precision": "fp32",
    "model.untie_embeddings": True, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": data_parallel}]}})
stages = {f"zero{stage}": base.replace(**{"optimizer.zero_stage": stage}) for stage in range(4)}
params = model_state_bytes(Shape.of(base.model), [base.model.num_layers], precision="fp32").weights // 4
print(say("lab09.parameters", params=params, data_parallel=base.data_parallel))

# %% [markdown]
# Your guesses first: the bytes of weights + gradients + optimizer state one rank holds at each stage.

# %% tags=["prediction"]
my_prediction = {
    "zero0 bytes per rank": ...,  # a number of bytes
    "zero1 bytes per rank": ...,
    "zero2 bytes per rank": ...,
    "zero3 bytes per rank": ...,
}

# %% [markdown]
# The idea (`bytes_per_param`, ZeRO's accounting) and the bytes of what the driver runs (`model_state_bytes`, which
# the estimator uses): megatron-core's buffers at stages 0 and 1, with the padding the distributed optimizer aligns
# its buckets with (none at this size); FSDP2's shards at stages 2 and 3, each parameter's rows split over the ranks,
# and at stage 2 the whole weights it keeps gathered beside them. The column below leaves out what exists only while
# a layer computes (stage 3's gathered layers, the unsharded gradients), as it is not held between steps.

# %%
def held_estimate(spec):
    state = model_state_bytes(Shape.of(spec.model), [spec.model.num_layers], data_parallel=spec.data_parallel,
                              precision="fp32", zero_stage=spec.optimizer.zero_stage)
    return (state.weights - state.weights_working, state.gradients - state.gradients_working, state.optimizer)


estimated = pd.DataFrame({name: {
    "bytes per parameter (ZeRO)": sum(bytes_per_param("fp32", spec.data_parallel,
                                                      zero_stage=spec.optimizer.zero_stage)),
    "ZeRO's idea": params * sum(bytes_per_param("fp32", spec.data_parallel, zero_stage=spec.optimizer.zero_stage)),
    "estimate": sum(held_estimate(spec))} for name, spec in stages.items()}).T
estimated

# %% [markdown]
# ## 9.2 Data parallelism and ZeRO-1 from scratch
#
# Each of two ranks computes the gradient of its half of the batch. **Data parallelism** all-reduces the gradients
# (and averages them), so every rank takes the same step on its own whole copy of the weights and of the optimizer
# state. **ZeRO-1** reduce-scatters them instead: rank $r$ receives the averaged gradient of its $1/N_d$ slice only,
# updates that slice with the optimizer state it alone keeps, and an all-gather puts the updated slices back
# together. The same bytes travel (a reduce-scatter and an all-gather are an all-reduce cut in two), and each rank
# keeps half the optimizer state. Here the optimizer is SGD with momentum, on a flat vector of 8 weights.

# %%
def step_from_scratch(rank, world, sharded, weights, state, inputs, targets, lr=0.1, beta=0.9):
    """One step of SGD with momentum; `state` is the momentum this rank keeps: all of it, or (ZeRO-1) its slice."""
    xs, ys = inputs.chunk(world)[rank], targets.chunk(world)[rank]  # my share of the batch
    w = weights.clone().requires_grad_()
    torch.nn.functional.mse_loss(xs @ w, ys).backward()
    if not sharded:  # data parallelism: every rank gets the whole averaged gradient
        grad = w.grad / world
        dist.all_reduce(grad)
        state = beta * state + grad
        return weights - lr * state, state
    grad = torch.empty(len(weights) // world)
    dist.reduce_scatter_tensor(grad, w.grad / world)  # ZeRO-1: my slice of the averaged gradient
    state = beta * state + grad                        # the optimizer state of my slice only
    updated = weights.chunk(world)[rank] - lr * state
    gathered = torch.empty_like(weights)
    dist.all_gather_into_tensor(gathered, updated)     # everyone's updated slice, back to whole weights
    return gathered, state


def two_steps(rank, world, sharded):
    torch.manual_seed(0)  # every rank draws the same weights and batch
    weights, inputs, targets = torch.randn(8), torch.randn(16, 8), torch.randn(16)
    state = torch.zeros(8 // world if sharded else 8)
    for _ in range(2):  # two steps, so that the momentum counts
        weights, state = step_from_scratch(rank, world, sharded, weights, state, inputs, targets)
    return weights.tolist(), state.numel()  # plain numbers: the rank's tensors end with its process


def rank_main(rank, world, port, results):
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames these collectives; same calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results.put((rank, {"dp": two_steps(rank, world, False), "zero1": two_steps(rank, world, True)}))
    dist.destroy_process_group()


fork = multiprocessing.get_context("fork")  # the ranks start as copies of this notebook's process
results, port = fork.Queue(), free_port()
ranks = [fork.Process(target=rank_main, args=(rank, 2, port, results)) for rank in range(2)]
for process in ranks:
    process.start()
done = dict(results.get(timeout=120) for _ in ranks)
for process in ranks:
    process.join()

# %% [markdown]
# The check: one process on the whole batch (a group of one, where every collective is the identity), the same two
# steps.

# %%
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
alone, _ = two_steps(0, 1, False)
dist.destroy_process_group()
for rank, out in sorted(done.items()):
    for name, (updated, kept) in out.items():
        assert torch.allclose(torch.tensor(updated), torch.tensor(alone), atol=1e-6), (rank, name, updated, alone)
        print(say("lab09.rank_state", rank=rank, name=name, kept=kept))

# %% [markdown]
# The same idea runs in megatron-core: `DistributedDataParallel` reduce-scatters its gradient buckets when the
# distributed optimizer is on (`use_distributed_optimizer`), and the `DistributedOptimizer` steps the slice it owns
# and all-gathers the parameters. ZeRO-2 also frees the gradients of the slices it does not own; ZeRO-3 gathers
# every layer's parameters just before its forward and its backward, and frees them after.
#
# ## 9.3 Stages 0-3 on labkit's driver
#
# The four stages train together. While they run, `measure_model_state` builds the driver's model and optimizer for
# each stage in two more gloo processes, takes one optimizer step and counts the bytes each rank holds.

# %%
sweep = Sweep.submit(backend_named(backend), stages, prefix="lab09")
held = dict(zip(stages, measure_model_state(stages.values())))  # [rank] -> (weights, gradients, optimizer)
states = sweep.wait()
print({name: str(state) for name, state in states.items()})

# %% [markdown]
# Sharding changes where the model state lives, not the arithmetic: on the same data the losses agree to fp32
# rounding (the reductions add in another order).

# %%
losses = loss_table({name: sweep.logs[name] for name in stages})
losses

# %% tags=["check-claim"]
assert len(losses) == iterations and (losses["spread"] / losses["zero0"]).max() < 1e-4, losses

# %% [markdown]
# Each rank's bytes, measured, beside the estimate (both ranks hold the same here; the table shows the fuller):

# %%
memory = pd.DataFrame({name: dict(zip(("weights", "gradients", "optimizer"), max(ranks, key=sum)))
                       for name, ranks in held.items()}).T
memory["measured"] = memory.sum(axis=1)
memory["estimate"] = estimated["estimate"]
memory["ZeRO's idea"] = estimated["ZeRO's idea"]
memory

# %% tags=["check-claim"]
for name in stages:  # exact: megatron-core's buffers, and FSDP2's shards padded to whole rows
    assert abs(memory.loc[name, "measured"] / memory.loc[name, "estimate"] - 1) < 0.02, memory
# stage 2 holds the whole weights that stage 3 shards; the gradients and the optimizer state alike
assert memory.loc["zero2", "weights"] - memory.loc["zero3", "weights"] == 4 * params, memory
assert (memory.loc["zero2", ["gradients", "optimizer"]] == memory.loc["zero3", ["gradients", "optimizer"]]).all()
print(say("lab09.state_bytes", stage="zero2", measured=memory.loc["zero2", "measured"],
          estimated=memory.loc["zero2", "estimate"]))
print(say("lab09.state_bytes", stage="zero3", measured=memory.loc["zero3", "measured"],
          estimated=memory.loc["zero3", "estimate"]))

# %% [markdown]
# Stage 1 halves the optimizer state, stage 2 the gradients too, stage 3 everything. Stage 2 holds more than ZeRO's
# idea by the $4P/N_d$ bytes of FSDP2's own shard of the weights: the optimizer steps that shard, and the driver then
# gathers the whole weights from everyone's; in mixed precision that fp32 shard is the master copy ZeRO counts in $K$,
# in fp32 it is a second copy. So at 2 ranks in fp32 stage 2 holds what stage 1 holds: it saves half the gradients,
# $2P$ bytes, and spends as much on that shard; with more ranks, or in mixed precision, it holds less. Your guesses
# beside the estimate and the measurement of the same stage:

# %%
prediction_table(my_prediction,
                 estimated={f"{name} bytes per rank": int(memory.loc[name, "estimate"]) for name in stages},
                 measured={f"{name} bytes per rank": int(memory.loc[name, "measured"]) for name in stages})

# %% [markdown]
# ## 9.4 Sequence parallelism (optional)
#
# Tensor parallelism splits the attention and the MLP over $t$ ranks, but the layer norms and dropouts between them
# run on the whole activation on every rank. Sequence parallelism (Korthikanti et al., arXiv:2205.05198) splits those
# along the sequence instead, turning each all-reduce into a reduce-scatter and an all-gather: the same traffic, and
# every activation divided by $t$. Their Table 2, bytes per layer for sequence $s$, micro-batch $b$, hidden $h$, $a$
# heads, 16-bit: $sbh(10 + 24/t + 5as/(ht))$ without, $sbh(34 + 5as/h)/t$ with.
#
# This machine cannot show it: megatron-core's sequence parallelism needs Transformer Engine's layers on GPUs (labkit
# refuses `parallel.sequence_parallel` for a CPU run), and the driver's memory line on a CPU is the whole process's
# peak, libraries included, beside which the tiny model's activations are lost. So the estimate alone, for the tiny
# GPT at tensor parallel 2 on GPUs in bf16, and for GPT-3 175B at tensor parallel 8, one of the paper's models, where
# it decides whether a model fits:

# %%
gpt3 = load_spec({"model": {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
                            "vocab_size": 51200}})
rows = {}
for name, (spec, tensor) in {"tiny, tp 2": (base, 2), "GPT-3 175B, tp 8": (gpt3, 8)}.items():
    per_layer = {on: activation_bytes_per_layer(Shape.of(spec.model), 1, tensor=tensor, sequence_parallel=on)
                 for on in (False, True)}
    rows[name] = {"sp off (MiB per layer)": per_layer[False] / 2 ** 20,
                  "sp on (MiB per layer)": per_layer[True] / 2 ** 20, "saved": 1 - per_layer[True] / per_layer[False]}
pd.DataFrame(rows).T.round(3)

# %% [markdown]
# Sequence parallelism splits the $10\,sbh$ that tensor parallelism leaves whole on every rank: at tensor parallel 2
# that is a small part of a layer, at 8 a large one. It adds no traffic, so on GPUs there is little reason to leave it
# off where tensor parallelism runs; labkit's planner searches it (`parallel.sequence_parallel`).

# ## Exercises
#
# **Exercise 1.** ZeRO's accounting for mixed-precision Adam is 2 + 2 + 12 = 16 bytes per parameter. How many bytes
# per parameter does each GPU hold at stage 3 with 64 data-parallel GPUs?

# %%
answer_1 = ...

# %%
check("09.1", answer_1)

# %% [markdown]
# **Exercise 2 (homework).** ZeRO's Figure 1 model: 7.5 billion parameters, mixed-precision Adam, 64 data-parallel GPUs. How many
# GB ($10^9$ bytes) of model state does each GPU hold at stage 2?

# %%
answer_2 = ...

# %%
check("09.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** For GPT-3 175B at tensor parallel 8 ($s = 2048$, $b = 1$, $h = 12288$, $a = 96$), by what factor
# does sequence parallelism shrink a layer's activations (Table 2, without over with)?

# %%
answer_3 = ...

# %%
check("09.3", answer_3)

# %% [markdown]
# **Exercise 4 (homework).** Megatron's precision-aware optimizer (`optimizer.precision_aware`, Transformer Engine's
# FusedAdam) keeps bf16 training's fp32 master weights as the 16 bits bf16 lacks (2 bytes a parameter) and can store
# Adam's two moments in bf16. With bf16 moments, fp32 gradients and the distributed optimizer over 8 data-parallel
# GPUs, how many bytes per parameter does each GPU hold?

# %%
answer_4 = ...

# %%
check("09.4", answer_4)
