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
# # 실습 10: 전문가 병렬화(expert parallelism): 전문가 혼합 모델, 그 비용, 토큰 분배
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 전문가 혼합(mixture-of-experts, MoE) 모델의 전체 파라미터와 활성 파라미터(active parameter), 토큰 하나에 드는
#   FLOPs를 세기(Shazeer et al. 2017; GShard, [arXiv:2006.16668](https://arxiv.org/abs/2006.16668); Mixtral,
#   [arXiv:2401.04088](https://arxiv.org/abs/2401.04088))
# - 전문가 병렬화가 랭크(rank)당 무엇을 아끼고 트래픽(traffic)으로 무엇을 치르는지 예측하고, 둘 다 추정(estimate)과
#   맞춰 보기
# - top-k 라우팅(routing)과 토큰 분배(token dispatch: 보내고 돌려받는 all-to-all)를 두 gloo 프로세스에서 처음부터
#   구현하고, 라우팅을 megatron-core 자체의 라우터(router)와 맞춰 보기
# - megatron-core의 MoE 레이어로 작은 MoE GPT를 전문가 병렬 1과 2에서 학습하고 부하 균형 손실(load-balancing loss)을
#   읽기

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
# ## 10.1 예측: 토큰 하나의 비용
#
# MoE 레이어는 MLP를 전문가 MLP $E$개와 라우터로 바꿉니다. 라우터는 $E \times h$ 행렬로, 토큰마다 각 전문가의 점수를
# 매깁니다. 토큰은 점수가 가장 높은 전문가 $k$개에게만 가고, 그 출력은 라우터의 가중치로 더해집니다. 모델은 모든
# 전문가를 가지지만, 토큰 하나는 그중 $k$개만 지납니다. Mixtral-8x7B: 레이어 32개, $h = 4096$, Mistral 7B의 MLP 폭을
# 가진 전문가 8개(가중치 $3 \times 4096 \times 14336$개의 SwiGLU MLP), top-2, 그룹 쿼리 어텐션(grouped-query attention).
#
# 먼저 여러분의 예측을 10억(billion) 단위로 적어 봅니다:

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
# 활성 파라미터 하나, 토큰 하나당 약 6 FLOPs로 12.9 B짜리 밀집(dense) 모델과 같습니다(4096개 토큰에 걸친 어텐션 점수
# 때문에 조금 더 많습니다). 반면 모델의 메모리는 46.7 B짜리 모델만큼 듭니다. MoE로 얻는 것이 바로 이것입니다. 큰 모델의
# 지식을 작은 모델의 계산량으로 얻고, 그 값은 메모리로, 그리고 토큰을 전문가에게 옮기는 일로 치릅니다.
#
# ## 10.2 전문가 병렬화: 전문가가 놓이는 곳
#
# 데이터 병렬화라면 모든 레이어의 전문가 8개를 GPU마다 복사합니다. **전문가 병렬화**는 이들을 나눕니다.
# `parallel.expert` $= e$이면 각 랭크가 레이어마다 전문가 $E/e$개를 가지고, 토큰은 자기 전문가가 있는 랭크로 갔다가
# 돌아옵니다. Megatron은 전문가 레이어를 같은 랭크들 위의 별도 격자(expert_tensor x expert x pipeline x expert-data)에
# 배치하므로, 어텐션은 데이터 병렬 레이아웃(layout)을 그대로 유지하고 전문가만 나뉩니다. 전문가의 그래디언트(gradient)는
# 전문가-데이터 병렬(expert-data-parallel) 랭크들 사이에서만 리듀스(reduce)됩니다.
#
# H100 8개짜리 노드 8개에서 파이프라인 4, 분산 옵티마이저(distributed optimizer)로 Mixtral-8x7B를 학습할 때, 전문가
# 병렬 크기가 커짐에 따라 가장 꽉 찬 스테이지(stage)의 메모리와 반복(iteration) 하나의 시간은 다음과 같습니다:

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
# 전문가 병렬 1에서는 스테이지의 모든 랭크가 자기 레이어 8개의 전문가 8개를 모두 가지며, 그 스테이지는 H100의 80 GB에
# 들어가지 않습니다. 크기를 두 배로 할 때마다 전문가 몫이 절반이 되는데, 이것이 가중치의 거의 전부입니다(연습 문제 2).
# 대가는 토큰 분배입니다. MoE 레이어마다 보내고 돌려받는 all-to-all이 순전파(forward)에서, 그리고 역전파(backward)에서
# 다시 일어나며, 추정은 이를 드러난(exposed) `ep` 통신으로 셉니다. 한 노드인 8까지는 NVLink 위에 머물고, 반복 시간은
# 오히려 짧아집니다. 랭크마다 레이어당 더 적은 전문가의 작은 커널을 돌리고, 호스트는 그 커널을 하나씩 띄우기
# 때문입니다(추정은 로컬 전문가마다 비용을 매깁니다). `labkit plan`도 `parallel.expert`를 탐색할 때 같은 저울질을 합니다.

# %% tags=["check-claim"]
assert not layouts["ep 1"]["fits"] and all(layouts[f"ep {e}"]["fits"] for e in (2, 4, 8)), layouts
assert layouts["ep 8"]["iteration (s)"] < layouts["ep 4"]["iteration (s)"] < layouts["ep 2"]["iteration (s)"], layouts

# %% [markdown]
# ## 10.3 라우팅과 분배를 처음부터 구현하기 (과제)
#
# 랭크 두 개가 토큰 12개 중 각자 6개(폭 8)를 가지고, 전문가 4개를 랭크마다 2개씩(전문가 병렬 2) 가지며, 전문가는 각각
# 평범한 행렬 하나입니다. 라우팅은 top-2입니다. 각 랭크는 자기 토큰의 점수를 매기고(`logits = x @ router.T`), 토큰마다
# 가장 좋은 전문가 두 개를 골라 두 점수에 대한 소프트맥스(softmax)로 가중치를 줍니다(megatron-core의 기본값: top-k 뒤의
# 소프트맥스). 그다음이 **분배**입니다. 각 랭크는 (토큰, 전문가) 쌍을 그 전문가를 가진 랭크 순으로 정렬하고, 각
# 랭크에게 몇 개를 보낼지 알리며(개수의 all-to-all), 토큰 벡터를 보냅니다(토큰의 all-to-all). 전문가가 계산하면
# all-to-all이 결과를 같은 순서로 돌려보내고, 각 랭크는 자기 토큰의 두 결과를 가중치로 더합니다.

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
# 라우팅은 megatron-core의 것과 같습니다. 같은 라우터 행렬을 주면 megatron-core의 `TopKRouter`
# (megatron/core/transformer/moe/router.py)는 토큰마다 같은 두 전문가를 같은 가중치로 고릅니다. (여기서는 labkit의 작은
# 호환 계층 `labkit.train.cpu_compat`이 megatron-core의 CUDA 호출에 답해 CPU에서 실행되며, Transformer Engine 없이
# 실행됩니다. megatron-core 0.16.1의 라우터는 Transformer Engine의 커널을 찾을 때 쓰는 이름들을 정의하지 않은 채
# 둡니다. `define_moe_names_without_te`는 이후 버전의 megatron-core가 하듯이 그 이름들을 '없음'으로 정의합니다.)

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
# ## 10.4 전문가 병렬 1과 2의 작은 MoE GPT
#
# MLP 폭의 전문가 4개, top-2를 가진 작은 GPT를, 데이터 병렬 랭크이기도 한 랭크 두 개에서 학습합니다. 전문가 병렬
# 1에서는 각 랭크가 레이어마다 전문가 4개를 모두 가지고, 2에서는 2개를 가지며, 토큰은 megatron-core의 alltoall
# 분배기(dispatcher), 곧 10.3의 분배로 자기 전문가에게 갑니다.
#
# 밀집 모델 실습과 다른 점이 하나 있습니다. megatron-core는 각 전문가 랭크의 전문가를 그 랭크 자신의 난수 흐름에서
# 뽑으므로, 시드(seed)가 같아도 전문가 병렬 1과 2는 서로 다른 가중치에서 시작합니다. 산술을 비교하기 위해 전문가 병렬
# 1의 실행은 반복마다 체크포인트(checkpoint)를 저장하고(어떤 레이아웃으로도 불러올 수 있는 Megatron의 `torch_dist`
# 형식), 전문가 병렬 2의 실행은 반복 1 뒤의 체크포인트에서 이어 갑니다. 같은 가중치와 Adam 상태에서 출발하므로 반복 2와
# 3의 손실은 fp32 반올림 범위에서 일치해야 합니다. 전문가 병렬 2의 실행은 마지막 반복을 프로파일링(profiling)합니다.

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
# 라우터의 부하 균형 손실(GShard의 보조 손실(auxiliary loss)을 Switch Transformer 방식으로 스케일한 것; Megatron-LM의
# `load_balancing_loss`로, lm loss 뒤에 출력됨)은 전문가 $E$개에 대한 $E \sum_i f_i P_i$입니다. $f_i$는 전문가 $i$로
# 라우팅된 토큰 슬롯의 비율, $P_i$는 그 전문가의 평균 라우터 확률입니다. 모델의 손실은 여기에
# `moe_aux_loss_coeff`(여기서는 0.01)를 곱해 더하고, 그 그래디언트가 라우터를 고른 부하 쪽으로 밉니다. 로그는 계수를
# 빼고 MoE 레이어들에 대해 평균한 값을 출력합니다. 완전히 고른 라우팅은 1을, 모든 토큰을 같은 전문가 $k$개에게 보내는
# 라우터는 최대 $E / k = 2$를 출력합니다.

# %%
balance = pd.DataFrame({name: log.iterations.set_index("iteration")["load_balancing_loss"]
                        for name, log in logs.items()}).dropna()
balance

# %% tags=["check-claim"]
assert len(balance) == iterations - 1 and balance.gt(0.9).all().all() and balance.le(2.0).all().all(), balance
assert ((balance["ep2"] - balance["ep1"]).abs() / balance["ep1"]).max() < 1e-5, balance

# %% [markdown]
# 전문가 병렬 2에서 프로파일링한 랭크의 시간이 어디에 쓰였는지 봅니다. MoE 레이어마다의 all-to-all(보내고 돌려받기,
# 순전파에서 그리고 역전파에서 다시)이 `ep` 줄이고, 밀집 가중치의 그래디언트 리덕션(reduction)이 `dp` 줄입니다.

# %%
groups = trace.communication_by_group(resumed.traces("ep2"))
groups.round(3)

# %% tags=["check-claim"]
assert "ep" in set(groups["group"]), groups

# %% [markdown]
# 여러분의 예측을 계산값과 나란히 놓아 봅니다:

# %%
prediction_table(my_prediction, estimated=answers, measured={})

# %% [markdown]
# ## 연습 문제
#
# **연습 문제 1.** Mixtral-8x22B(`mixtral-8x22b` 프리셋)에서 토큰 하나가 지나는 파라미터는 10억(billion) 단위로 몇
# 개입니까?

# %%
answer_1 = ...

# %%
check("10.1", answer_1)

# %% [markdown]
# **연습 문제 2 (과제).** Mixtral-8x7B의 파라미터 중 전문가 가중치(32개 레이어 전체의 라우팅되는 전문가 MLP)의 비율은
# 얼마입니까? 0과 1 사이의 수로 답하세요.

# %%
answer_2 = ...

# %%
check("10.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 마이크로배치(micro-batch) 1, 시퀀스 4096, 한 노드의 전문가 병렬 8인 Mixtral-8x7B에서 라우팅이 완전히
# 고르다면, 각 전문가는 레이어와 마이크로배치마다 토큰 행을 몇 개 받습니까?

# %%
answer_3 = ...

# %%
check("10.3", answer_3)
