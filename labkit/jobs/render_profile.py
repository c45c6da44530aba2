"""A spec's profile section -> the command torchrun starts on each worker: the chosen ranks under Nsight Systems or
Nsight Compute, the others as they are.

torchrun starts every worker with its global rank in RANK (torch.distributed.run). With `--no-python` it runs the
program it is given instead of prepending Python (its documented use for a wrapper), here a shell that looks up
RANK: a rank of profile.nsys execs `nsys profile --capture-range=cudaProfilerApi ... python -u PROGRAM ARGS`, a rank
of profile.ncu `ncu --profile-from-start off ...`, any other rank `python -u PROGRAM ARGS`. The training program opens
and closes the CUDA profiler's range (--profile, labkit.megatron_args), so nsys records only the chosen steps
(NVIDIA Nsight Systems user guide, "--capture-range=cudaProfilerApi"; Nsight Compute CLI, "--profile-from-start
off"), and `--export=sqlite` writes beside each report the SQLite file `labkit profile nsys` reads. Before it starts
the tool the shell checks that the node has it, and stops naming the spec key when it does not.

Reports: DIR/nsys/rankR.nsys-rep (+ rankR.sqlite) and DIR/ncu/rankR.ncu-rep, DIR the run's logs/ (the script's
$LOGDIR, expanded on the node before any container starts) or profile.output_dir.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

LAUNCHER_NAME = "labkit-profile"
"""$0 of the per-rank shell: how it shows in `ps` and in its own messages."""


def profiling(spec) -> bool:
    """Whether the spec starts any rank under nsys or ncu."""
    return spec.profile is not None and (spec.profile.nsys is not None or spec.profile.ncu is not None)


def nsys_command(nsys) -> list[str]:
    """`nsys profile` with profile.nsys's options, before the output path and the program."""
    return ["nsys", "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
            f"--trace={','.join(nsys.trace)}", "--export=sqlite", "--force-overwrite=true", *nsys.extra_args]


def ncu_command(ncu) -> list[str]:
    """`ncu` with profile.ncu's options, before the output path and the program."""
    command = ["ncu", "--profile-from-start", "off", "--launch-count", str(ncu.launch_count), "--force-overwrite"]
    if ncu.kernel_regex:
        command += ["--kernel-name", f"regex:{ncu.kernel_regex}"]
    for section in ncu.sections:
        command += ["--section", section]
    return command


def rank_shell(profile) -> str:
    """The shell each worker runs (bash -c), one line: `$1` the reports' directory, the program from `$2` on."""
    q = shlex.quote
    branches = []
    for key, tool, command in (("profile.nsys", profile.nsys, nsys_command),
                               ("profile.ncu", profile.ncu, ncu_command)):
        if tool is None:
            continue
        name = command(tool)[0]
        # double-quoted: the message names the rank and the node
        missing = (f"labkit: {key}: rank $RANK found no {name} on $(hostname); install NVIDIA Nsight on the nodes (or "
                   f"in job.container.image), or remove {key} from the spec")
        branches.append(f"{'|'.join(str(r) for r in tool.ranks)}) command -v {name} >/dev/null || "
                        f"{{ echo \"{missing}\" >&2; exit 1; }}; mkdir -p \"$dir/{name}\" && "
                        f"exec {' '.join(q(word) for word in command(tool))} -o \"$dir/{name}/rank$RANK\" "
                        f"\"$@\" ;;")
    return f"dir=$1; shift; case $RANK in {' '.join(branches)} esac; exec \"$@\""


def worker_python(torchrun: str) -> str:
    """The Python torchrun starts its workers with (its own interpreter, sys.executable in torch.distributed.run):
    this one where torchrun is the one beside it, else the `python` beside the given torchrun (a venv's bin/), or on
    the PATH for a bare `torchrun` (a container's)."""
    path = Path(torchrun)
    if path.parent == Path(sys.executable).parent:
        return sys.executable
    return str(path.with_name("python")) if path.is_absolute() else "python"


def profiled_entrypoint(spec, program: str, python: str, reports: str | None = None) -> str:
    """torchrun's arguments from the program on, as shell words: `program` as is (-m labkit.train, or Megatron-LM's
    pretrain_gpt.py) without a profile section; else --no-python and the per-rank shell, given the reports'
    directory (profile.output_dir, else `reports`: "$LOGDIR" in a job script), `python` and the program."""
    if not profiling(spec):
        return program
    where = shlex.quote(spec.profile.output_dir) if spec.profile.output_dir else reports
    if where is None:
        raise ValueError("profile.output_dir: needed where the job has no log directory of its own")
    return " ".join(["--no-python", "bash", "-c", shlex.quote(rank_shell(spec.profile)), LAUNCHER_NAME, where,
                     shlex.quote(python), "-u", program])
