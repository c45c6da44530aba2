"""The Megatron-LM entrypoint starts in the common cases: mock data names a tokenizer Megatron-LM builds, a HuggingFace
tokenizer reaches it as a directory, paths that exist only on the cluster are checked by the job instead of on this
machine, and no flag reaches pretrain_gpt.py twice."""
import copy
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from labkit import catalog
from labkit.cli import main
from labkit.estimate import estimate
from labkit.jobs.render import render
from labkit.megatron import sizes
from labkit.megatron.flags import FLAG as F
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec, with_changes

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
LLAMA_TOKENIZER = ROOT / "labkit" / "data" / "tokenizer" / "llama" / "tokenizer.json"
MEGATRON_LM = {"entrypoint": "megatron-lm", "megatron_lm": "/workspace/megatron-lm"}


def value(args: list[str], flag) -> str:
    return args[args.index(flag.name) + 1]


def megatron_lm_vocab(args: list[str]) -> int:
    """The vocabulary Megatron-LM core_v0.16.1 builds from these flags with mock data: _NullTokenizer(--vocab-size)
    has --vocab-size ids and its end-of-document id after them (megatron/training/tokenizer/tokenizer.py)."""
    assert value(args, F.tokenizer_type) == "NullTokenizer"  # None raises "None tokenizer is not implemented."
    return int(value(args, F.vocab_size)) + 1


def megatron_lm_padded(args: list[str]) -> int:
    """Megatron-LM's _vocab_size_with_padding, written out: ceil(vocab / (divisible_by x tensor)) x that multiple."""
    divisible = int(value(args, F.make_vocab_size_divisible_by)) if F.make_vocab_size_divisible_by.name in args else 128
    multiple = divisible * int(value(args, F.tensor_model_parallel_size))
    return math.ceil(megatron_lm_vocab(args) / multiple) * multiple


# --- mock data -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset, tensor", [("tiny", 1), ("tiny", 2), ("gpt2-small", 1), ("gpt2-small", 4),
                                            ("llama3-8b", 1), ("llama3-8b", 8), ("llama2-7b", 4)])
@pytest.mark.parametrize("job", [{}, MEGATRON_LM], ids=["labkit", "megatron-lm"])
def test_mock_data_names_null_tokenizer_and_megatron_lm_builds_the_estimated_vocabulary(preset, tensor, job):
    spec = load_spec({"model": {"preset": preset}, "parallel": {"tensor": tensor}, "job": job,
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8}]},
                      "batch": {"micro": 1, "global": 8 * 8 // tensor}})
    args = megatron_args(spec)
    assert args.index(F.mock_data.name) < args.index(F.tokenizer_type.name)
    # Llama 3's 128256 and Llama 2's 32000 are multiples of 128: one token more would add a whole padding block
    assert megatron_lm_vocab(args) == spec.model.vocab_size
    assert megatron_lm_padded(args) == estimate(spec).padded_vocab_size


def test_the_driver_reads_null_tokenizer_as_megatron_lm_does():
    from labkit.train import data
    from labkit.train.arguments import parse_args

    spec = load_spec({"model": {"preset": "tiny"}})
    argv = megatron_args(spec)
    assert value(argv, F.vocab_size) == str(spec.model.vocab_size - 1)  # the end-of-document id comes on top
    args = parse_args(argv, world_size=1, rank=0, cuda=False)
    tokenizer = data.build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == (spec.model.vocab_size, spec.model.vocab_size - 1)
    assert sizes.padded_vocab_size(tokenizer.vocab_size) == estimate(spec).padded_vocab_size == 1024


# --- HuggingFace tokenizers ------------------------------------------------------------------------------------------

@pytest.fixture
def hf_dir(tmp_path):
    """A tokenizer directory as HuggingFace's save_pretrained leaves it."""
    folder = tmp_path / "llama-tokenizer"
    folder.mkdir()
    shutil.copy(LLAMA_TOKENIZER, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return folder


def hf_spec(model: str, **job):
    return load_spec({"model": {"preset": "tiny-llama"}, "job": job, "data": {
        "path": "/data/corpus_text_document", "tokenizer": {"type": "HuggingFaceTokenizer", "model": model}}})


@pytest.mark.parametrize("given", ["file", "directory"])
def test_a_huggingface_tokenizer_reaches_megatron_lm_as_its_directory_and_the_driver_as_its_file(hf_dir, given):
    model = str(hf_dir / "tokenizer.json") if given == "file" else str(hf_dir)
    driver, megatron_lm = hf_spec(model), hf_spec(model, **MEGATRON_LM)
    # AutoTokenizer.from_pretrained (Megatron-LM's _HuggingFaceTokenizer) takes the directory; the driver the file
    assert value(megatron_args(megatron_lm), F.tokenizer_model) == str(hf_dir)
    assert value(megatron_args(driver), F.tokenizer_model) == str(hf_dir / "tokenizer.json")
    assert driver.model.vocab_size == megatron_lm.model.vocab_size == hf_spec(str(LLAMA_TOKENIZER)).model.vocab_size


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecError) as info:
        hf_spec(str(tmp_path))
    assert any(e.startswith("data.tokenizer.model: cannot read") and "tokenizer.json" in e for e in info.value.errors)


def test_megatron_lm_needs_a_directory_autotokenizer_can_load(hf_dir):
    (hf_dir / "tokenizer_config.json").unlink()
    with pytest.raises(SpecError) as info:
        hf_spec(str(hf_dir), **MEGATRON_LM)
    assert any(e.startswith("data.tokenizer.model:") and "tokenizer_config.json" in e for e in info.value.errors)
    hf_spec(str(hf_dir))  # the driver reads the tokenizer.json alone
    renamed = hf_dir / "llama3.json"
    (hf_dir / "tokenizer.json").rename(renamed)
    with pytest.raises(SpecError) as info:
        hf_spec(str(renamed), **MEGATRON_LM)
    assert any(e.startswith("data.tokenizer.model:") and "rename the file tokenizer.json" in e
               for e in info.value.errors)


# --- paths that exist only on the cluster ----------------------------------------------------------------------------

def cluster_spec(**changes) -> dict:
    """CLUSTER_SPEC with changes, leaving CLUSTER_SPEC as it is."""
    return with_changes(copy.deepcopy(CLUSTER_SPEC), **changes)


CLUSTER_SPEC = {"model": {"preset": "tiny-llama", "vocab_size": 128256},
                "data": {"path": "/fsx/data/corpus_text_document",
                         "tokenizer": {"type": "HuggingFaceTokenizer", "model": "/fsx/tokenizers/llama3"}},
                "job": {**MEGATRON_LM, "container": {"image": "/fsx/images/megatron.sqsh"}},
                "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 1, "gpus_per_node": 8,
                                       "cpus_per_node": 192}]},  # a p5.48xlarge's vCPUs
                "batch": {"micro": 1, "global": 8}}


def test_cluster_paths_are_not_looked_for_here_and_validate_says_so(tmp_path, capsys):
    with pytest.raises(SpecError) as info:
        load_spec(CLUSTER_SPEC)
    assert any(e.startswith("data.tokenizer.model: cannot read '/fsx/") for e in info.value.errors)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(cluster_spec(**{"job.cluster_paths": ["/fsx"]})))
    assert main(["validate", str(path)]) == 0
    notes = capsys.readouterr().err.splitlines()
    assert notes == [f"note: not checked here (under job.cluster_paths): {field} {file}; the job script checks it "
                     "when the job starts" for field, file in (
                         ("data.path", "/fsx/data/corpus_text_document.bin"),
                         ("data.path", "/fsx/data/corpus_text_document.idx"),
                         ("data.tokenizer.model", "/fsx/tokenizers/llama3/tokenizer.json"),
                         ("job.container.image", "/fsx/images/megatron.sqsh"))]


def test_validate_says_when_the_vocabulary_could_not_come_from_a_cluster_tokenizer(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(cluster_spec(**{"model": {"preset": "llama3-8b"}, "job.cluster_paths": ["/fsx"],
                                                   "batch": {"micro": 1, "global": 8}})))
    assert main(["validate", str(path)]) == 0
    assert "note: model.vocab_size 128256 is model.preset's: the tokenizer could not be read here" in \
        capsys.readouterr().err


def test_validate_names_the_files_it_read_here(tmp_path, capsys, hf_dir):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(cluster_spec(**{
        "model": {"preset": "tiny-llama"}, "data.tokenizer.model": str(hf_dir), "job.cluster_paths": ["/fsx/images"]})))
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"note: checked here: data.tokenizer.model {hf_dir}/tokenizer.json" in err
    assert "note: not checked: data.path /fsx/data/corpus_text_document.bin" in err
    assert "note: not checked here (under job.cluster_paths): job.container.image /fsx/images/megatron.sqsh" in err


def test_cluster_paths_are_prefixes_of_whole_path_components():
    job = load_spec({"job": {"cluster_paths": ["/fsx", "/lustre/data/"]}}).job
    assert [job.on_cluster_only(p) for p in ("/fsx", "/fsx/a/b", "/fsx2/a", "/lustre/data/x", "/lustre/other",
                                             "/fsx/../etc/passwd", "data/x")] == [True, True, False, True, False,
                                                                                False, False]
    with pytest.raises(SpecError) as info:
        load_spec({"job": {"cluster_paths": ["fsx"]}})
    assert info.value.errors[0].startswith("job.cluster_paths[0]: 'fsx' is not an absolute path")


def test_the_job_script_checks_cluster_paths_at_start_naming_the_field(tmp_path):
    spec = load_spec(cluster_spec(**{"job.cluster_paths": ["/fsx"]}))
    script = render(spec, "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]
    checks = [line for line in script.splitlines() if line.startswith("[ -e ")]
    assert [shlex.split(line)[2] for line in checks] == ["/fsx/data/corpus_text_document.bin",
                                                         "/fsx/data/corpus_text_document.idx",
                                                         "/fsx/tokenizers/llama3/tokenizer.json",
                                                         "/fsx/images/megatron.sqsh",
                                                         "/fsx/tokenizers/llama3/tokenizer_config.json"]
    # AutoTokenizer.from_pretrained picks the class from either file
    assert "|| [ -e /fsx/tokenizers/llama3/config.json ] ||" in checks[-1]
    assert script.index(checks[-1]) < script.index("\nsrun ")  # before any node starts
    # Run the checks here, where /fsx does not exist: the first stops the script with a message naming its field.
    result = subprocess.run(["bash", "-c", "\n".join(checks)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("labkit: data.path: /fsx/data/corpus_text_document.bin does not exist on ")
    assert "fix data.path in the spec" in result.stderr
    assert "job.cluster_paths" not in render(load_spec(cluster_spec(data={"mock": True}, job=MEGATRON_LM)),
                                             "/runs/RUN/logs", run_id="RUN").scripts["job.sbatch"]


# --- flags given twice -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, field", [(["--split", "98,2,0"], "data.split"), (["--split=98,2,0"], "data.split"),
                                          (["--use-flash-attn", "--seq-length", "128"], "model.seq_length"),
                                          (["--tokenizer-type", "GPT2BPETokenizer"], "data.mock")])
def test_extra_args_repeating_a_rendered_flag_are_refused_naming_both(extra, field):
    spec = {"data": {"path": "/data/x_text_document"} if field == "data.split" else {"mock": True},
            "job": {**MEGATRON_LM, "extra_args": extra}}
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    i = next(i for i, a in enumerate(extra) if a.split("=")[0] in (F.split.name, F.seq_length.name,
                                                                     F.tokenizer_type.name))
    assert info.value.errors == [info.value.errors[0]]
    assert info.value.errors[0].startswith(f"job.extra_args[{i}]: ") and f"set {field} instead" in info.value.errors[0]


def test_extra_args_repeating_an_always_rendered_flag_are_refused():
    with pytest.raises(SpecError) as info:
        load_spec({"job": {"extra_args": [F.log_throughput.name]}})
    assert info.value.errors == ["job.extra_args[0]: '--log-throughput' is on every command line labkit renders; "
                                 "remove it from job.extra_args"]


def test_extra_args_that_render_nothing_twice_are_kept():
    spec = load_spec({"job": {**MEGATRON_LM, "extra_args": ["--use-flash-attn", "--norm-epsilon", "1e-6"]}})
    assert megatron_args(spec)[-3:] == ["--use-flash-attn", "--norm-epsilon", "1e-6"]


def rendered_command_lines() -> dict[str, list[str]]:
    """Every Megatron-LM command line the golden files hold (the job scripts' TRAIN_ARGS and the megatron_args
    files; not the pre-2022 spelling), and each example spec's, rendered for the megatron-lm entrypoint."""
    lines = {}
    for path in sorted((GOLDEN / "jobs").iterdir()):
        if path.name.startswith("deepspeed"):  # labkit's driver under DeepSpeed: Megatron-DeepSpeed's own flags
            continue
        for i, block in enumerate(re.findall(r"TRAIN_ARGS=\(\n(.*?)\n\s*\)", path.read_text(), re.S)):
            lines[f"{path.name}[{i}]"] = shlex.split(block)
    for path in sorted((GOLDEN / "megatron_args").glob("*.txt")):
        if "legacy" not in path.name:
            lines[path.name] = shlex.split(path.read_text().replace("\\\n", " "))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        lines[path.name] = megatron_args(load_spec(with_changes(data, job={**data.get("job", {}), **MEGATRON_LM})))
    return lines


def test_every_rendered_megatron_lm_command_line_has_known_flags_each_once():
    known = catalog.megatron_lm_flags()
    lines = rendered_command_lines()
    assert len(lines) >= 15
    for name, args in lines.items():
        flags = [a for a in args if a.startswith("--")]
        assert set(flags) <= known, (name, sorted(set(flags) - known))
        assert len(flags) == len(set(flags)), (name, sorted(f for f in flags if flags.count(f) > 1))
