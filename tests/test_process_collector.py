"""The warmup_process_* series are prometheus_client's ProcessCollector (issue 73): the
catalogue names what it writes, and its figures agree with psutil's reading of the same
process.  A fresh registry per test, values through get_sample_value."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, generate_latest

from exporter.catalogue import CATALOGUE
from exporter.collectors import process_collector, register_default_collectors

MIB = 1 << 20
PROCESS_SPECS = [s for s in CATALOGUE if s.name.startswith("warmup_process_")]


def registry_with(collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_the_catalogue_names_what_the_process_collector_writes():
    """Name, type and help of each family, both ways: nothing written that the catalogue lacks."""
    registry = CollectorRegistry()
    register_default_collectors(registry)
    written = {f.name: f for f in registry.collect() if f.name.startswith("warmup_process_")}
    assert {s.family for s in PROCESS_SPECS} == set(written)
    for s in PROCESS_SPECS:
        fam = written[s.family]
        assert (fam.type, fam.documentation, s.source) == (s.type, s.help, "scrape"), s.name
        assert [x.name for x in fam.samples] == [s.name], s.name
    assert any(isinstance(c, ProcessCollector) for c in registry._collector_to_names), "not prometheus_client's own"


@pytest.fixture
def child():
    """An idle Python process holding 64 MiB it has touched, and the wall clock around its start."""
    before = time.time()
    code = "import sys, time; b = bytearray(64 << 20); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc, before, time.time()
    finally:
        proc.kill()
        proc.wait()


def test_another_process_read_through_the_collector_agrees_with_psutil(child):
    proc, before, after = child
    registry = registry_with(process_collector(pid=lambda: proc.pid))
    p = psutil.Process(proc.pid)

    def value(name: str) -> float:
        v = registry.get_sample_value(name)
        assert v is not None, name
        return v

    rss = value("warmup_process_resident_memory_bytes")
    assert rss >= 64 * MIB                               # the bytes it touched
    assert rss == pytest.approx(p.memory_info().rss, abs=MIB)
    assert value("warmup_process_virtual_memory_bytes") == pytest.approx(p.memory_info().vms, abs=MIB)
    start = value("warmup_process_start_time_seconds")
    assert start == pytest.approx(p.create_time(), abs=0.05)
    # The kernel's boot time is whole seconds, so a start time from /proc may be off by up to 1 s.
    assert before - 1.05 <= start <= after + 1.05
    cpu = p.cpu_times()
    assert value("warmup_process_cpu_seconds_total") == pytest.approx(cpu.user + cpu.system, abs=0.02)
    assert value("warmup_process_open_fds") == p.num_fds()
    assert value("warmup_process_max_fds") == p.rlimit(psutil.RLIMIT_NOFILE)[0]


def test_the_agents_own_resident_memory_agrees_with_psutil():
    """The default reads the process it runs in, as the agent's registry does."""
    registry = CollectorRegistry()
    register_default_collectors(registry)
    me = psutil.Process()
    low = me.memory_info().rss
    rss = registry.get_sample_value("warmup_process_resident_memory_bytes")
    high = me.memory_info().rss
    assert rss is not None and min(low, high) - MIB <= rss <= max(low, high) + MIB
    assert registry.get_sample_value("warmup_process_start_time_seconds") == pytest.approx(me.create_time(), abs=0.05)


def test_an_unreadable_proc_leaves_the_process_series_absent_and_the_rest_of_the_scrape(tmp_path):
    registry = registry_with(process_collector(proc=str(tmp_path)))
    Gauge("warmup_unrelated", "still scraped", registry=registry).set(3)
    text = generate_latest(registry).decode()
    assert "warmup_process_" not in text and "warmup_unrelated 3.0" in text
