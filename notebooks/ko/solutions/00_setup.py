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
# # 실습 00 해답: 환경 설정과 Slurm 입문

# %%
from labkit.answer_key import check

# %% [markdown]
# **연습 문제 1.** `default_backend()`는 PATH에 `sbatch`가 있으면 어디서든 Slurm을 고릅니다.

# %%
answer_1 = "slurm"

# %%
check("00.1", answer_1)

# %% [markdown]
# **연습 문제 2.** 자원을 기다리는 작업은 PENDING이며, `squeue`에는 그 옆에 사유(reason) `Resources`가 표시됩니다. 노드가
# 비면(0.6에서는 첫 번째 작업이 취소되었을 때) RUNNING이 됩니다.

# %%
answer_2 = "PENDING"

# %%
check("00.2", answer_2)

# %% [markdown]
# **연습 문제 3.** 일반 자원(generic resource)은 노드당 `NAME:TYPE:COUNT` 형식입니다: `--gres=gpu:a100:2`.

# %%
answer_3 = "gpu:a100:2"

# %%
check("00.3", answer_3)
