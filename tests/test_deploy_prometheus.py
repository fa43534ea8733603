"""deploy/prometheus: the scrape config, its template, the recording and alert rules (promtool checks them)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_scripts import load_module

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = [PROMETHEUS_DIR / "rules" / "recording.yml", PROMETHEUS_DIR / "rules" / "alerts.yml"]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; tools/bootstrap.sh installs it)",
)


render_config = load_module(PROMETHEUS_DIR / "render_config.py")


def documented_metrics() -> set[str]:
    """Metric names of docs/metrics.md's tables."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(onestream_[a-z0-9_]+)` \|", text, flags=re.MULTILINE))


def metrics_in(expr: str) -> set[str]:
    """Raw metric names an expression reads (recorded `level:metric:op` names excluded)."""
    names = set(re.findall(r"(?<![:\w])onestream_[a-z0-9_]+", expr))
    return {
        re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n
        for n in names
    }


def all_rules() -> list[dict]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_shipped_config_is_the_rendered_template() -> None:
    assert (PROMETHEUS_DIR / "prometheus.yml").read_text() == render_config.render_config()


def test_template_variables_reach_the_config() -> None:
    text = render_config.render_config(
        "10.1.2.3:9555",
        scrape_interval="1s",
        evaluation_interval="2s",
        sd_refresh_interval="3s",
        rules_dir="/r",
    )
    config = yaml.safe_load(text)
    assert "${" not in text
    assert config["global"] == {"scrape_interval": "1s", "evaluation_interval": "2s"}
    assert config["rule_files"] == ["/r/recording.yml", "/r/alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "onestream"
    assert job["http_sd_configs"] == [{"url": "http://10.1.2.3:9555/sd", "refresh_interval": "3s"}]


def test_render_rejects_a_url_for_the_router() -> None:
    with pytest.raises(ValueError, match="host:port"):
        render_config.render_config("http://10.0.0.1:9400")


def test_render_command_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "prometheus.yml"
    assert render_config.main(["--router", "head:9400", "-o", str(out)]) == 0
    assert "http://head:9400/sd" in out.read_text()


@needs_promtool
def test_promtool_accepts_the_shipped_config() -> None:
    result = promtool("check", "config", "prometheus.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout


@needs_promtool
def test_promtool_accepts_a_rendered_config(tmp_path: Path) -> None:
    (tmp_path / "prometheus.yml").write_text(
        render_config.render_config(
            "127.0.0.1:40001", scrape_interval="1s", rules_dir=str(PROMETHEUS_DIR / "rules")
        )
    )
    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = promtool("check", "rules", *map(str, RULE_FILES), cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    """rules_test.yml: each alert fires on its failure and stays quiet on a healthy pool; ratios are right."""
    result = promtool("test", "rules", "rules_test.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS_DIR / "rules_test.yml").read_text()))
    assert tested == {r["alert"] for r in all_rules() if "alert" in r}, "every alert needs a unit test"


def test_rules_read_only_documented_metrics() -> None:
    documented = documented_metrics()
    assert len(documented) > 20
    for rule in all_rules():
        unknown = metrics_in(rule["expr"]) - documented
        assert not unknown, f"{rule.get('record') or rule.get('alert')} reads undocumented {unknown}"


def test_alerts_carry_severity_and_summary() -> None:
    alerts = [r for r in all_rules() if "alert" in r]
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names))
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]
        assert "for" in alert, f"{alert['alert']} would fire on a single bad evaluation"


def test_recorded_names_follow_the_convention() -> None:
    for rule in all_rules():
        if "record" in rule:
            assert re.fullmatch(r"(card|model):onestream_[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule[
                "record"
            ]


def test_prometheus_rule_object_matches_the_rule_files() -> None:
    shipped = (ROOT / "deploy" / "kuberay" / "prometheusrule.yaml").read_text()
    assert shipped == render_config.render_prometheus_rule()
    groups = yaml.safe_load(shipped)["spec"]["groups"]
    assert groups == [g for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"]]
