import pytest

from labkit.cli import main
from labkit.estimate import estimate, find_profile, load_profile
from labkit.spec import load_spec


@pytest.mark.slow
def test_profile_tiny_model_on_this_machine(tmp_path, capsys):
    out = tmp_path / "tiny_cpu_tp1.json"
    assert main(["profile", "--model", "tiny", "--repeats", "2", "--output", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    profile = load_profile(out)
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
