"""labkit.profiling.nsys and `labkit profile nsys` on small SQLite files laid out as `nsys export --type sqlite`
writes them (NVIDIA's "SQLite Export Schema Reference": the CUPTI activity tables, NVTX_EVENTS, StringIds), with
answers worked out by hand."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from labkit.profiling import nsys

MS = 1_000_000  # the tables' times are nanoseconds
GEMM = "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn"
FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
         "cutlass::bfloat16_t>>")
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SEND_RECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
CUSTOM = "my_custom_kernel"

SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, demangledName INT NOT NULL,
    shortName INT NOT NULL, mangledName INT, gridX INT NOT NULL DEFAULT 1, blockX INT NOT NULL DEFAULT 128);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, bytes INT NOT NULL,
    copyKind INT NOT NULL, srcKind INT, dstKind INT);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, value INT NOT NULL,
    bytes INT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT, category INT,
    color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT);
"""


def rank0(path):
    """Iterations 3 and 4 over 1-21 ms, kernels on a compute stream (7) and NCCL's (13), copies and a memset."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    names = [GEMM, FLASH, ELEMENTWISE, ALL_REDUCE, SEND_RECV, CUSTOM, "iteration 3", "forward"]
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", enumerate(names, 1))
    kernels = [(0, 0.5, 1, 7), (1, 3, 1, 7), (3, 4, 2, 7), (4, 4.5, 3, 7), (3.5, 6, 4, 13), (9, 10, 5, 13),
               (12, 14, 6, 7), (20, 22, 1, 7)]  # (start ms, end ms, name id, stream)
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, "
                   "demangledName, shortName) VALUES (?, ?, 0, 1, ?, ?, ?)",
                   [(int(s * MS), int(e * MS), stream, name, name) for s, e, name, stream in kernels])
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, streamId, bytes, "
                   "copyKind) VALUES (?, ?, 0, 1, 7, 4096, ?)", [(14 * MS, 15 * MS, 1), (15 * MS, int(15.5 * MS), 10)])
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET (start, end, deviceId, contextId, streamId, value, bytes) "
               "VALUES (?, ?, 0, 1, 7, 0, 64)", (16 * MS, int(16.2 * MS)))
    # ranges named by textId (registered strings) and by text; a mark (eventType 34) that is no range
    ranges = [(1, 11, None, 7), (1, 3, None, 8), (3, 7, "backward", None), (7, 9, "optimizer", None),
              (11, 21, "iteration 4", None), (11, 13, "forward", None), (13, 17, "backward", None)]
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId) VALUES (?, ?, 59, ?, ?)",
                   [(s * MS, e * MS, text, text_id) for s, e, text, text_id in ranges])
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text) VALUES (?, NULL, 34, 'mark')", (2 * MS,))
    db.commit()
    db.close()


def rank1(path):
    """A capture without NVTX, copies or memsets (nsys creates tables lazily): a GEMM and an all-reduce."""
    db = sqlite3.connect(path)
    db.executescript(";".join(statement for statement in SCHEMA.split(";")
                              if "KERNEL" in statement or "StringIds" in statement) + ";")
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, GEMM), (2, ALL_REDUCE)])
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, "
                   "demangledName, shortName) VALUES (?, ?, 1, 1, ?, ?, ?)",
                   [(0, 4 * MS, 7, 1, 1), (2 * MS, 6 * MS, 13, 2, 2)])
    db.commit()
    db.close()


@pytest.fixture
def reports(tmp_path):
    directory = tmp_path / "nsys"
    directory.mkdir()
    rank1(directory / "rank1.sqlite")
    rank0(directory / "rank0.sqlite")
    return directory


def test_kernel_names_fall_in_their_classes():
    assert [nsys.kernel_class(n) for n in (GEMM, FLASH, ELEMENTWISE, ALL_REDUCE, SEND_RECV, CUSTOM)] == \
        ["gemm", "attention", "elementwise", "collective", "p2p", "other"]
    assert nsys.kernel_class("ncclKernel_AllGather_RING_LL_Sum_int8_t") == "collective"
    assert nsys.kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"  # cuBLAS on Hopper
    assert nsys.kernel_class("fmha_cutlassB_f16_aligned_64x64_k64_sm80") == "attention"  # memory-efficient SDPA


def test_time_per_class_inside_the_captured_iterations(reports):
    loaded = nsys.load_reports(reports)
    assert [r.rank for r in loaded] == [0, 1]
    assert nsys.window(loaded[0]) == (1 * MS, 21 * MS)  # iteration 3's start to iteration 4's end
    table = nsys.kernel_time(loaded).set_index(["rank", "class"])
    # the GEMM before the window is out, the one across its end counts up to it
    expected = {"gemm": 3.0, "attention": 1.0, "elementwise": 0.5, "collective": 2.5, "p2p": 1.5, "memory": 1.2,
                "other": 2.0}
    assert {cls: pytest.approx(table.loc[(0, cls), "time_ms"]) for cls in expected} == expected
    assert table.loc[(0, "p2p"), "count"] == 2  # the SendRecv kernel and the peer-to-peer copy
    assert table.loc[(0, "gemm"), "share"] == pytest.approx(3.0 / 11.7)
    assert table.loc[(1, "gemm"), "time_ms"] == 4.0 and table.loc[(1, "collective"), "time_ms"] == 4.0


def test_compute_against_communication_per_rank(reports):
    split = nsys.overlap(nsys.load_reports(reports)).set_index("rank")
    assert split.loc[0].to_dict() == pytest.approx({
        "window_ms": 20.0, "compute_ms": 7.7, "communication_ms": 4.0, "overlap_ms": 1.0,
        "exposed_communication_ms": 3.0, "idle_ms": 9.3, "overlap_share": 0.25})
    assert split.loc[1].to_dict() == pytest.approx({
        "window_ms": 6.0, "compute_ms": 4.0, "communication_ms": 4.0, "overlap_ms": 2.0,
        "exposed_communication_ms": 2.0, "idle_ms": 0.0, "overlap_share": 0.5})


def test_the_captured_steps_come_from_the_drivers_nvtx_ranges(reports):
    table = nsys.steps(nsys.load_reports(reports))
    assert table.to_dict(orient="records") == [
        {"rank": 0, "iteration": 3, "start_ms": 0.0, "duration_ms": 10.0, "forward_ms": 2.0, "backward_ms": 4.0,
         "optimizer_ms": 2.0},
        {"rank": 0, "iteration": 4, "start_ms": 10.0, "duration_ms": 10.0, "forward_ms": 2.0, "backward_ms": 4.0,
         "optimizer_ms": 0.0}]  # rank 1 named no iterations


def test_the_figure_has_a_bar_per_class_and_per_part_of_the_window(reports):
    fig = nsys.figure(nsys.load_reports(reports))
    assert [t.name for t in fig.data] == [*nsys.CLASSES, *nsys.SPLIT_COLORS]
    exposed = next(t for t in fig.data if t.name == "exposed communication")
    assert list(exposed.y) == ["rank 0", "rank 1"] and list(exposed.x) == pytest.approx([3.0, 2.0])


def test_what_cannot_be_read_says_why(tmp_path):
    with pytest.raises(ValueError, match=r"a report, not its SQLite export; run `nsys export --type sqlite"):
        nsys.load(tmp_path / "rank0.nsys-rep")
    empty = tmp_path / "rank0.sqlite"
    sqlite3.connect(empty).executescript("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);")
    with pytest.raises(ValueError, match="no CUPTI_ACTIVITY_KIND_KERNEL table"):
        nsys.load(empty)
    (tmp_path / "nothing-here").mkdir()
    with pytest.raises(FileNotFoundError, match="no .sqlite reports"):
        nsys.load_reports(tmp_path / "nothing-here")


def test_the_command_prints_each_rank_and_its_json_holds_the_tables(reports, tmp_path):
    run = [sys.executable, "-m", "labkit", "profile", "nsys", str(reports)]
    text = subprocess.run(run + ["--html", str(tmp_path / "fig.html")], capture_output=True, text=True, check=True)
    assert "rank 0: 20.000 ms captured" in text.stdout
    assert "communication 4.000 ms of which 1.000 ms under compute (25.0%), exposed 3.000 ms" in text.stdout
    assert "iteration 3: 10.000 ms (forward 2.000, backward 4.000, optimizer 2.000)" in text.stdout
    assert (tmp_path / "fig.html").stat().st_size > 0
    data = json.loads(subprocess.run(run + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert set(data) == {"reports", "kernel_time", "overlap", "steps"} and len(data["steps"]) == 2
    bad = subprocess.run(run[:-1] + [str(tmp_path / "missing.sqlite")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("labkit profile nsys: ")
    per_layer = subprocess.run(run[:4] + ["--help"], capture_output=True, text=True, check=True)
    assert "--model" in per_layer.stdout  # the per-layer profiler keeps its own command line
    assert "nsys" in per_layer.stdout
    neither = subprocess.run(run[:4], capture_output=True, text=True)
    assert neither.returncode == 2 and "--model" in neither.stderr and "labkit profile nsys" in neither.stderr
