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
# # 실습 04 해답: 그래디언트 누적(gradient accumulation)

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

gpu = "cpu"
base = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": gpu, "count": 1, "gpus_per_node": 1}]})

# %% [markdown]
# **연습 문제 1.** 마이크로배치 4로 도는 데이터 병렬(data parallel) GPU 4개는 한 번에 샘플 16개를 처리합니다. 64 / 16 =
# 마이크로배치(micro-batch) 4개.

# %%
answer_1 = base.replace(**{"batch.micro": 4, "batch.global": 64,
                           "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 2}]}})
answer_1.num_micro_batches

# %%
check("04.1", answer_1)

# %% [markdown]
# **연습 문제 2.** 반복(iteration)마다 글로벌 배치(global batch) 하나를 소비합니다: 16 x 10.

# %%
answer_2 = 16 * 10

# %%
check("04.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 각 마이크로배치의 활성값(activation)은 다음 순전파(forward) 전에 그 마이크로배치의 역전파(backward)에서
# 해제되므로 메모리 최고치(peak)는 마이크로배치 하나 분량입니다. 반면 패스(pass)들은 차례로 실행되므로 시간은
# 늘어납니다.

# %%
answer_3 = "time per iteration"

# %%
check("04.3", answer_3)
