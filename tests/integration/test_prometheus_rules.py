"""The shipped alert rules and Grafana dashboard work unchanged: a real Prometheus scrapes a real daemon under a short
load, loads the rules, and every expression of both returns data."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference_engine.config import BUNDLED_MODEL_DIR
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.server import create, generate, start_server

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kakeya-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kakeya-dashboard.json"
SCRAPE_INTERVAL_S = 1
# Grafana substitutes $__rate_interval; a window of many scrape intervals stands in for it here.
RATE_INTERVAL = "30s"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="the Debian package prometheus is not installed (scripts/install_system_packages.sh installs it)",
    ),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _left_of_threshold(expr: str) -> str:
    """An alert expression `A > t` as `A > bool t`: a sample for every series of A, firing or not."""
    flat = " ".join(expr.split())
    match = re.fullmatch(r"(.*\S)\s*(==|!=|>=|<=|>|<)\s*([-\d.e]+)", flat)
    assert match, f"alert expressions are one comparison with a number: {expr!r}"
    return f"{match.group(1)} {match.group(2)} bool {match.group(3)}"


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    return [e.replace("$__rate_interval", RATE_INTERVAL) for e in exprs]


def _alert_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _load(server: Any) -> None:
    """A short load: sessions that generate (with speculation), queue, close, and one evicted by its idle TTL."""
    stub = server.stub
    prompt = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n")
    for _ in range(3):
        sid = create(stub, initial=prompt, no_default_eos=True)
        generate(stub, sid, max_tokens=24)
        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=list(b"    return ")))
        generate(stub, sid, max_tokens=12)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_every_alert_rule_and_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    verifier = TorchVerifier.load(BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    server = start_server(verifier, proposer="dflash", max_concurrent=1)
    prometheus: subprocess.Popen[str] | None = None
    try:
        assert server.server.metrics_port is not None
        shutil.copy(RULES, tmp_path / RULES.name)
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "rule_files": [RULES.name],
            "scrape_configs": [
                {"job_name": "kakeya", "static_configs": [{"targets": [f"127.0.0.1:{server.server.metrics_port}"]}]}
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        prometheus = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _query(base, 'up{job="kakeya"} == 1'):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("Prometheus never scraped the daemon")
        _load(server)
        time.sleep(4 * SCRAPE_INTERVAL_S)  # the last scrapes see the load's final counts
        empty = []
        for expr in [*_dashboard_expressions(), *map(_left_of_threshold, _alert_expressions())]:
            if not _query(base, expr):
                empty.append(expr)
        assert empty == [], "expressions without data"
        rules = json.load(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10))["data"]["groups"]
        assert sum(len(group["rules"]) for group in rules) == len(_alert_expressions()), "Prometheus loaded every rule"
        build = _query(base, "kakeya_build_info")
        assert build[0]["metric"]["proposer"] == "dflash" and build[0]["metric"]["model"] == "kakeya-tiny"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        server.stop()
