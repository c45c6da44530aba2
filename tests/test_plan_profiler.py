import os

import pytest

from labkit.cli import main
from labkit.estimate import estimate, find_profile, load_profile
from labkit.plan.profiler import cpu_threads
from labkit.spec import load_spec


@pytest.mark.slow
def test_profile_tiny_model_on_this_machine(tmp_path, capsys):
    out = tmp_path / "tiny_cpu_tp1.json"
    assert main(["profile", "--model", "tiny", "--repeats", "2", "--micro-batch", "1,4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "micro-batch 4" in printed
    profile = load_profile(out)
    assert list(profile.other_micro_batches) == [4]
    assert profile.forward_s(0, 2, 4) == (sum(profile.other_micro_batches[4].layers_s), 0.0)  # measured, not scaled
    # each worker had the threads one of training's processes gets here
    assert f" {cpu_threads()} thread" in profile.measured_on and cpu_threads() == max(1, os.cpu_count() // 2)
    assert (profile.model, profile.gpu, profile.tensor, profile.micro_batch) == ("tiny", "cpu", 1, 1)
    assert len(profile.layers_s) == 2 and all(t > 0 for t in profile.layers_s)
    assert profile.embedding_s > 0 and profile.output_s > 0 and profile.backward_factor > 0
    assert profile.seq_length == 64
    # the estimator and planner read it through the same lookup as FASOP's files
    assert find_profile("tiny", "cpu", 1, directory=tmp_path).layers_s == profile.layers_s
    spec = load_spec({"model": {"preset": "tiny"}, "cluster": "laptop", "batch": {"micro": 1, "global": 4}})
    est = estimate(spec, {("cpu", 1): profile})
    assert est.stage_sources == ["profile tiny/cpu/tp1"]


def test_profile_rejects_unknown_model(capsys):
    assert main(["profile", "--model", "tinyy"]) == 2
    err = capsys.readouterr().err
    assert "tinyy" in err and "tiny" in err


def test_cpu_threads_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_threads(2) == 8 and cpu_threads(32) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # as in the job script, a value already set wins
    assert cpu_threads(2) == 3


def test_profile_rejects_bad_sizes_before_starting_workers(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", "tiny", "--micro-batch", "2,0"])
    assert exit_.value.code == 2 and "--micro-batch: '2,0': give sizes of at least 1" in capsys.readouterr().err
    assert main(["profile", "--model", "tiny", "--host-processes", "0"]) == 2
    assert "--host-processes" in capsys.readouterr().err


def test_profile_passes_take_the_micro_batch_sizes_in_turn():
    """A slow spell of a shared machine slows every micro-batch size alike: each round runs one pass of every size,
    and each size's entry is the median of its own passes."""
    import time
    import types

    import torch

    from labkit.plan import profiler

    order, spans, output_start = [], {}, []

    class Layered(torch.nn.Module):  # stands for GPTModel with the profiler's hooks, which fill spans
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def forward(self, tokens, position_ids, attention_mask, labels):
            micro = tokens.shape[0]
            order.append(micro)
            for name in ("embedding", "layer0", "layer1", "final_norm"):
                spans.setdefault(name, []).append(1e-3 * micro)
            output_start.append(time.perf_counter())
            return self.weight * tokens.float()

    args = types.SimpleNamespace(seq_length=4, padded_vocab_size=16)
    measured = profiler._time_passes(Layered(), output_start, spans, lambda: None, torch.device("cpu"), args,
                                     [1, 2, 4], repeats=3, warmup=1)
    assert order == [1, 2, 4] * 4
    assert [entry["layers"] for entry in measured] == [[1e-3] * 2, [2e-3] * 2, [4e-3] * 2]
    assert [entry["embedding"] for entry in measured] == [1e-3, 2e-3, 4e-3]
