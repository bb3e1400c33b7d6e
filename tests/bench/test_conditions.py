"""Every result file carries the conditions of its run: host, load before/after, CPU floor."""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os

import pytest

from qlink.bench import conditions
from qlink.bench.report import write_results


@pytest.fixture(autouse=True)
def _fresh():
    conditions.reset()
    yield
    conditions.reset()


def test_measure_gives_host_load_and_a_floor():
    c = conditions.measure(floor_s=0.1)
    assert c.host["num_cpus"] == os.cpu_count()
    assert c.host["cpu_model"]
    assert len(c.load_before) == 3 and all(x >= 0 for x in c.load_before)
    assert c.cpu_floor is not None, c.floor_error
    assert 0.0 < c.floor_pct <= 100.0
    d = c.as_dict(load_after=(9.0, 8.0, 7.0))
    assert d["load_after"] == [9.0, 8.0, 7.0] and d["cpu_floor_pct"] == round(c.floor_pct, 1)
    assert d["busy"] is (c.floor_pct < conditions.BUSY_FLOOR_PCT)
    assert (d["warning"] is None) is (not d["busy"])


def test_write_results_stamps_json_and_every_csv_row(tmp_path):
    cond = conditions.begin(floor_s=0.1, warn=lambda m: None)
    rows = [{"case": "shm", "p50_us": 0.8}, {"case": "tcp", "p50_us": 61.0, "note": "loopback"}]
    jpath, cpath = write_results(rows, out_dir=tmp_path, name="r", meta={"k": 1})
    doc = json.loads(jpath.read_text())
    c = doc["conditions"]
    assert c["host"]["cpu_model"] == cond.host["cpu_model"]
    assert c["load_before"] == list(cond.load_before) and len(c["load_after"]) == 3
    assert c["cpu_floor_pct"] == round(cond.floor_pct, 1)
    assert doc["rows"] == rows and doc["meta"] == {"k": 1}
    with open(cpath, newline="") as f:
        got = list(csv.DictReader(f))
    assert [r["case"] for r in got] == ["shm", "tcp"] and got[1]["note"] == "loopback"
    header = cpath.read_text().splitlines()[0].split(",")
    assert header[:3] == ["case", "p50_us", "note"]  # the row's own columns first
    for r in got:
        assert r["host_cpus"] == str(cond.host["usable_cpus"])
        assert float(r["cpu_floor_pct"]) == round(cond.floor_pct, 1)
        assert float(r["load_before_1m"]) == cond.load_before[0]
        assert r["run_busy"] in ("True", "False")


def test_write_results_without_begin_measures_once(tmp_path):
    write_results([{"a": 1}], out_dir=tmp_path, name="one")
    first = conditions.current(measure_if_missing=False)
    assert first is not None and first.cpu_floor is not None
    write_results([{"a": 2}], out_dir=tmp_path, name="two")
    assert conditions.current(measure_if_missing=False) is first
    a = json.loads((tmp_path / "one.json").read_text())["conditions"]
    b = json.loads((tmp_path / "two.json").read_text())["conditions"]
    assert a["cpu_floor"] == b["cpu_floor"] and a["started_utc"] == b["started_utc"]


def _hog(cpu: int, stop) -> None:
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    while not stop.is_set():
        pass


@pytest.mark.timeout(120)
def test_a_busy_host_is_flagged_with_one_warning_line():
    """Real load: one spinning process on every CPU the floor's spinners use halves what they get."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    hogs = [ctx.Process(target=_hog, args=(cpu, stop), daemon=True) for cpu in cpus for _ in range(2)]
    for h in hogs:
        h.start()
    warnings: list[str] = []
    try:
        c = conditions.begin(floor_s=0.5, warn=warnings.append)
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
            if h.is_alive():
                h.kill()
    assert c.cpu_floor is not None, c.floor_error
    assert c.floor_pct < conditions.BUSY_FLOOR_PCT and c.busy
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("warning: the host is busy") and f"{c.floor_pct:.0f} %" in warnings[0]
    assert "BUSY" in c.summary()
