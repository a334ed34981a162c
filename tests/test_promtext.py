"""omnid.base.promtext's writer: the one place the Prometheus text format is written (every
/metrics producer fills a promtext.Page). Expected texts are written out by hand; pages are
read back by the module's own reader and, where promtool is installed, by promtool."""

from __future__ import annotations

import math
import os
import re
import signal
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from omnid.base import promtext
from omnid.cluster.metrics import write as write_cluster
from omnid.gpu.fake import write_fake_gpu_file
from tests.harness import make_stack, wait_for

HOSTILE = 'a"b\\c\nd'  # a quote, a backslash and a newline in one label value


def promtool_check(text: str) -> None:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    r = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr + "\n" + text


def families_in_order(text: str) -> list[str]:
    """The family of every line, failing when a sample is not under its own family's TYPE
    line or a family's HELP/TYPE appears twice."""
    seen: list[str] = []
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in seen, f"family {name} written twice:\n{text}"
            seen.append(name)
            current = None
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert seen and seen[-1] == name, f"TYPE {name} not after its HELP:\n{text}"
            current = (name, kind)
        else:
            sample = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            assert current is not None, f"sample before any TYPE: {line!r}"
            name, kind = current
            allowed = {name} if kind != "histogram" else {name + s for s in ("_bucket", "_sum", "_count")}
            assert sample in allowed, f"sample {line!r} under the TYPE line of {name}:\n{text}"
    return seen


# ----------------------------------------------------------------------------- the writer
@pytest.mark.fast
def test_label_values_escape_quotes_backslashes_and_newlines():
    page = promtext.Page()
    page.gauge("g", "a gauge").add(1, unit=HOSTILE, state="ok")
    assert page.text() == ('# HELP g a gauge\n'
                           '# TYPE g gauge\n'
                           'g{unit="a\\"b\\\\c\\nd",state="ok"} 1\n')
    assert promtext.sums(page.text(), ["g"]) == {"g": 1.0}  # the reader takes it back whole
    promtool_check(page.text())


@pytest.mark.fast
def test_help_text_escapes_backslashes_and_newlines():
    page = promtext.Page()
    page.counter("c_total", "first\\second\nthird").add(2)
    assert page.text() == "# HELP c_total first\\\\second\\nthird\n# TYPE c_total counter\nc_total 2\n"
    promtool_check(page.text())


@pytest.mark.parametrize("value,text", [
    (0, "0"), (-1, "-1"), (123456789012, "123456789012"), (True, "1"), (False, "0"),
    (0.5, "0.5"), (1.0, "1.0"), (1e-7, "1e-07"), (2.5e20, "2.5e+20"),
    (math.nan, "NaN"), (math.inf, "+Inf"), (-math.inf, "-Inf"),
])
@pytest.mark.fast
def test_values_are_formatted_as_the_format_reads_them(value, text):
    assert promtext.value_text(value) == text
    assert math.isnan(float(text)) if text == "NaN" else float(text) == float(value)


@pytest.mark.fast
def test_a_value_that_is_not_a_number_is_refused_naming_it():
    with pytest.raises(TypeError, match="'12'"):
        promtext.Page().gauge("g", "h").add("12")


@pytest.mark.fast
def test_a_family_is_written_once_and_its_name_cannot_be_declared_again():
    page = promtext.Page()
    fam = page.gauge("omnid_x", "x")
    fam.add(1, unit="a")
    fam.add(2, unit="b")
    with pytest.raises(ValueError, match="omnid_x declared twice"):
        page.gauge("omnid_x", "x again")
    with pytest.raises(ValueError, match="omnid_x_total declared twice"):
        page.counter("omnid_x_total", "x")
        page.counter("omnid_x_total", "x")
    page.histogram("omnid_h_seconds", "h", (0.1,))
    with pytest.raises(ValueError, match="clashes with family omnid_h_seconds"):
        page.gauge("omnid_h_seconds_count", "a gauge on the histogram's _count")
    assert page.text().count("# HELP omnid_x ") == 1 and page.text().count("# TYPE omnid_x ") == 1
    assert families_in_order(page.text()) == ["omnid_x", "omnid_x_total", "omnid_h_seconds"]


@pytest.mark.fast
def test_counters_are_named_total_and_gauges_are_not():
    page = promtext.Page()
    with pytest.raises(ValueError, match="counter omnid_restarts must be named NAME_total"):
        page.counter("omnid_restarts", "h")
    with pytest.raises(ValueError, match="gauge omnid_up_total"):
        page.gauge("omnid_up_total", "h")
    with pytest.raises(ValueError, match="not a Prometheus metric name"):
        page.gauge("omnid-up", "h")
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        page.gauge("omnid_up", "h").add(1, __name="x")


@pytest.mark.fast
def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    page = promtext.Page()
    h = page.histogram("omnid_detect_seconds", "detection", (0.01, 1.0))
    h.add_series([2, 0, 1], 3.02, unit=HOSTILE)
    h.add_series([0, 1, 0], 0.5)
    assert page.text() == (
        '# HELP omnid_detect_seconds detection\n'
        '# TYPE omnid_detect_seconds histogram\n'
        'omnid_detect_seconds_bucket{unit="a\\"b\\\\c\\nd",le="0.01"} 2\n'
        'omnid_detect_seconds_bucket{unit="a\\"b\\\\c\\nd",le="1.0"} 2\n'
        'omnid_detect_seconds_bucket{unit="a\\"b\\\\c\\nd",le="+Inf"} 3\n'
        'omnid_detect_seconds_sum{unit="a\\"b\\\\c\\nd"} 3.02\n'
        'omnid_detect_seconds_count{unit="a\\"b\\\\c\\nd"} 3\n'
        'omnid_detect_seconds_bucket{le="0.01"} 0\n'
        'omnid_detect_seconds_bucket{le="1.0"} 1\n'
        'omnid_detect_seconds_bucket{le="+Inf"} 1\n'
        'omnid_detect_seconds_sum 0.5\n'
        'omnid_detect_seconds_count 1\n')
    with pytest.raises(ValueError, match="2 bucket counts for 2 bounds"):
        h.add_series([1, 1], 0.0)
    with pytest.raises(ValueError, match="'le' is the histogram's own label"):
        h.add_series([0, 0, 0], 0.0, le="x")
    promtool_check(page.text())


@pytest.mark.fast
def test_a_page_with_nan_inf_and_hostile_labels_passes_promtool_and_reads_back():
    page = promtext.Page()
    g = page.gauge("omnid_g", "gauge")
    g.add(math.nan, unit="nan")
    g.add(math.inf, unit="inf")
    g.add(-math.inf, unit=HOSTILE)
    page.counter("omnid_c_total", "counter").add(7, outcome="dropped,} x")
    page.gauge("omnid_empty", "a family with no sample yet is still declared")
    text = page.text()
    promtool_check(text)
    got = promtext.sums(text, ["omnid_c", "omnid_g", "omnid_empty"])
    assert got["omnid_c"] == 7.0 and got["omnid_empty"] is None
    assert math.isnan(got["omnid_g"])  # the NaN sample left out, then +Inf + -Inf


# ----------------------------------------------------------------------------- the producers
class _Session:
    """Stands in for a cluster session's counters (write() reads only these; a real one needs
    etcd and network namespaces, exercised by tests/test_cluster_e2e.py)."""
    etcd_ok = True
    counters = {"etcd_outages": 2, "lease_expired": 1}
    hostile = SimpleNamespace(count=4)
    peers = SimpleNamespace(received=10, dropped={"stale": 3, "foreign": 1})


@pytest.mark.fast
def test_cluster_families_each_sit_under_their_own_type_line_on_a_stand_in_crosshost():
    ch = SimpleNamespace(metrics=lambda: {"tp": {"generations": 3, "fenced": 1, "down": 2}},
                         links={"tp": SimpleNamespace(cluster=SimpleNamespace(running_generation=lambda: 7))},
                         session=_Session())
    page = promtext.Page()
    write_cluster(ch, page)
    text = page.text()
    assert families_in_order(text)[:2] == ["omnid_group_generations_total", "omnid_group_fenced_total"]
    assert ('# TYPE omnid_group_generation gauge\nomnid_group_generation{group="tp"} 7\n'
            '# HELP omnid_cluster_etcd_up ') in text
    assert ('omnid_cluster_datagrams_total{outcome="accepted"} 10\n'
            'omnid_cluster_datagrams_total{outcome="foreign"} 1\n'
            'omnid_cluster_datagrams_total{outcome="stale"} 3\n') in text
    promtool_check(text)


def test_fake_gpu_daemon_metrics_page_has_each_family_once_under_its_type_and_passes_promtool(tmp_path, daemon_factory):
    """A real daemon's page with every optional family that needs no cluster: GPU conditions
    and memory (the fake GPU backend: this machine has no GPU), the death histogram, log
    lines, process (and, where cgroups are on, cgroup) figures."""
    from omnid.gpu.fake import FakeGpuBackend

    path = tmp_path / "gpu.json"
    write_fake_gpu_file(path, {"gpus": [{"index": 0, "total_mib": 8000}, {"index": 1, "total_mib": 8000}],
                               "processes": []})
    d = daemon_factory(make_stack({"worker": 'exec = ["sh", "-c", "echo hi; exec sleep 1000"]\ngpus = [1]\n'
                                             'restart = "always"\nrestart_sec = 0.1\n'}),
                       env={"OMNID_DEVELOPER_FAKE_GPU": str(path), "OMNID_GPU_INTERVAL": "0.1"})
    pid = d.wait_state("worker", "active")["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (u := d.unit("worker"))["state"] == "active" and u["pid"] != pid, 10, "worker back")
    FakeGpuBackend(path).inject_xid(0, 79)
    text = wait_for(lambda: "omnid_gpu_condition{" in (t := d.http("/metrics")[1]) and t, 10,
                    f"a GPU condition on /metrics\n{d.log()[-2000:]}")
    names = families_in_order(text)
    for want in ("omnid_unit_state", "omnid_death_detection_seconds", "omnid_unit_cpu_seconds_total",
                 "omnid_gpu_stuck_threads", "omnid_gpu_condition", "omnid_health_connections_refused_total"):
        assert want in names, (want, names)
    assert re.search(r'^omnid_gpu_condition\{gpu="[^"]+",status="failed",source="xid",xid="79"\} 1$', text, re.M), text
    assert 'omnid_death_detection_seconds_count{unit="worker"} 1\n' in text, text
    assert 'omnid_unit_state{unit="worker",state="active"} 1\n' in text
    promtool_check(text)
