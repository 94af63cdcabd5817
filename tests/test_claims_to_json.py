"""The one-off migration of claims files written as Markdown only (`tools/claims_to_json.py`): the JSON it writes
renders back to the very Markdown it came from, and gives the claim table of REPORT.md what the saved JSON gives."""

import importlib.util
import json
from pathlib import Path

import pandas as pd

from dml_nb.reproduction.claims import Claims, load_claims, render_claims_markdown
from dml_nb.reproduction.reproduce import claims_summary

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("claims_to_json", ROOT / "tools" / "claims_to_json.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_a_saved_claims_file_migrates_to_the_same_table(tmp_path):
    t = pd.DataFrame(
        {"R@1": [62.1, 63.8, 60.0], "R@1 std": [1.3, 0.8, 1.1], "seeds": [5, 5, 5]}, index=["A", "B", "C | D"]
    )
    per_seed = pd.DataFrame({"row": ["A", "B"], "seed": [0, 0], "status": ["ok", "ok"], "run": ["a", "b"]})
    setting = "Ours: shapes, small_cnn, 4-6 epochs, seeds [0, 1], NMI from one k-means start; paper: cub200."
    fields = {
        "dataset": "shapes",
        "backbone": "small_cnn",
        "epochs": [4, 6],
        "seeds": [0, 1],
        "paper_dataset": "cub200",
    }
    c = Claims(
        "repro_demo",
        tmp_path,
        per_seed=per_seed.assign(wall_time_s=61.0),
        setting=setting,
        tasks="all alive",
        setting_fields=fields,
    )
    c.beats("B beats A", t, "B", "A")
    c.beats("B beats C | D", t, "B", "C | D")
    c.check("not run", None)
    c.save()
    saved = load_claims(tmp_path / "repro_demo_claims.json")
    table = claims_summary(tmp_path)[0]
    (tmp_path / "repro_demo_claims.json").unlink()
    md = (tmp_path / "repro_demo_claims.md").read_text()
    assert tool.convert(tmp_path / "repro_demo_claims.md") == tmp_path / "repro_demo_claims.json"
    migrated = load_claims(tmp_path / "repro_demo_claims.json")
    assert render_claims_markdown(migrated) == md == (tmp_path / "repro_demo_claims.md").read_text()
    assert claims_summary(tmp_path)[0] == table
    assert [(m["claim"], m["verdict"]) for m in migrated["claims"]] == [
        (s["claim"], s["verdict"]) for s in saved["claims"]
    ]
    assert (migrated["rule"], migrated["source"], migrated["cost"]["runs"]) == ("welch-t", "tools/claims_to_json.py", 2)
    assert migrated["setting"] == saved["setting"] == {"text": setting, **fields}
    assert migrated["resolution"]["basis"] == "rows" and migrated["claims"][0]["difference"] is None


def test_the_committed_claims_files_render_from_their_json():
    "Every committed claims file's Markdown is its JSON rendered, and parses to the same data."
    files = sorted((ROOT / "figures").glob("repro_*_claims.md"))
    assert files and all(f.with_suffix(".json").exists() for f in files)
    for f in files:
        data = load_claims(f.with_suffix(".json"))
        assert render_claims_markdown(data) == f.read_text(), f.name
        if data["source"] == "tools/claims_to_json.py":
            assert tool.parse_claims_markdown(f.read_text(), data["stem"]) == data
        json.loads(f.with_suffix(".json").read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
