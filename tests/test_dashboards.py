"""The operator dashboards and alerts name only what the proxy really serves on /metrics.

examples/grafana/mcp-tasks-proxy-dashboard.json and examples/prometheus/mcp-tasks-proxy-alerts.yaml are checked
against a live scrape of the proxy, after a few calls that give every metric family a sample: a misspelt metric or
label there would show an empty panel, or an alert that can never fire.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, refused_port, task_reaches
from tests.factories import meta

DASHBOARD = ROOT / "examples" / "grafana" / "mcp-tasks-proxy-dashboard.json"
ALERTS = ROOT / "examples" / "prometheus" / "mcp-tasks-proxy-alerts.yaml"

# Series Prometheus adds itself to every scrape, and the labels it attaches to every series of a target.
SCRAPE_SERIES = frozenset({"up"})
TARGET_LABELS = frozenset({"job", "instance"})
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created", ""),
    "gauge": ("",),
    "unknown": ("",),
}
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
# A whole identifier (not the tail of a number such as 1h or 2e3, nor a $variable), that is not a function call.
_IDENTIFIER = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:]|\s*\()")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)


def _unquoted(expr: str) -> str:
    """The expression with every string literal emptied (label values, Grafana's $job), keeping its shape."""
    return _STRING.sub('""', expr)


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers that are not functions, keywords, label names
    (in matchers or in by/without/on/ignoring/group_* lists), durations, numbers nor Grafana variables."""
    text = _unquoted(expr)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = _RANGE.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in KEYWORDS}


def labels_in(expr: str) -> dict[str | None, set[str]]:
    """Label names the expression uses: per selected series (from its matchers), and under None those of the
    grouping clauses, which belong to no one series."""
    text = _unquoted(expr)
    used: dict[str | None, set[str]] = {}
    for clause in _GROUPING.finditer(text):
        used.setdefault(None, set()).update(label.strip() for label in clause.group(2).split(",") if label.strip())
    for selector in _SELECTOR.finditer(text):
        used.setdefault(selector.group(1), set()).update(_MATCHER_LABEL.findall(selector.group(2)))
    return used


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every label_values() variable query of the dashboard."""
    found = []

    def panels(items: list[dict[str, Any]]):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(variable["definition"])
            assert match, f"variable {variable['name']}: not a label_values() query"
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def alert_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in rules["groups"] for rule in group["rules"]]


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def load_alerts() -> dict[str, Any]:
    return yaml.safe_load(ALERTS.read_text())


def all_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs(load_dashboard()) + [
        (f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules(load_alerts())
    ]


async def scrape(proxy) -> str:
    async with proxy.client.session.get(proxy.url.replace("/mcp", "/metrics")) as response:
        assert response.status == 200
        return await response.text()


@pytest.fixture
async def exported(make_proxy, mcp_upstream) -> dict[str, tuple[str, set[str]]]:
    """Series name -> (metric family, label names) as live proxies serve them, after calls that give every family
    a sample. One proxy works: a task that completes, one that asks for input, an error, requests of several modes.
    Another has its Redis and its upstream where nothing listens: a task call fails in the store (store errors
    exist only with a Redis store), a pass-through call fails upstream. A third has only its upstream away: a
    task's call is sent again (a retry) before it fails. The scrapes are merged."""
    once = {"rates": [{"per": "tool", "match": "slow_report", "requests_per_s": 0.001, "burst": 1}]}
    proxy = await make_proxy(mcp_upstream, tools=[{"match": "slow_report"}, {"match": "one_question"}], limits=once)
    done = await proxy.client.call_tool("slow_report", {"topic": "dashboards", "seconds": 0})
    await task_reaches(proxy.client, done.result["taskId"], "completed")
    limited = await proxy.client.call_tool("slow_report", {"topic": "dashboards", "seconds": 0})
    assert limited.status == 429, limited.body
    asking = await proxy.client.call(
        "tools/call", {"name": "one_question", "arguments": {}, "_meta": meta(elicitation={})}
    )
    await task_reaches(proxy.client, asking.result["taskId"], "input_required")
    await proxy.client.get_task("no-such-task")
    texts = [await scrape(proxy)]
    await proxy.client.cancel_task(asking.result["taskId"])

    with refused_port() as upstream_port, refused_port() as redis_port:
        broken = await make_proxy(
            f"http://127.0.0.1:{upstream_port}/mcp",
            protocol="modern",
            store={"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0", "key_prefix": "dashboards:",
                   "timeout_s": 0.5, "lease_s": 1, "reap_interval_s": 0.3},
            tools=[{"match": "slow_report"}],
            limits={"rates": [{"per": "caller", "requests_per_s": 1000}]},  # counted here alone: Redis is away
        )  # fmt: skip
        no_store = await broken.client.call_tool("slow_report", {"topic": "dashboards", "seconds": 0})
        assert no_store.status == 503, no_store.body
        no_upstream = await broken.client.call_tool("echo", {"text": "dashboards"}, tasks=False)
        assert no_upstream.status == 502, no_upstream.body
        texts.append(await scrape(broken))

    # An upstream where nothing listens, with a working store: the call is sent again (a retry), then fails.
    with refused_port() as upstream_port:
        unreachable = await make_proxy(
            f"http://127.0.0.1:{upstream_port}/mcp", protocol="modern",
            tools=[{"match": "slow_report", "retry": {"attempts": 2, "backoff_ms": 1}}],
        )  # fmt: skip
        retried = await unreachable.client.call_tool("slow_report", {"topic": "dashboards", "seconds": 0})
        failed = await task_reaches(unreachable.client, retried.result["taskId"], "failed")
        assert "(2 attempts)" in failed.result["statusMessage"], failed.result  # sent again once: a retry counted
        texts.append(await scrape(unreachable))

    labels: dict[str, set[str]] = {}
    names: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            labels.setdefault(family.name, set(TARGET_LABELS)).update(
                label for sample in family.samples for label in sample.labels
            )
            names.setdefault(family.name, set()).update(
                [family.name + suffix for suffix in SUFFIXES[family.type]] + [sample.name for sample in family.samples]
            )
    series = {name: (family, labels[family]) for family in names for name in names[family]}
    for name, (_, label_names) in series.items():
        assert label_names - TARGET_LABELS or name.startswith("mcp_tasks_proxy_connections_refused"), (
            f"{name} has no sample: the fixture should exercise it"
        )
    for name in ("store_errors_total", "upstream_errors_total", "legacy_sessions"):
        assert f"mcp_tasks_proxy_{name}" in series, f"mcp_tasks_proxy_{name} is not exported"
    return series


def test_extraction_sees_metrics_and_nothing_else():
    expr = (
        'histogram_quantile(0.95, sum by (le, mode) (rate(mcp_tasks_proxy_request_secnds_bucket{job=~"$job", '
        'mode=~"task|sep1686"}[$__rate_interval]))) > 0.5 and on (instance) up{job="p"} == 1 unless '
        "sum without (tool) (increase(mcp_tasks_proxy_tasks_finished_total[1h] offset 5m)) > 2e3"
    )
    assert series_in(expr) == {"mcp_tasks_proxy_request_secnds_bucket", "up", "mcp_tasks_proxy_tasks_finished_total"}
    assert labels_in(expr) == {
        None: {"le", "mode", "instance", "tool"},
        "mcp_tasks_proxy_request_secnds_bucket": {"job", "mode"},
        "up": {"job"},
    }
    assert series_in('label_values(mcp_tasks_proxy_tasks_running{job=~"$job"})') == {"mcp_tasks_proxy_tasks_running"}
    assert series_in('sum(rate({__name__="x"}[5m]))') == set()


async def test_dashboard_and_alerts_use_only_exported_metrics_and_labels(exported):
    known_series = set(exported) | SCRAPE_SERIES
    every_label = set().union(*(labels for _, labels in exported.values())) | {"le"}
    used: set[str] = set()
    problems = []
    for where, expr in all_exprs():
        names = series_in(expr)
        if not names:
            problems.append(f"{where}: selects no metric: {expr}")
        used |= names
        problems += [f"{where}: {name} is not exported" for name in sorted(names - known_series)]
        for series, labels in labels_in(expr).items():
            allowed = (exported[series][1] if series in exported else TARGET_LABELS) if series else every_label
            if series and series.endswith("_bucket"):
                allowed = allowed | {"le"}
            problems += [f"{where}: {series or 'grouping'} has no label {label}" for label in sorted(labels - allowed)]
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\b", expr) and re.search(r"\bby\s*\([^)]*\ble\b", expr), (
                f"{where}: histogram_quantile needs _bucket series summed by le"
            )
    assert not problems, "\n".join(problems)
    # A typo caught: the same check on a misspelt name fails.
    assert "mcp_tasks_proxy_tasks_finishd_total" not in known_series
    assert used, "no metric found at all"


def test_dashboard_covers_what_operators_watch():
    dashboard = load_dashboard()
    exprs = [expr for _, expr in dashboard_exprs(dashboard)]
    text = "\n".join(exprs)
    required = {
        "tasks by status": r"mcp_tasks_proxy_tasks_finished_total\b.*\bstatus\b",
        "tasks running (working, input_required)": r"mcp_tasks_proxy_tasks_running\{[^}]*status=\"input_required\"",
        "task creation latency": r"histogram_quantile\(0\.95,.*_request_seconds_bucket\{[^}]*mode=~\"task",
        "pass-through rate": r"mcp_tasks_proxy_requests_total\{[^}]*mode=\"passthrough\"",
        "pass-through latency": r"mcp_tasks_proxy_request_seconds_bucket\{[^}]*mode=\"passthrough\"",
        "upstream errors, by where": r"\bby \(where\) \(rate\(mcp_tasks_proxy_upstream_errors_total\{",
        "upstream 5xx relayed": r"mcp_tasks_proxy_requests_total\{[^}]*mode=\"passthrough\", status=~\"5\.\.\"",
        "background upstream calls": r"\bby \(outcome\) \(rate\(mcp_tasks_proxy_upstream_call_seconds_count\{",
        "store health, by operation": r"\bby \(operation\) \(rate\(mcp_tasks_proxy_store_errors_total\{",
        "503 answers": r"mcp_tasks_proxy_requests_total\{[^}]*status=\"503\"",
        "legacy sessions, by side": r"\bby \(side\) \(mcp_tasks_proxy_legacy_sessions\{",
        "requests bridged to a legacy upstream": r"mcp_tasks_proxy_requests_total\{[^}]*mode=\"legacy\"",
        "connections refused": r"mcp_tasks_proxy_connections_refused_total",
    }
    missing = [what for what, pattern in required.items() if not re.search(pattern, text)]
    assert not missing, f"the dashboard shows nothing for: {missing}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for word in ("status", "latency", "upstream", "store", "legacy", "refused"):
        assert word in titles


def test_dashboard_is_importable():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat"}
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']!r} has no unit"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            # Every series is narrowed to the chosen job and instance.
            for selector in re.findall(r"mcp_tasks_proxy_\w+(\{[^}]*\})?", target["expr"]):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, target["expr"]


def test_every_alert_says_how_long_how_bad_and_what():
    rules = alert_rules(load_alerts())
    assert len(rules) >= 7
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"\d+[smhd]", str(rule.get("for", ""))), f"{rule['alert']}: no `for`"
        assert rule.get("labels", {}).get("severity") in {"critical", "warning", "info"}, rule["alert"]
        assert rule.get("annotations", {}).get("summary"), f"{rule['alert']}: no summary"
        assert rule["annotations"].get("description"), f"{rule['alert']}: no description"
    assert any(re.search(r"\bup\{", rule["expr"]) and "== 0" in rule["expr"] for rule in rules), "no proxy-down alert"
    store = [rule for rule in rules if re.search(r"rate\(mcp_tasks_proxy_store_errors_total\{", rule["expr"])]
    assert any(
        rule["expr"].rstrip().endswith("> 0") and rule["for"] == "2m" and rule["labels"]["severity"] == "warning"
        for rule in store
    ), "no store-errors alert (any failed store call for 2m: a warning)"
    ratio = re.compile(r"mcp_tasks_proxy_upstream_errors_total\{.*\)\s*/\s*sum.*mcp_tasks_proxy_requests_total\{", re.S)
    assert any(ratio.search(rule["expr"]) for rule in rules), "no upstream-errors alert relative to requests"


def test_promql_parses_with_promtool(tmp_path):
    """Prometheus' own parser on the alert rules, and on the dashboard's queries as recording rules (Grafana's
    variables given values first). Needs promtool (Debian: the prometheus package)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    records = [
        {"record": f"dashboard:query:{n}", "expr": expr.replace("$__rate_interval", "5m").replace("$", "")}
        for n, (_, expr) in enumerate(dashboard_exprs(load_dashboard()))
    ]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "dashboard.yaml")], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
