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
# # Lab 10: Expert parallelism: mixtures of experts, their cost, and the token dispatch
#
# **Objectives.** By the end of this lab you can
# - count a mixture-of-experts (MoE) model's total and active parameters, and the FLOPs a token costs (Shazeer et
#   al. 2017; GShard, [arXiv:2006.16668](https://arxiv.org/abs/2006.16668); Mixtral,
#   [arXiv:2401.04088](https://arxiv.org/abs/2401.04088));
# - predict what expert parallelism saves per rank, and what it costs in traffic, and check both against the estimate;
# - build top-k routing and the token dispatch (an all-to-all there and back) from scratch in two gloo processes, and
#   check the routing against megatron-core's own router;
# - train a tiny MoE GPT at expert parallel 1 and 2 with megatron-core's MoE layer and read its load-balancing loss.

# %% tags=["parameters"]
backend = "local"        # "local" (here) or "slurm" (a cluster, or labkit's local Slurm)
spec_file = "tiny-cpu.yaml"
gpu = "cpu"              # the GPU of each rank ("H100" on a cluster)
ranks = 2                # processes, one per GPU
iterations = 3

# %%
import multiprocessing
import tempfile
import warnings

import pandas as pd
import torch
import torch.distributed as dist

from labkit.answer_key import check
from labkit.estimate import estimate
from labkit.estimate.params import active_params, total_params
from labkit.exercises import prediction_table
from labkit.jobs import backend_named
from labkit.jobs.sweep import Sweep, profiled
from labkit.logs.losses import loss_table
from labkit.megatron.flops import model_flops
from labkit.megatron.shape import Shape
from labkit.messages import say
from labkit.net import free_port
from labkit.paths import example, runs_dir
from labkit.profiling import trace
from labkit.spec import load_spec

# %% [markdown]
# ## 10.1 Predict: what a token costs
#
# An MoE layer replaces the MLP by $E$ expert MLPs and a router, a matrix of $E \times h$ that scores each token for
# each expert. The token goes to its $k$ best experts only, and their outputs are summed with the router's weights.
# The model holds every expert; a token passes through $k$ of them. Mixtral-8x7B: 32 layers, $h = 4096$, 8 experts of
# the MLP width of Mistral 7B (a SwiGLU MLP of $3 \times 4096 \times 14336$ weights), top-2, grouped-query attention.
#
# Your guesses first, in billions:

# %% tags=["prediction"]
my_prediction = {
    "Mixtral-8x7B parameters (B)": ...,
    "active parameters per token (B)": ...,
    "training FLOPs per token / active parameters": ...,  # 6 for a dense model: 2 forward, 4 backward
}

# %%
mixtral = load_spec({"model": {"preset": "mixtral-8x7b"}})
shape = Shape.of(mixtral.model)
flops_per_token = model_flops(shape, 1) / shape.seq_length
answers = {"Mixtral-8x7B parameters (B)": total_params(shape) / 1e9,
           "active parameters per token (B)": active_params(shape) / 1e9,
           "training FLOPs per token / active parameters": flops_per_token / active_params(shape)}
pd.Series(answers).round(3)

# %% [markdown]
# About 6 FLOPs per active parameter and token, as for a dense model of 12.9 B (a little more: attention's scores
# over the 4096 tokens), while the model's memory is that of 46.7 B. That is what an MoE buys: the knowledge of a big
# model at the compute of a small one, paid for in memory, and in moving tokens to their experts.
#
# ## 10.2 Expert parallelism: where the experts live
#
# Data parallelism would copy all 8 experts of every layer to every GPU. **Expert parallelism** splits them: with
# `parallel.expert` $= e$, each rank holds $E/e$ of each layer's experts, and the tokens travel to the rank of their
# expert and back. Megatron lays the expert layers out on their own grid over the same ranks (expert_tensor x expert x
# pipeline x expert-data), so the attention keeps its data-parallel layout while the experts are split; the experts'
# gradients are reduced over the expert-data-parallel ranks only.
#
# Mixtral-8x7B on 8 nodes of 8 H100, pipeline 4, with the distributed optimizer: the memory of the fullest stage, and
# the time of an iteration, as expert parallelism grows:

# %%
def on_h100(expert):
    return load_spec({"model": {"preset": "mixtral-8x7b"}, "parallel": {"pipeline": 4, "expert": expert},
                      "cluster": {"nodes": [{"gpu": "H100", "count": 8, "gpus_per_node": 8}]},
                      "batch": {"micro": 1, "global": 256}, "precision": "bf16",
                      "optimizer": {"distributed": True}})


layouts = {}
for expert in (1, 2, 4, 8):
    est = estimate(on_h100(expert))
    layouts[f"ep {expert}"] = {"GiB per GPU (fullest stage)": max(est.memory_gb_per_stage),
                               "fits": est.fits_in_memory, "iteration (s)": est.iteration_time_s,
                               "token dispatch, exposed (s)": est.exposed_comm_s.get("ep", 0.0)}
pd.DataFrame(layouts).T.round(3)

# %% [markdown]
# At expert parallel 1 every rank of a stage holds all 8 experts of its 8 layers, and the stage does not fit in an
# H100's 80 GB; each doubling halves the experts' share, which is almost all of the weights (exercise 2). The price
# is the token dispatch: an all-to-all per MoE layer, there and back, in the forward and again in the backward, which
# the estimate counts as exposed `ep` communication. Up to 8, one node, it stays on NVLink, and the iteration even
# shortens: each rank runs the small kernels of fewer experts per layer, which the host launches one by one (the
# estimate charges a cost per local expert). `labkit plan` weighs the same trade when it searches `parallel.expert`.

# %% tags=["check-claim"]
assert not layouts["ep 1"]["fits"] and all(layouts[f"ep {e}"]["fits"] for e in (2, 4, 8)), layouts
assert layouts["ep 8"]["iteration (s)"] < layouts["ep 4"]["iteration (s)"] < layouts["ep 2"]["iteration (s)"], layouts

# %% [markdown]
# ## 10.3 Routing and dispatch from scratch (homework)
#
# Two ranks, each with its own 6 of the 12 tokens, of width 8; 4 experts, 2 per rank (expert parallel 2), each a
# plain matrix; top-2 routing. Each rank scores its tokens (`logits = x @ router.T`), keeps each token's two best
# experts and weighs them with a softmax over the two scores (megatron-core's default: the softmax after the top-k).
# Then the **dispatch**: each rank sorts its (token, expert) pairs by the rank that holds the expert, tells every rank
# how many it will send (an all-to-all of counts), and sends the token vectors (an all-to-all of tokens). The experts
# compute, an all-to-all sends the results back in the same order, and each rank sums its tokens' two results with
# their weights.

# %%
HIDDEN, EXPERTS, TOPK, TOKENS = 8, 4, 2, 12  # TOKENS in all, split over the ranks


def route(x, router):
    """Top-k routing: each token's k best experts and their weights (softmax over the k scores)."""
    scores, experts = torch.topk(x @ router.T, TOPK, dim=-1)
    return torch.softmax(scores, dim=-1), experts


def moe_layer(rank, world, x, router, expert_weights):
    """The MoE layer on this rank's tokens; the experts split over `world` ranks, expert e on rank e // (E / world)."""
    weights, experts = route(x, router)
    per_rank = EXPERTS // world
    token_of = torch.arange(len(x)).repeat_interleave(TOPK)       # one row per (token, chosen expert)
    expert_of = experts.reshape(-1)
    order = torch.argsort(expert_of // per_rank, stable=True)     # grouped by the rank that holds the expert
    send_counts = torch.bincount(expert_of // per_rank, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)              # how many rows each rank will receive
    send, recv = send_counts.tolist(), recv_counts.tolist()
    tokens_in = torch.empty(sum(recv), HIDDEN)
    dist.all_to_all_single(tokens_in, x[token_of[order]], recv, send)
    ids_in = torch.empty(sum(recv), dtype=torch.long)
    dist.all_to_all_single(ids_in, expert_of[order], recv, send)
    local = torch.stack([tokens_in[i] @ expert_weights[e] for i, e in enumerate(ids_in.tolist())]) \
        if sum(recv) else torch.empty(0, HIDDEN)
    results = torch.empty(len(order), HIDDEN)
    dist.all_to_all_single(results, local, send, recv)            # back, in the order they were sent
    out = torch.zeros_like(x)
    out.index_add_(0, token_of[order], results * weights.reshape(-1)[order, None])
    return out


def rank_main(rank, world, port, queue):
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # every rank draws the same router, experts and batch, and keeps its share of the tokens
    router, expert_weights = torch.randn(EXPERTS, HIDDEN), torch.randn(EXPERTS, HIDDEN, HIDDEN)
    x = torch.randn(TOKENS, HIDDEN).chunk(world)[rank]
    queue.put((rank, moe_layer(rank, world, x, router, expert_weights).tolist()))
    dist.destroy_process_group()


def run_ranks(world):
    fork = multiprocessing.get_context("fork")  # the ranks start as copies of this notebook's process
    queue, port = fork.Queue(), free_port()
    processes = [fork.Process(target=rank_main, args=(rank, world, port, queue)) for rank in range(world)]
    for process in processes:
        process.start()
    out = dict(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join()
    return torch.tensor([row for rank in sorted(out) for row in out[rank]])


two_ranks, one_rank = run_ranks(2), run_ranks(1)
assert torch.allclose(two_ranks, one_rank, atol=1e-5)
print(say("lab10.ep_matches", tokens=len(one_rank)))

# %% [markdown]
# The routing is megatron-core's: its `TopKRouter` (megatron/core/transformer/moe/router.py), given the same router
# matrix, sends each token to the same two experts with the same weights. (It runs here on the CPU through labkit's
# small compatibility layer, `labkit.train.cpu_compat`, which answers megatron-core's CUDA calls, and without
# Transformer Engine, whose kernels megatron-core 0.16.1's router looks for by names it leaves undefined:
# `define_moe_names_without_te` defines them as absent, as later megatron-core does.)

# %%
from labkit.train import cpu_compat
from labkit.train.model import define_moe_names_without_te
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter

cpu_compat.apply()
define_moe_names_without_te()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
torch.manual_seed(0)
router, _ = torch.randn(EXPERTS, HIDDEN), torch.randn(EXPERTS, HIDDEN, HIDDEN)
x = torch.randn(TOKENS, HIDDEN)
config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
                           moe_router_topk=TOPK, moe_router_load_balancing_type="none", add_bias_linear=False,
                           use_cpu_initialization=True)
core = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
with torch.no_grad():
    core.weight.copy_(router)
    probs, routing_map = core(x[:, None, :])  # megatron-core's [sequence, batch, hidden]
mine_weights, mine_experts = route(x, router)
mine = torch.zeros(TOKENS, EXPERTS).scatter(1, mine_experts, mine_weights)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
assert torch.equal(routing_map, mine > 0) and torch.allclose(probs, mine, atol=1e-6)
print(say("lab10.router_matches"))

# %% [markdown]
# ## 10.4 A tiny MoE GPT at expert parallel 1 and 2
#
# The tiny GPT with 4 experts of its MLP's width, top-2, on two ranks that are also 2 data-parallel ranks: at expert
# parallel 1 each rank holds all 4 experts of each layer; at 2, two, and the tokens travel to their experts with
# megatron-core's alltoall dispatcher, the dispatch of 10.3.
#
# One thing differs from the dense labs: megatron-core draws each expert rank's experts from that rank's own random
# stream, so expert parallel 1 and 2 start from different weights even with one seed. To compare the arithmetic, the
# run at expert parallel 1 saves a checkpoint (Megatron's `torch_dist` format, which any layout can load) after every
# iteration, and the run at expert parallel 2 resumes it after iteration 1: from the same weights and Adam state, the
# losses of iterations 2 and 3 must agree to fp32 rounding. The run at 2 is profiled at its last iteration.

# %%
runs_dir().mkdir(parents=True, exist_ok=True)
checkpoints = tempfile.mkdtemp(prefix="lab10-checkpoints-", dir=runs_dir())  # a new one at every run of the lab
base = load_spec(example(spec_file)).replace(**{
    "train.iters": iterations, "train.log_interval": 1, "train.ckpt_format": "torch_dist",
    "precision": "fp32", "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "model.num_experts": 4, "model.moe_router_topk": 2, "model.moe_aux_loss_coeff": 0.01,
    "model.moe_token_dispatcher_type": "alltoall",
    "cluster": {"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": ranks}]}})
runs = {"ep1": base.replace(**{"train.save": checkpoints, "train.save_interval": 1}),
        "ep2": profiled(base.replace(**{"parallel.expert": 2, "train.load": checkpoints,
                                        "job.extra_args": ["--ckpt-step", "1"]}), iterations)}
for name, spec in runs.items():
    est = estimate(spec)
    print(say("lab10.params", name=name, params=est.params, active=est.active_params))
first = Sweep.submit(backend_named(backend), {"ep1": runs["ep1"]}, prefix="lab10")
print({name: str(state) for name, state in first.wait().items()})
resumed = Sweep.submit(backend_named(backend), {"ep2": runs["ep2"]}, prefix="lab10")
print({name: str(state) for name, state in resumed.wait().items()})

# %%
logs = {"ep1": first.logs["ep1"], "ep2": resumed.logs["ep2"]}
losses = loss_table(logs)
losses

# %% tags=["check-claim"]
assert list(losses.index) == list(range(2, iterations + 1)), losses
assert (losses["spread"] / losses["ep1"]).max() < 1e-5, losses

# %% [markdown]
# The router's load-balancing loss (GShard's auxiliary loss, as the Switch Transformer scales it; Megatron-LM's
# `load_balancing_loss`, printed after the lm loss) is $E \sum_i f_i P_i$ over the $E$ experts, with $f_i$ the share
# of the token slots routed to expert $i$ and $P_i$ its mean router probability. The model's loss adds it times
# `moe_aux_loss_coeff` (0.01 here), and its gradient pushes the router toward even loads; the log prints it without
# the coefficient, averaged over the MoE layers. Perfectly even routing prints 1; a router that sends every token to
# the same $k$ experts, up to $E / k = 2$.

# %%
balance = pd.DataFrame({name: log.iterations.set_index("iteration")["load_balancing_loss"]
                        for name, log in logs.items()}).dropna()
balance

# %% tags=["check-claim"]
assert len(balance) == iterations - 1 and balance.gt(0.9).all().all() and balance.le(2.0).all().all(), balance
assert ((balance["ep2"] - balance["ep1"]).abs() / balance["ep1"]).max() < 1e-5, balance

# %% [markdown]
# Where the time went on the profiled rank at expert parallel 2: each MoE layer's all-to-all (there and back, in the
# forward and again in the backward) is the `ep` line; the gradient reduction of the dense weights is `dp`.

# %%
groups = trace.communication_by_group(resumed.traces("ep2"))
groups.round(3)

# %% tags=["check-claim"]
assert "ep" in set(groups["group"]), groups

# %% [markdown]
# Your guesses beside the counts:

# %%
prediction_table(my_prediction, estimated=answers, measured={})

# %% [markdown]
# ## Exercises
#
# **Exercise 1.** Mixtral-8x22B (the `mixtral-8x22b` preset): how many billion parameters does a token pass through?

# %%
answer_1 = ...

# %%
check("10.1", answer_1)

# %% [markdown]
# **Exercise 2 (homework).** What fraction of Mixtral-8x7B's parameters are expert weights (the routed experts' MLPs of all 32
# layers)? A number between 0 and 1.

# %%
answer_2 = ...

# %%
check("10.2", answer_2)

# %% [markdown]
# **Exercise 3 (homework).** Mixtral-8x7B at micro-batch 1 and sequence 4096, expert parallel 8 on one node: with perfectly even
# routing, how many token rows does each expert receive per layer and micro-batch?

# %%
answer_3 = ...

# %%
check("10.3", answer_3)
