"""The estimator against published Megatron-LM runs on A100 (labkit/data/published_runs.yaml)."""
import pytest

from labkit.estimate import default_calibration
from labkit.estimate.published import published_runs, published_table
from labkit.megatron.flops import model_flops
from labkit.megatron.shape import Shape


@pytest.fixture(scope="module")
def table():
    return published_table()


def test_every_published_run_becomes_a_valid_spec_of_its_paper():
    runs = published_runs()
    assert {r.set for r in runs} == {"sc21", "korthikanti2022", "mt-nlg", "megatron-core-h100",
                                     "megatron-bridge-h100", "megatron-bridge-25.11-moe-blackwell",
                                     "nemo-mixtral-blackwell", "nemo-dense-blackwell", "pytorch-native-h200",
                                     "nemo-long-context-h100", "nemo-automodel-h100"}
    assert {r.set for r in runs if r.held_out} == {"korthikanti2022", "mt-nlg", "nemo-dense-blackwell",
                                                   "nemo-automodel-h100"}
    assert {r.set for r in runs if r.dev} == {"megatron-bridge-25.11-moe-blackwell", "nemo-mixtral-blackwell",
                                              "nemo-long-context-h100"}
    trillion = next(r for r in runs if r.label.startswith("1008B"))
    assert (trillion.spec.parallel.tensor, trillion.spec.parallel.pipeline, trillion.spec.data_parallel) == (8, 64, 6)
    assert trillion.spec.num_micro_batches == 3072 // 6
    held_out = [r for r in runs if r.set == "korthikanti2022"]
    assert all(r.spec.parallel.sequence_parallel and r.spec.recompute.granularity == "selective" for r in held_out)


def test_held_out_runs_are_predicted_within_ten_percent(table):
    held_out = table[table["set"] == "korthikanti2022"]
    assert len(held_out) == 4
    assert held_out["error"].abs().max() < 0.10, held_out[["run", "measured", "predicted"]]
    # the README's model FLOPs utilisation of these runs, 41.5 to 56.3 %, is reproduced the same way
    assert held_out["mfu"].between(0.35, 0.60).all()


def test_sc21_runs_are_predicted_with_a_median_error_below_ten_percent(table):
    sc21 = table[table["set"] == "sc21"]
    assert len(sc21) == 10
    assert sc21["error"].abs().median() < 0.10


def test_a_calibration_moves_the_published_predictions():
    cal = default_calibration()
    slower = cal.with_efficiency("A100-80GB", cal.gpu_efficiency("A100-80GB") / 2)
    default, halved = published_table(), published_table(calibration=slower)
    assert (halved["predicted"][default["figure"] == "tflops_per_gpu"]
            < 0.8 * default["predicted"][default["figure"] == "tflops_per_gpu"]).all()
    assert published_table()["predicted"].tolist() == default["predicted"].tolist()


def test_megatron_core_h100_runs_are_predicted_within_ten_percent_median(table):
    """The FP8 runs of NVIDIA's performance summaries, NeMo's and Megatron-Bridge's each with its own stack: tokens
    per second per GPU turned into seconds per iteration."""
    h100 = table[table["set"].isin(["megatron-core-h100", "megatron-bridge-h100"])]
    assert len(h100) == 17 and (h100["figure"] == "iteration_time_s").all()
    llama3_70b = next(r for r in published_runs() if r.label == "Bridge 25.11 Llama 3 70B")
    assert llama3_70b.measured == pytest.approx(128 * 8192 / (1602 * 64))
    assert llama3_70b.spec.precision == "fp8" and llama3_70b.spec.parallel.virtual_stages == 5
    assert h100["error"].abs().median() < 0.10 and h100["error"].abs().max() < 0.20


def test_blackwell_dense_runs_are_predicted_within_eight_percent(table):
    """Megatron-Bridge 25.11's dense Llama rows on B200, GB200 and GB300, to which (with 26.02-26.06's) each GPU's FP8
    share of its peak was fitted (benchmarks/bench_blackwell_fit.py): GB300 and GB200 have the same peaks in the
    catalog, and GB300 measured 1.19 x GB200 on the same layout, so its share is the larger."""
    rows = table[(table["set"] == "megatron-bridge-25.11-moe-blackwell") & table["run"].str.contains("Llama")]
    assert len(rows) == 9
    assert rows["error"].abs().max() < 0.08, rows[["run", "measured", "predicted"]]
    cal = default_calibration()
    assert cal.fp8_efficiency["GB300"] > max(cal.fp8_efficiency["B200"], cal.fp8_efficiency["GB200"])


def test_nemo_blackwell_dense_runs_nothing_was_fitted_to_are_predicted_within_twelve_percent(table):
    """NeMo 25.02's B200 and 25.04's GB200 dense rows (GPT-3 175B, Llama 3 8B to 3.1 405B), with the megatron-core
    stack of their release: the Blackwell FP8 efficiencies were fitted to Megatron-Bridge's rows, not to these."""
    rows = table[table["set"] == "nemo-dense-blackwell"]
    assert len(rows) == 7 and rows["fits"].all()
    gb200_8b = rows[rows["run"] == "NeMo 25.04 GB200 Llama 3 8B"].iloc[0]
    assert gb200_8b["measured"] == pytest.approx(128 * 8192 / (33099 * 8))  # 33,099 tokens/s a GPU on 8 GB200
    assert rows["error"].abs().median() < 0.06 and rows["error"].abs().max() < 0.12, rows[["run", "error"]]


def test_every_published_run_fits_in_the_memory_it_trained_in(table):
    # each of these layouts trained on its GPUs, so the memory estimate must admit it (Megatron-Bridge's FSDP rows
    # through their ZeRO stage, NeMo's FP8 recipes through their bf16 gradient reduction)
    misfits = table[~table["fits"]]
    assert misfits.empty, misfits[["set", "run", "peak_gib"]].to_string()


def test_context_parallel_runs_up_to_a_million_tokens_are_predicted_within_eight_percent(table):
    """NeMo's Llama 2 7B long-sequence runs on H100 (4K to 1M tokens, context parallel up to 32): nothing was fitted to
    them. Their TFLOP/s count every attention score, so a 1M-token row's step is what those FLOPs take at that rate."""
    rows = table[table["set"] == "nemo-long-context-h100"]
    assert len(rows) == 9
    assert rows["error"].abs().max() < 0.08 and rows["fits"].all()
    million = next(r for r in published_runs() if r.label.endswith("1M CP 32"))
    assert (million.spec.parallel.context, million.spec.model.seq_length) == (32, 2 ** 20)
    assert million.measured == pytest.approx(model_flops(Shape.of(million.spec.model), 128) / (536e12 * 1024))
