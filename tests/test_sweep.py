"""Sweeps: chunks with deterministic seeds on a real Dask LocalCluster, sinter CSV, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sinter = pytest.importorskip("sinter")
distributed = pytest.importorskip("distributed", reason="needs dask[distributed] (pip install 'qlink[dask]')")

from qlink.sweep import (  # noqa: E402
    CsvAppender,
    KvGrid,
    QecGrid,
    SweepError,
    chunk_of,
    chunk_seed,
    pending_chunks,
    read_done_chunks,
    run_sweep,
)
from qlink.sweep._run import _local_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRID = QecGrid(distances=(3, 5), ps=(0.005, 0.01), num_shots=1200, chunk_shots=300)  # 4 tasks x 4 chunks


def _rows(path) -> set:
    """Every row as (strong_id, chunk, shots, errors, discards, other custom counts)."""
    import csv

    out = []
    with open(path) as f:
        r = csv.DictReader(f)
        r.fieldnames = [x.strip() for x in r.fieldnames]
        for row in r:
            custom = json.loads(row["custom_counts"] or "{}")
            chunk = chunk_of(custom)
            rest = tuple(sorted((k, v) for k, v in custom.items() if not k.startswith("chunk_")))
            out.append((row["strong_id"], chunk, int(row["shots"]), int(row["errors"]), int(row["discards"]), rest))
    assert len(out) == len(set(out)), "duplicate rows"
    return set(out)


@pytest.fixture(scope="module")
def client():
    cluster = _local_cluster(2)
    c = distributed.Client(cluster)
    c.wait_for_workers(2, timeout=60)
    yield c
    c.close()
    cluster.close()


# ------------------------------------------------------------------ no cluster


def test_chunk_seeds_depend_on_task_and_chunk_only():
    tasks = GRID.tasks()
    again = QecGrid(distances=(3, 5), ps=(0.005, 0.01), num_shots=1200, chunk_shots=300).tasks()
    assert [t.strong_id for t in tasks] == [t.strong_id for t in again]
    seeds = {t.seed(c) for t in tasks for c in range(t.num_chunks)}
    assert len(seeds) == 16
    assert tasks[0].seed(2) == chunk_seed(tasks[0].strong_id, 2)
    # strong ids are sinter's: the same Task computed by sinter directly agrees
    assert len({t.strong_id for t in tasks}) == 4 and all(len(t.strong_id) == 64 for t in tasks)
    # the chunk size is not part of the task's identity
    assert QecGrid(distances=(3,), ps=(0.005,), chunk_shots=7).tasks()[0].strong_id == tasks[0].strong_id
    with pytest.raises(ValueError, match="chunk"):
        chunk_seed("x", -1)


def test_auto_chunk_size_aims_for_the_target_on_the_slowest_point():
    from qlink.sweep._chunking import auto_chunk_shots, nice_floor

    grid = QecGrid(distances=(3, 5), ps=(0.002, 0.005), num_shots=10**7, chunk_shots=1)
    choice = auto_chunk_shots(grid, target_s=0.05)
    assert choice.basis == "measured" and (choice.probed["d"], choice.probed["p"]) == (5, 0.005)
    assert choice.chunk_shots == nice_floor(choice.chunk_shots)  # 1, 2 or 5 x 10^k
    est_s = choice.chunk_shots * choice.seconds_per_shot
    assert 0.05 / 2.5 < est_s <= 0.05 * 1.0001  # rounded down to a nice number: within 2.5x below the target
    assert "5" in choice.describe() and "shots" in choice.describe()


def test_auto_chunk_size_keeps_every_worker_busy_and_follows_the_csv(tmp_path):
    from qlink.sweep._chunking import auto_chunk_shots

    small = QecGrid(distances=(3,), ps=(0.002, 0.005), num_shots=400, chunk_shots=1)
    assert auto_chunk_shots(small, num_workers=2).chunk_shots == 200  # 800 shots in all: 2 chunks a worker
    path = tmp_path / "s.csv"
    task = QecGrid(distances=(3,), ps=(0.005,), num_shots=900, chunk_shots=300).tasks()[0]
    with CsvAppender(path) as out:
        out.append(strong_id=task.strong_id, decoder=task.decoder, json_metadata=task.json_metadata, chunk=0,
                   counts={"shots": 300, "errors": 1, "discards": 0, "seconds": 0.1})
    again = auto_chunk_shots(small, csv_path=path)  # the file fixes it: its chunks hold 300 shots
    assert (again.chunk_shots, again.basis) == (300, "csv")
    with pytest.raises(ValueError, match="target_s"):
        auto_chunk_shots(small, target_s=0)


@pytest.mark.timeout(300)
def test_run_sweep_sizes_its_chunks_while_the_cluster_starts_and_a_rerun_keeps_the_size(tmp_path):
    small = QecGrid(distances=(3,), ps=(0.002, 0.005), num_shots=400, chunk_shots=1)
    path = tmp_path / "auto.csv"
    res = run_sweep(small, csv_path=path, num_workers=2, progress=False, auto_chunks=True)
    assert res.complete and res.chunk_choice.basis == "measured" and res.chunk_choice.chunk_shots == 200
    assert res.chunks_total == 4 and {r[-1] for r in _shots_by_chunk(path)} == {200}
    again = run_sweep(small, csv_path=path, num_workers=2, progress=False, auto_chunks=True)
    assert (again.chunk_choice.basis, again.chunk_choice.chunk_shots, again.chunks_run) == ("csv", 200, 0)
    with pytest.raises(TypeError, match="QecGrid"):
        run_sweep(KvGrid(tokens=(64,), transports=("inproc",)), csv_path=tmp_path / "kv.csv", auto_chunks=True)


def _shots_by_chunk(path) -> list[tuple]:
    import csv

    with open(path) as f:
        return [(row["strong_id"].strip(), int(row["shots"])) for row in csv.DictReader(f, skipinitialspace=True)]


def test_cli_chunk_shots_is_auto_unless_given():
    from qlink._argparse import Parser
    from qlink.sweep.cli import add_arguments

    p = Parser(prog="qlink sweep")
    add_arguments(p)
    assert p.parse_args(["qec"]).chunk_shots == "auto"
    assert p.parse_args(["qec", "--chunk-shots", "5000"]).chunk_shots == 5000
    with pytest.raises(SystemExit):
        p.parse_args(["qec", "--chunk-shots", "0"])


def test_grid_validation_names_what_is_wrong():
    with pytest.raises(ValueError, match="unknown decoder"):
        QecGrid(decoders=("nope",)).tasks()
    with pytest.raises(ValueError, match="transports"):
        QecGrid(transports=("carrier-pigeon",)).tasks()
    with pytest.raises(ValueError, match="chunk_shots"):
        QecGrid(chunk_shots=0).tasks()
    with pytest.raises(ValueError, match="distance"):
        QecGrid(distances=(1,)).tasks()
    with pytest.raises(ValueError, match="preset"):
        KvGrid(preset="gpt-17").tasks()
    with pytest.raises(TypeError, match="QecGrid"):
        run_sweep(42, csv_path="unused.csv")


def test_pending_chunks_round_robin_and_chunk_size_mismatch():
    a, b = QecGrid(distances=(3,), ps=(0.005, 0.01), num_shots=300, chunk_shots=100).tasks()
    todo = pending_chunks([a, b], {a.strong_id: {1: 100}})
    # round-robin over the chunk indices, the costlier point (p = 0.01) first in each round
    assert [(t.strong_id == a.strong_id, c) for t, c in todo] == [(False, 0), (True, 0), (False, 1), (False, 2),
                                                                  (True, 2)]
    big, small = QecGrid(distances=(3, 5), ps=(0.005,), num_shots=200, chunk_shots=100).tasks()[::-1]
    assert big.json_metadata["d"] == 5
    assert [t.json_metadata["d"] for t, _ in pending_chunks([small, big], {})] == [5, 3, 5, 3]
    with pytest.raises(SweepError, match="chunk size"):
        pending_chunks([a, b], {a.strong_id: {1: 250}})


def test_csv_cut_line_duplicates_and_foreign_files(tmp_path):
    path = tmp_path / "s.csv"
    counts = {"shots": 10, "errors": 1, "discards": 0, "seconds": 0.5, "custom_counts": {"failed": 2}}
    with CsvAppender(path) as out:
        out.append(strong_id="t1", decoder="d", json_metadata={"d": 3}, chunk=0, counts=counts)
        out.append(strong_id="t1", decoder="d", json_metadata={"d": 3}, chunk=3, counts=counts)
        with pytest.raises(SweepError, match="another sweep"):
            CsvAppender(path).__enter__()
    good = path.read_bytes()
    path.write_bytes(good + b"        10,         1,         0,    0.5,d,t1,")  # killed mid-append
    done = read_done_chunks(path)
    assert done.chunks == {"t1": {0: 10, 3: 10}} and done.truncated_nbytes > 0
    assert path.read_bytes() == good
    (stats,) = sinter.read_stats_from_csv_files(path)
    assert (stats.shots, stats.errors, stats.custom_counts["failed"], stats.custom_counts["chunk_3"]) == (20, 2, 4, 1)
    # a row from another tool (no chunk key) is counted as foreign, not as a chunk
    with open(path, "a") as f:
        f.write(sinter.TaskStats(strong_id="t2", decoder="d", json_metadata=None, shots=5).to_csv_line() + "\n")
    assert read_done_chunks(path).foreign_rows == 1
    with open(path, "a") as f:
        f.write(good.decode().splitlines()[1] + "\n")
    with pytest.raises(SweepError, match="appears twice"):
        read_done_chunks(path)
    other = tmp_path / "other.csv"
    other.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(SweepError, match="not a sinter CSV"):
        read_done_chunks(other)


# ------------------------------------------------------------------ on Dask


@pytest.mark.timeout(180)
def test_interrupted_and_resumed_equals_one_go(client, tmp_path):
    one = tmp_path / "one.csv"
    res = run_sweep(GRID, csv_path=one, client=client, progress=False)
    assert (res.chunks_total, res.chunks_run, res.chunks_left, res.num_workers) == (16, 16, 0, 2)

    parts = tmp_path / "parts.csv"
    first = run_sweep(GRID, csv_path=parts, client=client, progress=False, max_chunks=5)
    assert (first.chunks_run, first.chunks_left) == (5, 11)
    assert len(_rows(parts)) == 5
    second = run_sweep(GRID, csv_path=parts, client=client, progress=False, max_chunks=4)
    assert (second.chunks_before, second.chunks_run, second.chunks_left) == (5, 4, 7)
    third = run_sweep(GRID, csv_path=parts, client=client, progress=False)
    assert (third.chunks_before, third.chunks_run, third.chunks_left) == (9, 7, 0)
    again = run_sweep(GRID, csv_path=parts, client=client, progress=False)
    assert again.chunks_run == 0 and again.complete

    assert _rows(parts) == _rows(one)
    rows = _rows(one)
    assert {(sid, c) for sid, c, *_ in rows} == {(t.strong_id, c) for t in GRID.tasks() for c in range(4)}
    assert all(shots == 300 for _, _, shots, *_ in rows)
    merged = {s.strong_id: (s.shots, s.errors, s.json_metadata) for s in sinter.read_stats_from_csv_files(one)}
    assert merged == {s.strong_id: (s.shots, s.errors, s.json_metadata)
                      for s in sinter.read_stats_from_csv_files(parts)}
    assert all(shots == 1200 for shots, _, _ in merged.values())
    # more errors at the higher physical error rate, for every distance
    by = {(m["d"], m["p"]): e for _, e, m in merged.values()}
    assert by[(3, 0.01)] > by[(3, 0.005)] and by[(5, 0.01)] > by[(5, 0.005)]

    # growing the grid later adds only the new chunks
    bigger = QecGrid(distances=(3, 5), ps=(0.005, 0.01), num_shots=1500, chunk_shots=300)
    more = run_sweep(bigger, csv_path=parts, client=client, progress=False)
    assert (more.chunks_before, more.chunks_run) == (16, 4)
    with pytest.raises(SweepError, match="chunk size"):
        run_sweep(QecGrid(distances=(3, 5), ps=(0.005, 0.01), num_shots=1200, chunk_shots=400), csv_path=parts,
                  client=client, progress=False)


@pytest.mark.timeout(180)
def test_failing_chunks_are_reported_after_the_others_are_written(client, tmp_path):
    from qlink.sweep import SweepTask

    good = QecGrid(distances=(3,), ps=(0.01,), num_shots=600, chunk_shots=200)
    spec = dict(good.tasks()[0].work["source"], noise="exotic")  # the worker's build_source refuses it
    bad = SweepTask(strong_id="bad-task", decoder="pymatching@offline", json_metadata={"noise": "exotic"},
                    work={"kind": "qec", "source": spec, "decoder": "pymatching", "transport": "offline"},
                    chunk_shots=200, num_chunks=2)
    path = tmp_path / "f.csv"
    with pytest.raises(SweepError, match="2 chunk\\(s\\) failed.*noise model") as info:
        run_sweep([good, bad], csv_path=path, client=client, progress=False)
    res = info.value.result
    assert (res.chunks_run, res.chunks_left, len(res.failures)) == (3, 2, 2)
    assert {sid for sid, *_ in _rows(path)} == {good.tasks()[0].strong_id} and len(_rows(path)) == 3


@pytest.mark.timeout(180)
def test_both_workers_run_chunks(client, tmp_path):
    from distributed import get_task_stream

    with get_task_stream(client) as ts:
        run_sweep(GRID, csv_path=tmp_path / "s.csv", client=client, progress=False)
    workers = {t["worker"] for t in ts.data if str(t.get("key", "")).startswith("qlink-sweep")}
    assert len(workers) == 2


@pytest.mark.timeout(240)
def test_wire_path_chunk_matches_direct_decoding(client, tmp_path):
    grid = QecGrid(distances=(3,), ps=(0.01,), transports=("tcp",), num_shots=300, chunk_shots=300)
    res = run_sweep(grid, csv_path=tmp_path / "w.csv", client=client, progress=False)
    assert res.transports_used == {"tcp": "tcp"}
    ((sid, chunk, shots, errors, discards, rest),) = _rows(tmp_path / "w.csv")
    assert (chunk, shots, discards) == (0, 300, 0) and errors > 0
    assert dict(rest).get("offline_mismatches", 0) == 0 and dict(rest).get("failed", 0) == 0


@pytest.mark.timeout(240)
def test_kv_grid_moves_real_blocks(client, tmp_path):
    grid = KvGrid(tokens=(64, 256), transports=("shm",), preset="tiny", num_transfers=4, chunk_transfers=4,
                  budget_ms=1e-3)  # an impossible 1 us budget: every transfer misses it
    res = run_sweep(grid, csv_path=tmp_path / "kv.csv", client=client, progress=False)
    assert res.complete and res.transports_used == {"shm": "shm"}
    stats = {s.json_metadata["tokens"]: s for s in sinter.read_stats_from_csv_files(tmp_path / "kv.csv")}
    for n, s in stats.items():
        assert (s.shots, s.errors, s.decoder) == (4, 4, "kv@shm")
        assert s.custom_counts["transfer_us"] > 0
        assert sum(v for k, v in s.custom_counts.items() if k.startswith("us_log2_")) == 4
    assert stats[256].custom_counts["kv_bytes"] == 4 * stats[64].custom_counts["kv_bytes"]


@pytest.mark.timeout(120)
def test_default_local_cluster(tmp_path):
    grid = QecGrid(distances=(3,), ps=(0.01,), num_shots=400, chunk_shots=200)
    res = run_sweep(grid, csv_path=tmp_path / "d.csv", num_workers=2, progress=False)
    assert res.num_workers == 2 and res.scheduler.startswith("tcp://127.0.0.1:") and res.complete
    assert len(_rows(tmp_path / "d.csv")) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_cli_sweep_resumes_to_the_same_rows(client, tmp_path):
    # chunks big enough (a fraction of a second each) for the kill to land mid-sweep
    grid = QecGrid(distances=(5,), ps=(0.005, 0.01), num_shots=240_000, chunk_shots=30_000)
    args = ["--distances", "5", "--ps", "0.005,0.01", "--shots", "240000", "--chunk-shots", "30000"]
    killed = tmp_path / "killed.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # one worker, so chunks finish one by one and the kill lands mid-sweep
    proc = subprocess.Popen([sys.executable, "-m", "qlink.cli", "sweep", "qec", *args, "--csv", str(killed),
                             "--workers", "1", "--no-progress"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if killed.exists() and killed.read_text().count("\n") >= 4:  # header + 3 chunks
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the sweep finished before it could be interrupted"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its scheduler and its worker: its own session
        proc.wait(30)
    n_before = len(_rows(killed)) if killed.read_text().endswith("\n") else None
    res = run_sweep(grid, csv_path=killed, client=client, progress=False)
    assert res.complete and res.chunks_before >= 3 and (n_before is None or res.chunks_before == n_before)
    one = tmp_path / "one.csv"
    run_sweep(grid, csv_path=one, client=client, progress=False)
    assert _rows(killed) == _rows(one) and len(_rows(one)) == 16


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_writes_the_finished_chunks_then_exits_130_and_resumes(client, tmp_path):
    grid = QecGrid(distances=(5,), ps=(0.005, 0.01), num_shots=240_000, chunk_shots=30_000)
    args = ["--distances", "5", "--ps", "0.005,0.01", "--shots", "240000", "--chunk-shots", "30000"]
    path = tmp_path / "stopped.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # its own session, as a terminal's foreground job: Ctrl-C goes to the CLI, its scheduler and its workers
    proc = subprocess.Popen([sys.executable, "-m", "qlink.cli", "sweep", "qec", *args, "--csv", str(path),
                             "--workers", "1", "--no-progress"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and path.read_text().count("\n") >= 3:  # header + 2 chunks
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the sweep finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "resume" in lines[0], err
    assert path.read_text().endswith("\n")  # no row cut by the stop
    n_rows = len(_rows(path))
    assert 2 <= n_rows < 8
    res = run_sweep(grid, csv_path=path, client=client, progress=False)
    assert res.complete and res.chunks_before == n_rows
    one = tmp_path / "one.csv"
    run_sweep(grid, csv_path=one, client=client, progress=False)
    assert _rows(path) == _rows(one)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_dies_is_reported_and_its_chunk_runs_again(tmp_path):
    import threading

    grid = QecGrid(distances=(5,), ps=(0.005, 0.01), num_shots=240_000, chunk_shots=30_000)
    cluster = _local_cluster(2)
    c = distributed.Client(cluster)
    try:
        c.wait_for_workers(2, timeout=60)
        victim = next(iter(c.run(os.getpid).values()))
        path = tmp_path / "k.csv"

        def kill_one_mid_sweep():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if path.exists() and path.read_text().count("\n") >= 3:
                    os.kill(victim, signal.SIGKILL)
                    return
                time.sleep(0.02)

        said: list[str] = []
        killer = threading.Thread(target=kill_one_mid_sweep, daemon=True)
        killer.start()
        res = run_sweep(grid, csv_path=path, client=c, progress=False, say=said.append)
        killer.join(5)
        assert res.complete and res.workers_lost >= 1
        assert any("left" in m for m in said), said
        one = tmp_path / "one.csv"
        run_sweep(grid, csv_path=one, client=c, progress=False)
        assert _rows(path) == _rows(one) and len(_rows(one)) == 16
    finally:
        c.close()
        cluster.close()


@pytest.mark.timeout(120)
def test_a_sweep_with_no_workers_stops_instead_of_waiting_forever(tmp_path):
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0")
    c = distributed.Client(cluster)
    try:
        with pytest.raises(SweepError, match="no Dask worker has been connected for 2 s"):
            run_sweep(QecGrid(distances=(3,), ps=(0.01,), num_shots=400, chunk_shots=200),
                      csv_path=tmp_path / "n.csv", client=c, progress=False, no_worker_timeout_s=2)
    finally:
        c.close()
        cluster.close()
    assert read_done_chunks(tmp_path / "n.csv").chunks == {}
