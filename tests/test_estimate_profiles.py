"""Profiles: labkit JSON and FASOP .npy through one reader."""
import json

import pytest

from labkit.estimate import (MicroBatchTimes, Profile, ProfileError, available_profiles, find_profile, load_profile,
                             save_profile)
from labkit.paths import data_file

FASOP_DIR = data_file("profiles", "fasop")


def test_every_fasop_file_loads_with_embedding_layers_and_output():
    files = sorted(FASOP_DIR.glob("*.npy"))
    assert len(files) == 18
    for path in files:
        prof = load_profile(path)
        assert prof.tensor in (1, 2, 4) and prof.gpu in ("A10", "A100-40GB")
        assert len(prof.layers_s) in (24, 48) and all(x > 0 for x in prof.layers_s)


def test_fasop_gpt2xl_a10_matches_its_summary():
    prof = load_profile(FASOP_DIR / "gpt2XL_A10_1.npy")
    assert prof.model == "gpt2-xl" and prof.micro_batch == 1
    assert prof.embedding_s == pytest.approx(0.297e-3, rel=1e-3)
    assert prof.output_s == pytest.approx(2.1184e-3, rel=1e-3)
    total = prof.embedding_s + sum(prof.layers_s) + prof.output_s
    assert total == pytest.approx(114.842e-3, rel=1e-4)  # SUMMARY.csv sum_fwd_ms


def test_forward_scales_with_micro_batch_and_slices_layers():
    prof = Profile(model="m", gpu="cpu", tensor=1, embedding_s=1.0, layers_s=[1.0, 2.0, 3.0], output_s=5.0)
    assert prof.forward_s(1, 2, 1) == (5.0, 0.0)
    assert prof.forward_s(0, 1, 4, embedding=True, output=True) == (4.0, 24.0)
    assert prof.forward_s(2, 3, 1)[0] == pytest.approx(3.0 + 2 * 2.0)  # past the end: the measured mean


def test_measured_micro_batch_sizes_are_used_and_interpolated_between():
    # per sequence, micro-batch 4 is twice as fast as 1 (a fixed cost per call, as gloo's all-reduces on a CPU)
    prof = Profile(model="m", gpu="cpu", tensor=2, embedding_s=1.0, layers_s=[4.0, 4.0], output_s=1.0,
                   backward_factor=1.0,
                   other_micro_batches={4: MicroBatchTimes(2.0, [8.0, 8.0], 2.0, backward_factor=2.0)})
    assert prof.forward_s(0, 2, 1) == (8.0, 0.0)
    assert prof.forward_s(0, 2, 4, embedding=True) == (16.0, 2.0)   # measured, not 4 x micro-batch 1
    assert prof.forward_s(0, 2, 2)[0] == pytest.approx(8.0 + (16.0 - 8.0) / 3)  # a third of the way from 1 to 4
    assert prof.forward_s(0, 2, 8)[0] == pytest.approx(32.0)         # beyond: the largest size, scaled
    assert prof.backward_factor_at(1) == 1.0 and prof.backward_factor_at(4) == 2.0
    assert 1.0 < prof.backward_factor_at(2) < 2.0


def test_json_round_trip_and_find(tmp_path):
    prof = Profile(model="tiny", gpu="cpu", tensor=2, embedding_s=0.001, layers_s=[0.01, 0.011], output_s=0.002,
                   micro_batch=2, seq_length=64, precision="fp32", source="test", measured_on="here",
                   extra={"threads": 2}, other_micro_batches={4: MicroBatchTimes(0.002, [0.018, 0.02], 0.004, 1.5)})
    path = save_profile(prof, tmp_path / "tiny_cpu_tp2.json")
    data = json.loads(path.read_text())
    assert data["unit"] == "s" and data["forward_s"]["layers"] == [0.01, 0.011] and data["threads"] == 2
    assert data["other_micro_batches"] == [{"micro_batch": 4, "backward_factor": 1.5, "forward_s": {
        "embedding": 0.002, "layers": [0.018, 0.02], "output": 0.004}}]
    back = load_profile(path)
    assert back == prof
    assert find_profile("tiny", "cpu", 2, directory=tmp_path) == prof
    assert find_profile("tiny", "cpu", 1, directory=tmp_path) is None
    assert ("tiny", "cpu", 2) in available_profiles(tmp_path)


def test_catalog_aliases_resolve_when_finding():
    assert find_profile("gpt2-xl", "A100", 2).gpu == "A100-40GB"


def test_bad_files_name_the_problem(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"model": "m", "gpu": "cpu"}))
    with pytest.raises(ProfileError, match="missing tensor, forward_s"):
        load_profile(bad)
    bad.write_text(json.dumps({"model": "m", "gpu": "cpu", "tensor": 1, "unit": "ms", "forward_s": {"layers": []}}))
    with pytest.raises(ProfileError, match="unit"):
        load_profile(bad)
    bad.write_text(json.dumps({"model": "m", "gpu": "cpu", "tensor": 1, "forward_s": {"layers": [1.0]},
                               "other_micro_batches": [{"micro_batch": 2}]}))
    with pytest.raises(ProfileError, match="other_micro_batches"):
        load_profile(bad)
    bad.write_text(json.dumps({"model": "m", "gpu": "cpu", "tensor": 1, "forward_s": {"layers": [1.0]},
                               "other_micro_batches": [{"micro_batch": 0, "forward_s": {"layers": [1.0]}}]}))
    with pytest.raises(ProfileError, match="other_micro_batches"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no such"):
        load_profile(tmp_path / "missing.json")
