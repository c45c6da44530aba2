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
# # 실습 07 해답: 3D 병렬화(3D parallelism)와 모니터링

# %%
from labkit.answer_key import check
from labkit.paths import example
from labkit.spec import load_spec

gpu = "cpu"
base = load_spec(example("tiny-cpu.yaml"))

# %% [markdown]
# **연습 문제 1.** GPU는 모두 8개이고, 모델 복제본(replica) 하나가 텐서 x 파이프라인 = 4개에 걸치므로 복제본은 2개입니다.

# %%
answer_1 = 2 * 4 // (2 * 2)

# %%
eight = base.replace(**{"parallel.tensor": 2, "parallel.pipeline": 2,
                        "cluster": {"nodes": [{"gpu": gpu, "count": 2, "gpus_per_node": 4}]}})
check("07.1", answer_1, spec=eight)

# %% [markdown]
# **연습 문제 2.** 데이터 병렬(data parallel) 복제본은 저마다 자기 샘플로 그래디언트(gradient)를 계산했고, 이 그래디언트는
# 반복(iteration)마다 한 번 데이터 병렬 그룹에서 모든 복제본에 걸쳐 합산됩니다.

# %%
answer_2 = "dp"

# %%
check("07.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 반복의 $(p - 1) / (m + p - 1) = 7 / 23$입니다(SC21의 $(p - 1) / m = 7 / 16$은 버블(bubble) 시간을 버블
# 없는 시간으로 나눈 값입니다).

# %%
answer_3 = 7 / 23
answer_3

# %%
check("07.3", answer_3)
