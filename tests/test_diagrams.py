import xml.etree.ElementTree as ET

import pytest

from labkit import diagrams
from labkit.estimate import Pipeline, pipeline_time
from labkit.estimate.recompute import stored_activations
from labkit.estimate.timing import bubble_fraction
from labkit.paths import course_dir, example
from labkit.spec import load_spec


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 4), (3, 7), (1, 3)])
def test_1f1b_bubble_matches_the_closed_form(stages, micro_batches):
    ops = diagrams.pipeline_schedule(stages, micro_batches)
    # (p - 1) / (m + p - 1) with backward = 2 x forward (Narayanan et al. 2021, section 2.2)
    assert bubble_fraction(ops) == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    assert max(op.end_s for op in ops) == pytest.approx(3 * (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches,chunks", [(4, 8, 2), (2, 4, 2), (4, 12, 3), (2, 2, 4)])
def test_interleaving_divides_the_bubble_by_the_chunk_count(stages, micro_batches, chunks):
    ops = diagrams.pipeline_schedule(stages, micro_batches, chunks)
    bubble = (stages - 1) / chunks
    assert bubble_fraction(ops) == pytest.approx(bubble / (micro_batches + bubble))


def test_the_drawn_schedule_is_the_estimators():
    for chunks in (1, 2):
        ops = diagrams.pipeline_schedule(4, 8, chunks)
        assert ops == Pipeline((3.0,) * 4, (0.0,) * 3, 8, chunks, overlap_sends=True).events()
        assert max(op.end_s for op in ops) == pytest.approx(pipeline_time([3.0] * 4, [0.0] * 3, 8, chunks).total_s)
        # gloo's blocking pairs shift operations but, over equal stages, not the step's end (SC21's bubble)


def test_schedule_respects_dependencies_and_runs_every_op_once():
    stages, micro_batches, chunks = 4, 8, 2
    ops = diagrams.pipeline_schedule(stages, micro_batches, chunks)
    assert len(ops) == 2 * stages * micro_batches * chunks
    end = {(op.op, op.chunk * stages + op.stage, op.micro_batch): op.end_s for op in ops}
    start = {(op.op, op.chunk * stages + op.stage, op.micro_batch): op.start_s for op in ops}
    assert len(start) == len(ops)
    for (kind, virtual, mb), t in start.items():
        if kind == "forward" and virtual > 0:
            assert t >= end[("forward", virtual - 1, mb)]
        if kind == "backward":
            assert t >= end[("forward", virtual, mb)]
            if virtual < stages * chunks - 1:
                assert t >= end[("backward", virtual + 1, mb)]
    for stage in range(stages):  # a stage runs one op at a time
        mine = sorted((op.start_s, op.end_s) for op in ops if op.stage == stage)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(mine, mine[1:]))


def test_interleaved_schedule_rejects_micro_batches_not_a_multiple_of_stages():
    with pytest.raises(ValueError, match="multiple of stages"):
        diagrams.pipeline_schedule(4, 6, 2)


def test_stored_activations_by_recompute_mode():
    assert stored_activations(4, None) == ["all"] * 4
    assert stored_activations(4, "full", "uniform", 2) == ["input", "inner", "input", "inner"]
    assert stored_activations(4, "full", "block", 1) == ["input", "all", "all", "all"]
    assert stored_activations(3, "selective") == ["no-attention"] * 3
    with pytest.raises(ValueError, match="granularity"):
        stored_activations(4, "full", "sideways")


def test_heterogeneous_pipeline_is_drawn_from_the_spec():
    spec = load_spec(example("gpt2-xl-hetero.yaml"))
    svg = diagrams.heterogeneous_pipeline_svg(spec)
    texts = [t.text for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")]
    assert 'PARTITION="0-11-8-8-8-8-5-0"' in texts[0]
    assert texts.count("A100-40GB") == 2  # stage 0's label and the legend
    assert texts.count("A10") == 8  # stages 1..7 and the legend
    assert "11 layers" in texts


def test_every_diagram_is_well_formed_svg():
    for name, text in diagrams.diagrams().items():
        root = ET.fromstring(text)
        assert root.tag == "{http://www.w3.org/2000/svg}svg", name
        assert float(root.get("width")) > 100 and float(root.get("height")) > 100


def test_regenerating_images_gives_identical_files(tmp_path):
    first = {p.name: p.read_bytes() for p in diagrams.write_diagrams(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in diagrams.write_diagrams(tmp_path / "b")}
    assert first == second
    committed = {name: (course_dir("images") / name).read_bytes() for name in first}
    assert committed == first, "images/ is stale: run `labkit diagrams --out images`"


def test_show_displays_a_committed_diagram():
    shown = diagrams.show("zero_stages")
    assert "ZeRO-3" in shown.data
