"""docs/results.md is generated from benchmarks/results/*.json and never drifts from them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    """``benchmarks/results_page.py`` as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "benchmarks" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_results_page_equals_a_fresh_generation():
    page = load_generator()
    assert (ROOT / "docs" / "results.md").read_text() == page.render(), (
        "docs/results.md is out of date: run `python3 benchmarks/results_page.py` and commit it"
    )


def test_every_result_file_is_listed_and_every_listed_file_exists():
    text = (ROOT / "docs" / "results.md").read_text()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"## {path.stem}\n" in text, path.name
    for path in (ROOT / "benchmarks" / "results").iterdir():
        assert path.suffix in {".json", ".png"}, f"{path.name}: result files are JSON with a PNG beside them"
        if path.suffix == ".png":
            assert path.with_suffix(".json").exists(), f"{path.name} has no JSON beside it"


def test_a_new_result_file_gets_its_section(tmp_path):
    page = load_generator()
    rows = [
        {
            "backend": "torch",
            "op": "offload",
            "residency": "device",
            "bytes": 2_000_000_000,
            "gbps": 50.0,
            "ratio": 0.9,
            "bound": "d2h",
        }
    ]
    (tmp_path / "2030-01-01-cpu-torch.json").write_text(
        json.dumps({"machine": "cpu", "torch": "2.13", "stateshift": "0000000", "rows": rows})
    )
    text = page.render(tmp_path)
    assert "## 2030-01-01-cpu-torch\n" in text
    assert "| torch | offload | device | 2 | 50 | 0.9 | d2h |" in text
    assert "measured at: 0000000" in text


def test_a_merged_result_lists_each_calls_command_and_its_comparison(tmp_path):
    page = load_generator()
    data = {
        "stateshift": "0000000",
        "command": ["python3 a.py --seeds 2", "python3 a.py --first-seed 2"],
        "comparison": {"threshold": 0.4, "speedup_median": 0.5},
        "runs": [{"name": "sync/s0", "seed": 0}],
    }
    (tmp_path / "2030-01-01-h100-train-longtail.json").write_text(json.dumps(data))
    text = page.render(tmp_path)
    assert "- `python3 a.py --seeds 2`\n- `python3 a.py --first-seed 2`\n" in text
    assert "comparison: `threshold` 0.4, `speedup_median` 0.5" in text


def test_a_result_combined_from_calls_at_other_commits_names_each(tmp_path):
    page = load_generator()
    parts = [{"families": ["builtin"], "stateshift": "1111111"}, {"families": ["fsdp2", "hf"], "stateshift": "2222222"}]
    data = {"stateshift": None, "command": "a + b", "parts": parts, "runs": [{"name": "builtin/s0", "seed": 0}]}
    (tmp_path / "2030-01-01-h100-train-families.json").write_text(json.dumps(data))
    assert "measured at: 1111111 (builtin), 2222222 (fsdp2, hf)" in page.render(tmp_path)


def test_weight_sync_rows_show_the_issues_fields(tmp_path):
    page = load_generator()
    row = {
        "transport": "cuda_ipc",
        "family": "megatron",
        "residency": "offloaded",
        "bytes": 5_831_356_416,
        "publish_s": 0.005,
        "pause_s": 0.0045,
        "receive_gbps": 1298.0,
        "ratio": 0.867,
        "vs_naive": 91.0,
        "d2h_bytes": 0,
    }
    (tmp_path / "2030-01-01-h100-weight-sync-megatron.json").write_text(json.dumps({"rows": [row]}))
    text = page.render(tmp_path)
    header = next(line for line in text.splitlines() if line.startswith("| transport"))
    for field in ("GB", *(k for k in row if k != "bytes")):  # every field of the row, its bytes in GB
        assert f" {field} " in header, field
    assert "| cuda_ipc | megatron | offloaded | 5.83 |" in text


def test_rows_of_an_unknown_kind_still_make_a_table(tmp_path):
    page = load_generator()
    rows = [{"probe": "cold", "kernel_ms": 1691.6, "nested": {"a": 1}}, {"probe": "warm", "misc": 2}]
    (tmp_path / "2030-01-01-h100-something-new.json").write_text(json.dumps({"rows": rows}))
    text = page.render(tmp_path)
    assert "| probe | kernel_ms | misc |" in text
    assert "| cold | 1692 |  |" in text
    assert "\n|  |\n" not in text


def test_no_committed_section_has_an_empty_table():
    text = (ROOT / "docs" / "results.md").read_text()
    assert "|  |\n|\n" not in text
