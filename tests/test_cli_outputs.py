"""What the CLI writes and shows: literal names, per-file isolation, modes, --mkdir, widths, help, budgets."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bufreuse import limits
from bufreuse.cli import app
from bufreuse.cli._common import OFF_TTY_WIDTH, _width
from bufreuse.cli.snapshot_report import _worker_count
from bufreuse.errors import InputError
from bufreuse.launch.site import load_site

DATA = Path(__file__).parent / "data"
SNAPSHOT = DATA / "snapshots" / "no_history.pickle"
TRACED = DATA / "snapshots" / "expandable.pickle.gz"
CONFIG = DATA / "megatron" / "hybridep-ready.yaml"
runner = CliRunner()


def test_snapshot_file_name_with_markup_is_shown_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(SNAPSHOT, tmp_path / "snap[red].pickle")
    monkeypatch.chdir(tmp_path)  # a short name: the title is not wrapped
    result = runner.invoke(app, ["snapshot-report", "snap[red].pickle"])
    assert result.exit_code == 0, result.output
    assert "snap[red].pickle" in result.stdout


def test_snapshot_report_bad_file_is_one_line_and_good_files_are_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"xx")
    result = runner.invoke(app, ["snapshot-report", str(SNAPSHOT), str(bad), str(TRACED), "--json"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0]
    reported = [json.loads(line)["file"] for line in result.stdout.splitlines()]
    assert reported == [str(SNAPSHOT), str(TRACED)]
    assert "1 of 3 files could not be reported" in result.stderr


def test_workers_never_exceed_files_or_cpus() -> None:
    cpus = os.cpu_count() or 1
    assert _worker_count(99999, 2) == min(2, cpus)
    assert _worker_count(None, 10_000) == min(10_000, cpus, limits.Limits().max_workers)
    assert _worker_count(1, 5) == 1
    with limits.override(max_workers=1):
        assert _worker_count(99999, 5) == 1


def test_plot_needs_mkdir_for_missing_folders_and_is_written_0644(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "timeline.png"
    refused = runner.invoke(app, ["snapshot-report", str(TRACED), "--plot", str(out)])
    assert refused.exit_code == 2 and "--mkdir" in refused.stderr and not (tmp_path / "new").exists()
    old = os.umask(0o022)
    try:
        made = runner.invoke(app, ["snapshot-report", str(TRACED), "--plot", str(out), "--mkdir"])
    finally:
        os.umask(old)
    assert made.exit_code == 0, made.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_cpu_smoke_sweep_writes_and_announces_no_empty_plot(tmp_path: Path) -> None:
    args = ["sweep", "--workload", "cpu-smoke", "--slots", "0,2", "--steps", "2", "--root", str(tmp_path)]
    result = runner.invoke(app, [*args, "--name", "smoke"])
    assert result.exit_code == 0, result.output
    assert "plot:" not in result.stdout
    assert not (tmp_path / "smoke" / "reserved_vs_slots.png").exists()


def test_tables_off_a_terminal_keep_whole_headers(tmp_path: Path) -> None:
    args = ["sweep", "--workload", "cpu-smoke", "--slots", "0,2", "--steps", "2", "--root", str(tmp_path)]
    result = runner.invoke(app, [*args, "--name", "wide"])
    assert result.exit_code == 0, result.output
    for header in ("peak reserved MiB", "pending-free MiB", "step ms"):
        assert header in result.stdout


def test_width_is_wide_off_a_terminal_and_columns_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    class Pipe:
        def isatty(self) -> bool:
            return False

    class Tty(Pipe):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("COLUMNS", raising=False)
    assert _width(Pipe()) == OFF_TTY_WIDTH
    assert _width(Tty()) is None  # rich asks the terminal
    monkeypatch.setenv("COLUMNS", "90")
    assert _width(Pipe()) is None  # rich reads $COLUMNS


def test_check_config_seq_length_overrides_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.read_text() + "seq_length: 4096\nmicro_batch_size: 1\n")
    base = runner.invoke(app, ["check-config", "--json", str(cfg)])
    short = runner.invoke(app, ["check-config", "--json", str(cfg), "--seq-length", "1024"])
    assert base.exit_code in (0, 1) and short.exit_code == base.exit_code, short.output
    rows = {name: json.loads(r.stdout)["rings"]["dispatch"]["rows"] for name, r in (("base", base), ("short", short))}
    assert rows["short"] * 4 == rows["base"], rows
    assert "overrides the file" in runner.invoke(app, ["check-config", "--help"], env={"COLUMNS": "200"}).stdout


def test_help_shows_shape_defaults_and_version_has_short_flag() -> None:
    helptext = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"}).stdout
    for default in ("default 4096", "default 2048", "default 32768", "default bf16", "default 0.5"):
        assert default in helptext
    assert "DESIGN.md" not in helptext
    version = runner.invoke(app, ["-V"])
    assert version.exit_code == 0 and version.stdout.startswith("bufreuse ")
    assert "--install-completion" in runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout


def test_limit_flag_raises_a_budget_for_one_run(tmp_path: Path) -> None:
    args = ["sweep", "--workload", "cpu-smoke", "--tokens", "20000000", "--root", str(tmp_path), "--dry-run"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "max_dim" in refused.stderr and "--limit max-dim=N" in refused.stderr
    raised = runner.invoke(app, ["--limit", "max-dim=30000000", *args])
    assert raised.exit_code == 2 and "--dry-run: apply to --launcher slurm only" in raised.stderr


def test_budget_error_names_budget_value_and_flag() -> None:
    with pytest.raises(limits.BudgetExceededError) as info:
        limits.check("max-trace-entries", 9_000_000, what="snap.pickle: trace entries")
    err = info.value
    assert isinstance(err, InputError)
    assert (err.budget, err.value, err.limit) == ("max_trace_entries", 9_000_000, 8_000_000)
    assert "snap.pickle: trace entries: 9,000,000 exceeds the max_trace_entries budget of 8,000,000" in str(err)
    assert "--limit max-trace-entries=N" in str(err)


def test_limits_env_and_override_compose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(limits.ENV_VAR, "max-hosts=10, max_workers=3")
    assert (limits.current().max_hosts, limits.current().max_workers) == (10, 3)
    with limits.override(max_hosts=20) as active:
        assert active.max_hosts == 20 and limits.current().max_workers == 3
    assert limits.current().max_hosts == 10
    monkeypatch.setenv(limits.ENV_VAR, "max-hosts=-1")
    with pytest.raises(InputError, match="must be a whole number >= 1"):
        limits.current()
    with pytest.raises(InputError, match="unknown budget 'nope'"):
        limits.parse_overrides(["nope=1"])


def test_site_file_with_too_many_yaml_aliases_is_refused_before_loading(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text("a: &a [x]\nb: [" + ", ".join(["*a"] * 50) + "]\n")
    with limits.override(max_yaml_aliases=10), pytest.raises(limits.BudgetExceededError, match="max_yaml_aliases"):
        load_site(site)
    with pytest.raises(InputError, match="unknown SLURM site option"):  # within the default budget: read as usual
        load_site(site)
