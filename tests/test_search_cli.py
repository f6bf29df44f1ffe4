"""`cona search --dry-run`: tables, JSON, exit codes."""

import json

import pytest
from typer.testing import CliRunner

from cona_cli.app import app

runner = CliRunner()
GPT3 = "configs/gpt3-1.3b-a6000.yaml"


def _run(*args):
    return runner.invoke(app, ["search", *args])


def test_json_output_for_one_gbs():
    r = _run("configs/tiny.yaml", "--dry-run", "--gbs", "16", "--top", "3", "--json", "--show-rejected")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    (res,) = out["results"]
    assert out["hardware"] == "cpu-local" and res["gbs"] == 16 and len(res["candidates"]) == 3
    c = res["candidates"][0]
    assert c["dp"] * c["tp"] * c["pp"] == 4 and c["time_s"] > 0 and c["microbatches"] == 16 // (c["dp"] * c["mbs"])
    assert all(r["reason"] for r in res["rejected"])


def test_all_gbs_table_and_json():
    r = _run(GPT3, "--dry-run", "--all-gbs", "--gns", "1000")
    assert r.exit_code == 0, r.output
    assert "Best per global batch" in r.stdout and "512" in r.stdout
    out = json.loads(_run(GPT3, "--dry-run", "--all-gbs", "--json").stdout)
    assert [x["gbs"] for x in out["results"]] == [32, 64, 128, 256, 512]
    assert len(out["crossovers"]) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["configs/tiny.yaml"], "--dry-run"),
        (["configs/tiny.yaml", "--dry-run", "--gbs", "8", "--all-gbs"], "exclude"),
        (["configs/tiny.yaml", "--dry-run", "--hardware", "tpu-v9"], "unknown profile"),
        (["configs/tiny.yaml", "--dry-run", "--gns", "-1"], "--gns"),
        (["configs/tiny.yaml", "--dry-run", "--top", "0"], "--top"),
        (["no-such.yaml", "--dry-run"], "cannot read"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    r = _run(*args)
    assert r.exit_code == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
