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
# # 실습 00: 환경 설정과 Slurm 입문: 설치된 것, 작업이 실행되는 곳, `labkit run` 아래의 명령들
#
# **목표.** 이 실습을 마치면 다음을 할 수 있습니다.
# - 실습에서 쓰는 소프트웨어(PyTorch, megatron-core, labkit)를 확인하고, GPU가 보이는지 확인하기
# - 작업(job)을 실행하는 백엔드(backend)가 어느 것인지 구분하기: `local`(이 머신의 프로세스) 또는 `slurm`(노드를
#   에뮬레이션하는 labkit의 로컬 Slurm, 또는 실제 클러스터)
# - NVIDIA DLI 워크숍 *Model Parallelism: Building and Deploying Large Neural Networks*에서처럼, `sinfo`로
#   클러스터(cluster)의 노드(node), 파티션(partition), 타입별 GPU(typed GPU)를 읽기
# - 배치 스크립트(batch script)를 작성해 `sbatch`로 제출하고, `squeue`로 진행을 따라가고, `sacct`로 어떻게 끝났는지
#   읽기
# - `srun`으로 노드마다 태스크(task)를 하나씩 시작하고, `--gres=gpu:TYPE:N`으로 GPU를 타입별로 요청하고, 다른 작업이
#   점유한 GPU를 작업이 기다리는(PENDING) 모습을 보기
# - 이기종 작업(heterogeneous job, `hetjob`) 제출하기: 실습 06이 A100/A10 혼합 클러스터에서 하듯이,
#   구성요소(component)마다 서로 다른 노드를 요청하는 하나의 작업
# - `labkit run`이 생성(render)하는 스크립트에서 이 단계들을 하나하나 알아보고, 첫 번째 작은 학습 작업 제출하기
#
# Slurm 명령은 실제 Slurm을 상대로 실행됩니다. labkit의 로컬 Slurm(`labkit slurm up`, 또는 저장소
# 체크아웃(checkout)에서는 `make slurm-up`. 이 머신에 a100 노드 하나와 a10 노드 세 개를 에뮬레이션합니다)이나 여러분
# 클러스터의 Slurm입니다. 여러분의 클러스터에서는 파라미터 셀에 그 클러스터의 GPU 타입을 `sinfo`의 GRES 열에 적힌
# 대로(`gpu_type`, `het_gpu_types`), 그리고 모든 노드가 볼 수 있는 디렉터리(`work_dir`)를 적으세요. 노드와 노드별 GPU
# 개수는 `sinfo`에서 가져옵니다. Slurm이 없으면 해당 셀(cell)이 그렇다고 알려 주고, 실습은 그대로 진행됩니다.
#
# 워크숍에서는 제목에 *(선택 사항)*이 붙은 절이나 연습 문제는 시간이 남으면 읽고, *(과제)*가 붙은 것은 세션이 끝난 뒤에
# 합니다. 그래도 셀은 모두 실행하세요. 뒤의 셀이 앞의 셀이 계산한 값을 쓸 수 있습니다.

# %% tags=["parameters"]
backend = "local"   # where the first training job runs: "local" or "slurm"
iterations = 4
gpu_type = "a10"    # the GPU type the Slurm cells ask for (sinfo's GRES column; one it lists stands in if not)
het_gpu_types = ["a100", "a10"]  # the hetjob's components (0.7): one node of the first type, two of the second
work_dir = None     # where the batch scripts and their output go: a directory every node sees (None: a new one in
                    # this machine's temporary directory, which is enough for labkit's local Slurm)
wait_s = 120        # the longest a cell waits for a job

# %%
import re
import shutil
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

from labkit.answer_key import check
from labkit.jobs import backend_named, default_backend
from labkit.jobs.render import render
from labkit.messages import say
from labkit.paths import example
from labkit.spec import load_spec

# %% [markdown]
# ## 0.1 소프트웨어

# %%
for package in ("torch", "megatron-core", "labkit", "jupyterlab", "ipywidgets", "plotly"):
    print(f"{package:>14} {version(package)}")
print(f"{'GPU':>14} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else say('lab00.no_gpu')}")

# %% [markdown]
# ## 0.2 작업이 실행되는 곳
#
# `default_backend()`는 `sbatch` 명령이 있는지만 봅니다. 이 명령이 있으면 Slurm 컨트롤러(controller)가 응답하든 않든
# 기본값은 Slurm이고, 없으면 local입니다. local 백엔드는 같은 `torchrun` 명령을 로컬 프로세스로 실행하며, 작업 API와
# 로그 구성(log layout)도 같습니다. Slurm이 설치되어 있지만 컨트롤러가 멈춰 있으면, 기본 백엔드로 제출한 작업은
# 실패합니다. 그럴 때는 `backend_named("local")`(또는 `--backend local`)을 고르세요. 이 실습의 학습 작업은 기본값을
# 쓰지 않고, 파라미터 셀(parameters cell)에 지정한 백엔드를 씁니다.

# %%
print(say("lab00.backends", default=default_backend().name, backend=backend))

# %% tags=["check-claim"]
assert default_backend().name == ("slurm" if shutil.which("sbatch") else "local"), "0.2 says the default follows sbatch"

# %%
have_slurm = all(shutil.which(tool) for tool in ("sinfo", "sbatch", "squeue", "scancel"))
have_slurm = have_slurm and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
workdir = Path(tempfile.mkdtemp(prefix="slurm-primer-", dir=work_dir))
GRES_GPUS = re.compile(r"gpu:(?:([^:,(\s]+):)?(\d+)")  # gpu:a100:4, gpu:a100:4(S:0-1), or untyped: gpu:8


def cluster_gpus() -> dict[str, dict[str, int]]:
    """The GPUs sinfo lists, by type: {type: {node: its GPUs of that type}}, idle nodes first, over the nodes of the
    default partition (of every partition when none is marked default) that can take jobs; untyped GPUs are under
    the type ""."""
    listed = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %P %G %T"], capture_output=True, text=True).stdout
    rows = [row for row in (line.split() for line in listed.splitlines()) if len(row) == 4
            and not re.match(r"(down|drain|fail|maint|inval|unk|future|reboot|power)", row[3]) and row[3][-1] != "*"]
    rows = [row for row in rows if row[1].endswith("*")] or rows
    gpus = {}
    for node, _, gres, state in sorted(rows, key=lambda row: not row[3].startswith("idle")):
        for kind, count in GRES_GPUS.findall(gres):
            gpus.setdefault(kind, {}).setdefault(node, int(count))
    return gpus


def gres(kind: str, count: int) -> str:
    """The --gres value that asks a node for `count` GPUs of a type."""
    return f"gpu:{kind}:{count}" if kind else f"gpu:{count}"


def sh(command: str) -> str:
    """Run a shell command in the lab's directory and show what it printed."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=workdir)
    print(f"$ {command}\n{done.stdout}{done.stderr}".rstrip())
    return done.stdout.strip()


def job_state(job_id: str) -> str:
    """The job's state as squeue reports it ("" once the controller no longer lists it)."""
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def wait_until(job_id: str, states: tuple[str, ...]) -> str:
    """Poll squeue until the job is in one of `states` (or gone), for at most wait_s seconds."""
    deadline = time.monotonic() + wait_s
    while (state := job_state(job_id)) and state not in states and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def wait_until_gone(job_id: str) -> bool:
    """Wait for the job to end, for at most wait_s seconds; one still queued or running then is cancelled (False)."""
    state = wait_until(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        return True
    print(say("lab00.job_cancelled", job_id=job_id, state=state, wait_s=wait_s))
    subprocess.run(["scancel", job_id])
    return False


def output_of(job_id: str, output: Path) -> str:
    """What a batch job wrote to its output file, once it has ended."""
    ended = wait_until_gone(job_id)
    return output.read_text() if ended and output.exists() else ""


gpus = cluster_gpus() if have_slurm else {}
if not have_slurm:
    print(say("lab00.no_slurm"))
elif not gpus:
    have_slurm = False
    print(say("lab00.no_gpus_listed"))
elif gpu_type not in gpus:
    print(say("lab00.gpu_type_missing", wanted=gpu_type, used=next(iter(gpus)), types=sorted(gpus)))
    gpu_type = next(iter(gpus))

# %% [markdown]
# ## 0.3 클러스터: `sinfo`
#
# Slurm의 컨트롤러(`slurmctld`)는 모든 노드를 알고 있고, 각 노드의 `slurmd`가 실제 작업을 시작합니다. 노드는 파티션,
# 곧 큐(queue)로 묶입니다. GRES 열은 일반 자원(generic resource)을 나열하며, 여기서는 타입별 GPU입니다. `gpu:a100:4`는
# A100 네 개입니다.

# %%
if have_slurm:
    sh('sinfo -N -o "%N %P %c %m %G %T"')
    for kind, nodes in gpus.items():
        counts = say("lab00.or").join(map(str, sorted(set(nodes.values()))))
        print(say("lab00.gpu_nodes", kind=kind or say("lab00.untyped"), nodes=len(nodes), counts=counts))

# %% [markdown]
# ## 0.4 배치 스크립트: `sbatch`, `squeue`, `sacct`
#
# 배치 스크립트는 `#SBATCH` 줄에 `sbatch`의 옵션, 곧 노드 수, 사용할 GPU, 출력 위치를 적은 셸 스크립트(shell
# script)입니다. `sbatch`는 스크립트를 큐에 넣고 작업 ID로 응답합니다. 작업은 자원이 빌 때까지 기다리고(PENDING),
# 할당받은 첫 번째 노드에서 실행되며(RUNNING), COMPLETED(종료 코드 0) 또는 FAILED로 끝납니다.

# %%
script = workdir / "hello.sbatch"
script.write_text(f"""#!/bin/bash
#SBATCH --job-name=hello
#SBATCH --nodes=1
#SBATCH --gres={gres(gpu_type, 1)}
#SBATCH --output={workdir}/hello-%j.out
echo "job $SLURM_JOB_ID on $SLURMD_NODENAME, GPUs visible: $CUDA_VISIBLE_DEVICES"
""")
print(script.read_text())
if have_slurm:
    job_id = sh(f"sbatch --parsable {script}").split(";")[0]
    sh(f'squeue -j {job_id} -o "%i %j %T %r %N"')
    print(output_of(job_id, workdir / f"hello-{job_id}.out"))

# %% [markdown]
# `sacct`는 어카운팅 데이터베이스(accounting database, slurmdbd)를 읽어, 각 작업이 어떻게 끝났는지를 `CODE:SIGNAL`
# 형식의 종료 코드(exit code)와 함께 보여 줍니다. 어카운팅이 없는 클러스터에는 `scontrol show job`이 있으며,
# 컨트롤러는 작업이 끝난 뒤 몇 분 동안 이 명령에 응답합니다.

# %%
if have_slurm:
    accounting = "accounting_storage/none" not in sh("scontrol show config | grep AccountingStorageType")
    sh(f"sacct -X -j {job_id} -o JobID,JobName,State,ExitCode,Elapsed" if accounting
       else f"scontrol show job {job_id} | grep -E 'JobState|ExitCode'")

# %% [markdown]
# ## 0.5 노드마다 태스크 하나: `srun`
#
# 작업 안에서 `srun`은 그 작업의 노드들에서 태스크를 시작합니다. `--ntasks-per-node=1`이면 노드마다 하나씩이고, 각
# 태스크는 자신의 `SLURM_PROCID`(0, 1, ...)를 가집니다. labkit의 스크립트는 이 방식으로 torchrun을 시작하고,
# torchrun은 GPU마다 학습 프로세스를 하나씩 시작합니다. torchrun이 받는 노드 랭크(node rank)가 곧 그 태스크의
# `SLURM_PROCID`입니다.

# %%
# two nodes of gpu_type and two GPUs on each, or as many as this cluster's sinfo lists
nodes, per_node = (min(2, len(gpus[gpu_type])), min(2, *gpus[gpu_type].values())) if have_slurm else (2, 2)
two_nodes = workdir / "two-nodes.sbatch"
two_nodes.write_text(f"""#!/bin/bash
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gres={gres(gpu_type, per_node)}
#SBATCH --output={workdir}/two-nodes-%j.out
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
""")
if have_slurm:
    two_id = sh(f"sbatch --parsable {two_nodes}").split(";")[0]
    print(output_of(two_id, workdir / f"two-nodes-{two_id}.out"))

# %% [markdown]
# ## 0.6 GPU 기다리기, 취소하기, 없는 것을 요청하기
#
# 어느 노드가 가진 것보다도 많이 요청하는 작업은, 그 작업을 실행할 수 있는 노드가 끝내 없으므로 제출 단계에서
# 거부됩니다(labkit의 로컬 Slurm은 불가능한 요청을 즉시 거절합니다. `EnforcePartLimits`가 없는 클러스터는 그런 작업을
# 끝없이 큐에 두므로, 아래 셀이 그 작업을 취소합니다). 실행될 수는 있지만 필요한 GPU를 다른 작업이 점유하고 있는
# 작업은 기다립니다. `squeue`는 이 작업을 PENDING으로, 그 사유(reason)와 함께 보여 줍니다(`Resources`: 노드가 사용 중,
# `Priority`: 다른 작업이 우선, `Dependency`: 다른 작업을 기다리는 중). 아래에서 첫 번째 작업은 노드 하나의 GPU를
# 모두 잡고 sleep하고, 두 번째 작업은 같은 노드(`--nodelist`로 지정합니다)의 GPU 하나를 요청해 `scancel`이 첫 번째
# 작업을 멈출 때까지 PENDING 상태로 기다립니다. 노드와 그 GPU 타입, 개수는 `gpu_type`과 `sinfo`에서 가져오므로 어느
# 클러스터에서나 그대로 동작합니다. `--nodelist`가 없으면 Slurm은 두 번째 작업을 GPU가 비어 있는 다른 노드에서
# 시작할 것입니다. 취소된 작업은 CANCELLED로 끝납니다.

# %%
if have_slurm:
    most = max(gpus[gpu_type].values())  # no node has more GPUs of this type
    refused = sh(f"echo '#!/bin/bash' | sbatch --parsable --nodes=1 --gres={gres(gpu_type, most + 1)} "
                 f"--output=/dev/null")
    if refused:  # a cluster that queues what no node can run: take it back
        sh(f"scancel {refused.split(';')[0]}")
    node, count = next(iter(gpus[gpu_type].items()))  # an idle node of that type, if any is, and all its GPUs
    holder = sh(f"sbatch --parsable --nodes=1 --nodelist={node} --gres={gres(gpu_type, count)} --output=/dev/null "
                f"--wrap 'sleep 600'").split(";")[0]
    wait_until(holder, ("RUNNING",))
    waiter = sh(f"sbatch --parsable --nodes=1 --nodelist={node} --gres={gres(gpu_type, 1)} --output=/dev/null "
                f"--wrap 'hostname'").split(";")[0]
    time.sleep(2)
    sh(f'squeue -j {holder},{waiter} -o "%i %T %r %b"')
    waited = job_state(waiter)
    sh(f"scancel {holder}")
    wait_until_gone(waiter)
    sh(f'squeue -t all -j {holder},{waiter} -o "%i %T"')

# %% tags=["check-claim"]
assert not have_slurm or waited == "PENDING", f"0.6 says the second job pends while the first holds the GPUs: {waited}"

# %% [markdown]
# 작업은 TIMEOUT(`--time`을 넘겨 실행됨), OUT_OF_MEMORY(메모리가 모자라 운영체제가 종료시킴), NODE_FAIL(노드가 다운됨)로
# 끝나기도 합니다. `--requeue`를 주면 Slurm이 작업을 다시 큐에 넣을 수 있으며, 다음 시도는 처음부터 시작합니다.
# 체크포인트(checkpoint)를 썼다면 그 체크포인트부터 시작합니다(labkit 스펙(spec)의 `job.requeue`).
#
# ## 0.7 이기종 작업: `hetjob` (선택 사항)
#
# 혼합 클러스터(mixed cluster)에서는 서로 다른 종류의 노드에 걸쳐 하나의 모델을 학습합니다. 실습 06에서는 파이프라인
# 스테이지(pipeline stage)를 A100 노드와 A10 노드에 나눠 둡니다. 하나의 Slurm 작업이 `#SBATCH hetjob`으로 구분한
# 구성요소들로 두 종류를 모두 요청합니다. 각 구성요소는 자신의 노드와 GPU를 가지며, 모든 구성요소가 함께 시작하고,
# `srun --het-group=N`은 구성요소 N에서 태스크를 시작합니다(`--het-group=0,1`이면 두 구성요소 모두에서 시작하며,
# `SLURM_PROCID` 번호가 둘에 걸쳐 하나로 매겨집니다. torchrun의 노드 랭크가 작업 전체에 걸치는 것은 이 덕분입니다).
# 아래에서는 `het_gpu_types`의 첫 번째 타입 노드 하나와 두 번째 타입 노드 둘을, 각각 `sinfo`가 보여 주는 GPU를 모두
# 잡아 요청합니다.

# %%
# each component's type as the parameters cell names it or, where sinfo lists no such GPUs, one it lists that the
# other component has not taken; and every GPU of its nodes
het_types = []
for kind in het_gpu_types:
    het_types.append(kind if not have_slurm or kind in gpus
                     else next((other for other in gpus if other not in het_types), gpu_type))
het_nodes = [1, min(2, len(gpus[het_types[1]]) - (het_types[0] == het_types[1]))] if have_slurm else [1, 2]
het_gpus = [min(gpus[kind].values()) if have_slurm else 4 for kind in het_types]
het_ran = have_slurm and het_nodes[1] > 0
het = workdir / "het.sbatch"
het.write_text(f"""#!/bin/bash
#SBATCH --output={workdir}/het-%j.out
#SBATCH --nodes={het_nodes[0]} --ntasks-per-node=1 --gres={gres(het_types[0], het_gpus[0])}
#SBATCH hetjob
#SBATCH --nodes={het_nodes[1]} --ntasks-per-node=1 --gres={gres(het_types[1], het_gpus[1])}
srun --het-group=0,1 bash -c 'echo "task $SLURM_PROCID on $SLURMD_NODENAME sees GPUs $CUDA_VISIBLE_DEVICES"'
""")
print(het.read_text())
if have_slurm and not het_ran:
    print(say("lab00.no_hetjob", gpu=het_types[1]))
het_output = ""
if het_ran:
    het_id = sh(f"sbatch --parsable {het}").split(";")[0]
    sh(f'squeue -j {het_id} -o "%i %T %N %b"')
    het_output = output_of(het_id, workdir / f"het-{het_id}.out")
    print(het_output)

# %% tags=["check-claim"]
het_tasks = het_output.split()
assert not het_ran or {het_tasks[i + 1] for i, word in enumerate(het_tasks) if word == "task"} == {
    str(task) for task in range(sum(het_nodes))}, "0.7 says srun numbers the tasks of both components together"

# %% [markdown]
# ## 0.8 `labkit run`이 작성하는 것
#
# labkit은 실행 스펙(run spec)으로부터 같은 명령들을 생성합니다. `#SBATCH` 줄, 노드마다 `torchrun`을 실행하는 `srun`
# 태스크 하나, 그리고 학습 플래그(flag)입니다. `labkit run SPEC --dry-run`은 이 스크립트를 출력합니다.
# `backend.submit(spec)`은 `sbatch`를 실행하고, `job.status()`는 `squeue`에(그다음에는 `sacct`에) 묻고,
# `job.cancel()`은 `scancel`을 실행합니다.

# %%
spec = load_spec(example("tiny-cpu.yaml")).replace(
    cluster={"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 1}]})
rendered = render(spec, workdir / "logs").scripts["job.sbatch"]
print("\n".join(line for line in rendered.splitlines() if line.startswith(("#SBATCH", "srun", "    bash -c"))))

# %% [markdown]
# ## 0.9 첫 번째 작은 작업
#
# 내장된 기본 스펙은 파라미터 셀에서 고른 백엔드에서 두 프로세스로, 모의 토큰(mock token)을 써서 레이어 2개짜리 GPT를 학습합니다.

# %%
spec = load_spec(example("tiny-cpu.yaml")).replace(
    **{"train.iters": iterations, "train.log_interval": 1})
job = backend_named(backend).submit(spec)
state = job.wait(progress=False)
print(f"{job}: {state}")
assert str(state) == "COMPLETED", job.cause()

# %%
for node, files in job.tail(lines=4).items():
    print(f"==> {node} <==")
    print("\n".join(files.get("out", [])))

# %% [markdown]
# 마지막 줄들은 Megatron이 출력한 것입니다. 반복(iteration) 줄(시간, 손실(loss), 학습률(learning rate))과
# 타이머(timer)입니다. 실습 01에서 이 줄들을 표로 읽어 들입니다.
#
# ## 연습 문제
#
# **연습 문제 1.** `sbatch`가 설치된 머신에서 백엔드를 직접 고르지 않으면, 어느 백엔드가 작업을 실행할까요? `"local"` 또는
# `"slurm"`으로 답하세요.

# %%
answer_1 = ...

# %%
check("00.1", answer_1)

# %% [markdown]
# **연습 문제 2 (과제).** 어떤 작업이, 필요한 GPU를 가진 노드가 모두 사용 중이어서 큐에서 기다리고 있습니다. `squeue`는 이 작업의
# 상태(state)를 무엇으로 보여 줄까요? Slurm의 용어를 대문자로 답하세요.

# %%
answer_2 = ...

# %%
check("00.2", answer_2)

# %% [markdown]
# **연습 문제 3 (과제).** 노드마다 A100 GPU 두 개를 요청하는 `--gres` 값을 쓰세요(타입은 `sinfo`가 나열하는 대로 씁니다).

# %%
answer_3 = ...

# %%
check("00.3", answer_3)
