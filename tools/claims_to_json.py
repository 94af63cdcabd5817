#!/usr/bin/env python
"""One-off migration: write the JSON of each claims file that only exists as Markdown (`figures/<stem>_claims.md`,
written before `Claims.save` wrote `figures/<stem>_claims.json`).

    python tools/claims_to_json.py                  # every figures/repro_*_claims.md without a JSON beside it
    python tools/claims_to_json.py --force FILE.md  # these files, over their JSON
    python tools/claims_to_json.py --check-readme   # and say whether REPORT.md's claim table is the one the JSON gives

Since the JSON, the claims are data: `Claims.save` writes the JSON and renders the Markdown from it
(`claims.render_claims_markdown`), and the claim table of REPORT.md (`reproduce.update_readme_claims`) reads the JSON only.
This script is the one place left that parses a claims file's Markdown, once per file, to migrate it: the table of
claims, the **Resolution.** sentence (as numbers: its basis and the smallest differences per metric), **Cost.** (runs,
training minutes), **Setting.** (the sentence and the fields it names), **Tasks.** and the **Rule.** paragraph (`rule`:
"welch-t" when it names Welch's t, else "2se"; none: a plain comparison, `null`). A claim's own numbers (difference, SE,
degrees of freedom, threshold, margin, the paper's difference) are not in the Markdown but in its text: they are
`null`. A file is written only where the JSON renders back to the very Markdown it came from (an older "does not hold"
verdict, now "fails", is the one change allowed); otherwise the script names the file and writes nothing for it.
"""

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

from dml_nb.reproduction.claims import (
    CLAIMS_SCHEMA,
    CLAIMS_VERSION,
    SETTING_FIELDS,
    render_claims_markdown,
    write_claims,
)

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = ("difference", "se", "df", "threshold", "margin", "paper_difference", "difference_paired", "se_paired")


def parse_table(lines: list[str]) -> list[dict]:
    "The claims of a claims file's table (its lines after the header), each with the numbers the text does not give as None."
    out = []
    for line in lines:
        cells = [c.replace("\\|", "|") for c in re.split(r"(?<!\\) \| ", line.strip()[2:-2])]
        claim, verdict, numbers = (cells + ["", ""])[:3]
        verdict = "fails" if verdict == "does not hold" else verdict
        out.append({"claim": claim, "verdict": verdict, "numbers": numbers, "metric": "", **dict.fromkeys(NUMBERS)})
    return out


def parse_values(text: str) -> dict[str, float]:
    "'R@1 1.3, NMI 0.9' -> {'R@1': 1.3, 'NMI': 0.9}."
    return {m: float(v) for m, v in (part.rsplit(" ", 1) for part in text.split(", "))}


def parse_resolution(sentence: str) -> dict:
    "The resolution of a **Resolution.** sentence, as `Claims.resolution_data` gives it."
    if "No claim here compares two rows" in sentence:
        return {"basis": "none", "unpaired": {}, "paired": {}}
    if "No compared row has two seeds" in sentence:
        return {"basis": "unresolvable", "unpaired": {}, "paired": {}}
    own = re.search(r"resolves differences of at least (.*?) points \((.*)", sentence)
    paired = re.search(r"the same seeds would resolve (.*?) points\.", sentence)
    basis = "claims" if "of each claim's difference" in own.group(2) else "rows"
    return {
        "basis": basis,
        "unpaired": parse_values(own.group(1)),
        "paired": parse_values(paired.group(1)) if paired else {},
    }


def parse_setting(text: str) -> dict:
    "The **Setting.** sentence and the fields it names (`Reproduction.note`: 'Ours: dataset, backbone, N epochs, ... seeds [..], ...; paper: X.')."
    m = re.match(r"Ours: ([^,]+), ([^,]+), (\d+)(?:-(\d+))? epochs, ", text)
    seeds = re.search(r"seeds \[([\d, ]*)\]", text)
    paper = re.search(r"; paper: (.*?)\.(?: |$)", text)
    fields = {
        "dataset": m.group(1) if m else None,
        "backbone": m.group(2) if m else None,
        "epochs": [int(e) for e in m.group(3, 4) if e] if m else None,
        "seeds": [int(s) for s in seeds.group(1).split(", ") if s] if seeds else None,
        "paper_dataset": paper.group(1) if paper else None,
    }
    return {"text": text, **{k: fields[k] for k in SETTING_FIELDS}}


def parse_claims_markdown(text: str, stem: str) -> dict:
    "The JSON data (`claims.write_claims`) of a claims file's Markdown `text`."
    lines = text.split("\n")
    n = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    paragraphs = {p.split(".**", 1)[0][2:]: p for p in "\n".join(lines[n:]).strip("\n").split("\n\n") if p}
    rule_text = paragraphs.get("Rule", "")
    cost = re.match(r"\*\*Cost\.\*\* (\d+) runs, ([\d.]+) minutes of training", paragraphs.get("Cost", ""))
    return {
        "schema": CLAIMS_SCHEMA,
        "version": CLAIMS_VERSION,
        "stem": stem,
        "source": "tools/claims_to_json.py",
        "rule": ("welch-t" if "Welch" in rule_text else "2se") if rule_text else None,
        "rule_text": rule_text,
        "claims": parse_table(lines[2:n]),
        "resolution": parse_resolution(paragraphs["Resolution"]) if "Resolution" in paragraphs else None,
        "cost": {"runs": int(cost.group(1)), "training_minutes": float(cost.group(2))} if cost else None,
        "setting": parse_setting(paragraphs["Setting"][len("**Setting.** ") :]) if "Setting" in paragraphs else None,
        "tasks": paragraphs["Tasks"][len("**Tasks.** ") :] if "Tasks" in paragraphs else "",
    }


def convert(md: Path) -> Path | None:
    "Write the JSON of the claims file `md` beside it, if it renders back to `md`'s text; returns its path (None: not written)."
    text, stem = md.read_text(), md.name[: -len("_claims.md")]
    data = parse_claims_markdown(text, stem)
    if render_claims_markdown(data) != text.replace("| does not hold |", "| fails |"):
        print(f"{md}: its JSON would not render back to it; not written", file=sys.stderr)
        return None
    return write_claims(md.parent, data)


def readme_matches(readme: Path, figures: Path) -> bool:
    "Whether `update_readme_claims` on the claims files' JSON leaves `readme`'s claim table as it is."
    from dml_nb.reproduction.reproduce import update_readme_claims

    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / readme.name
        copy.write_text(readme.read_text())
        update_readme_claims(copy, figures)
        diff = difflib.unified_diff(readme.read_text().splitlines(), copy.read_text().splitlines(), lineterm="", n=0)
        print("\n".join(diff), file=sys.stderr)
        return copy.read_text() == readme.read_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Write the JSON of claims files that only exist as Markdown (a migration)."
    )
    ap.add_argument("files", nargs="*", type=Path, help="claims Markdown files (default: figures/repro_*_claims.md)")
    ap.add_argument("--force", action="store_true", help="write over an existing JSON")
    ap.add_argument("--check-readme", action="store_true", help="check REPORT.md's claim table against the JSON")
    args = ap.parse_args(argv)
    files = args.files or sorted((ROOT / "figures").glob("repro_*_claims.md"))
    todo = [f for f in files if args.force or not f.with_suffix(".json").exists()]
    written = [p for p in map(convert, todo) if p is not None]
    print(f"{len(written)} of {len(todo)} claims file(s) written as JSON ({len(files) - len(todo)} had one)")
    ok = len(written) == len(todo)
    if args.check_readme:
        same = readme_matches(ROOT / "REPORT.md", ROOT / "figures")
        print("REPORT.md's claim table is the one the JSON gives" if same else "REPORT.md's claim table differs")
        ok = ok and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
