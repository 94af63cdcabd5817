"""The epoch from which a task goes idle: `idle_epochs` applies `task_health` to every epoch of a run's history, and the
claims file's **Tasks.** sentence (`Reproduction.tasks`) says, per row and task, "idle from epoch E in k of n seeds",
each seed's epochs, and which tasks were never idle; on synthetic histories and on the flagship's committed DiVA runs."""

import types
from pathlib import Path

import pandas as pd
import pytest
import yaml

import dml_nb.reproduction.notebook as N
from dml_nb.core.base import project_root
from dml_nb.methods.base import task_health


def history(idle_b_from=3, idle_c_at=(2,), epochs=5):
    """Three tasks over `epochs` epochs: `a` always trains, `b` has a zero loss and gradient from epoch `idle_b_from`
    (None: never), `c` a gradient 4e-5 of a's at the epochs `idle_c_at` and trains again after."""
    return pd.DataFrame(
        [
            {
                "epoch": e,
                "loss/a": 0.5,
                "grad/a": 0.25,
                "loss/b": 0.0 if idle_b_from is not None and e >= idle_b_from else 0.3,
                "grad/b": 0.0 if idle_b_from is not None and e >= idle_b_from else 0.2,
                "nonzero_weights/b": 0.9,
                "loss/c": 0.4,
                "grad/c": 1e-5 if e in idle_c_at else 0.2,
            }
            for e in range(1, epochs + 1)
        ]
    )


def test_idle_epochs_gives_the_epoch_from_which_a_task_stays_idle():
    got = N.idle_epochs(history())
    assert {t: (v["idle"], v["from"]) for t, v in got.items()} == {
        "a": ([], None),  # never idle
        "b": ([3, 4, 5], 3),  # idle from epoch 3 to the end
        "c": ([2], None),  # idle at epoch 2 only, then trains again: not idle from any epoch
    }
    assert got["b"]["last"]["why"] == "zero loss and gradient" and got["c"]["last"]["alive"]
    # the criterion is task_health's, epoch by epoch: the same verdict as task_health on each epoch
    h = history()
    for e in h["epoch"]:
        alive = {t: v["alive"] for t, v in task_health(h, epoch=e).items()}
        assert alive == {t: e not in v["idle"] for t, v in got.items()}
    idle_again = N.idle_epochs(history(idle_b_from=None, idle_c_at=(2, 4, 5)))
    assert (idle_again["c"]["idle"], idle_again["c"]["from"]) == ([2, 4, 5], 4)  # the last run of idle epochs
    with pytest.raises(ValueError, match="an 'epoch' in every row"):
        N.idle_epochs([{"loss": 1.0}])


def test_the_report_says_from_which_epoch_in_how_many_seeds(tmp_path, monkeypatch):
    hist = {
        "d0": history(idle_b_from=3),
        "d1": history(idle_b_from=3, idle_c_at=()),
        "d2": history(idle_b_from=4, idle_c_at=()),
        "d3": history(idle_b_from=None, idle_c_at=(2, 3)),
        "m0": pd.DataFrame([{"epoch": e, "loss/p": 0.5, "grad/p": 0.2, "loss/q": 0.4, "grad/q": 0.1} for e in (1, 2)]),
        "s0": pd.DataFrame([{"epoch": e, "loss": 0.3, "grad_norm": 0.1} for e in (1, 2)]),
    }
    monkeypatch.setattr(N, "load_result", lambda d: types.SimpleNamespace(history_frame=lambda: hist[Path(d).name]))
    nb = N.Reproduction("repro_demo", "shapes", "cub200", {}, [0, 1, 2, 3], tmp_path, tmp_path, False)
    nb.per_seed = pd.DataFrame(
        {
            "row": ["X"] * 4 + ["Two", "One", "One"],
            "seed": [0, 1, 2, 3, 0, 0, 1],
            "status": ["ok"] * 6 + ["not run: no GPU"],
            "run": ["d0", "d1", "d2", "d3", "m0", "s0", None],
        }
    )
    frame = N.idle_frame(nb.per_seed, tmp_path)
    x = frame[frame["row"] == "X"].set_index(["seed", "task"])
    assert [x.loc[(s, "b"), "idle_from"] for s in range(3)] == [3, 3, 4] and pd.isna(x.loc[(3, "b"), "idle_from"])
    assert set(frame.loc[frame["row"] == "X", "tasks"]) == {3} and set(frame.loc[frame["row"] == "One", "tasks"]) == {1}
    text = nb.tasks()
    assert (
        "X: b idle from epoch 3 in 2 of 4 seeds, from epoch 4 in 1 of 4 seeds, not idle at the end in 1 of 4 "
        "(seed 0: from 3; seed 1: from 3; seed 2: from 4; seed 3: never; in the last epoch: zero loss and gradient; "
        "mean nonzero_weights 0.90)"
    ) in text
    assert (
        "c never stayed idle to the end (seed 0: epoch 2, then active; seed 1: never; seed 2: never; "
        "seed 3: epochs 2, 3, then active); a never idle."
    ) in text
    assert text.endswith("Never idle in any epoch: every task of Two (p, q; 1 seed); the single-task rows One.")
    assert "below 1e-3 of the largest task's" in text
    for run in ("d0", "d1", "d2", "d3"):
        hist[run] = history(idle_b_from=None, idle_c_at=())
    assert ": none. Never idle in any epoch: every task of X (a, b, c; 4 seeds), Two (p, q; 1 seed)" in nb.tasks()
    nb.per_seed = nb.per_seed.assign(status="not run: no GPU")
    assert nb.tasks() == ""


FLAGSHIP_DIVA = [  # the flagship's DiVA-512 runs, seeds 0-4 (run_dir_for of repro_table3's row, outside tests)
    "diva-finegrained_novel-08af575d4f55",
    "diva-finegrained_novel-1a3a970bd0fe",
    "diva-finegrained_novel-a1d38df18e73",
    "diva-finegrained_novel-a8be10bca295",
    "diva-finegrained_novel-9c4e791bd2f2",
]


def flagship_diva_runs() -> list[Path]:
    """The committed runs of the flagship's DiVA-512 row in `results/` (read, never written), each checked to be that
    row's config: DiVA's four tasks on a 512-d embedding, 8 epochs, its seed."""
    runs = [project_root() / "results" / r for r in FLAGSHIP_DIVA]
    for seed, run in enumerate(runs):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["seed"] == seed and cfg["train"]["epochs"] == 8, run.name
        assert cfg["method"]["name"] == "diva" and cfg["method"]["options"]["embedding_dim"] == 512, run.name
        assert cfg["method"]["options"]["tasks"] == ["discriminative", "shared", "intra", "dance"], run.name
        assert not {"separate", "decorrelation"} & set(cfg["method"]["options"]), run.name
    return runs


def test_dance_in_the_flagships_committed_diva_runs(tmp_path, monkeypatch):
    "DaNCE's loss collapses at epoch 4 in four seeds; seed 0 flickers around the 1e-3 line and trains again at the end."
    monkeypatch.delenv("DML_RESULTS", raising=False)  # load_result would save what it reads there
    runs = flagship_diva_runs()
    assert all((r / "history.csv").is_file() for r in runs), "the flagship's DiVA-512 runs are committed in results/"
    got = [N.idle_epochs(pd.read_csv(r / "history.csv")) for r in runs]
    assert [g["dance"]["from"] for g in got] == [None, 4, 4, 4, 5]
    assert got[0]["dance"]["idle"] == [4, 6, 7] and got[4]["dance"]["idle"] == [5, 6, 7, 8]
    assert all(g[t]["idle"] == [] for g in got for t in ("discriminative", "shared", "intra"))
    nb = N.Reproduction(
        "repro_table3", "finegrained_novel", "cub200", {}, [0, 1, 2, 3, 4], tmp_path, runs[0].parent, False
    )
    nb.per_seed = pd.DataFrame({"row": "DiVA-512", "seed": range(5), "status": "ok", "run": [r.name for r in runs]})
    text = nb.tasks()
    assert (
        "DiVA-512: dance idle from epoch 4 in 3 of 5 seeds, from epoch 5 in 1 of 5 seeds, not idle at the end in 1 of "
        "5 (seed 0: epochs 4, 6, 7, then active; seed 1: from 4; seed 2: from 4; seed 3: from 4; seed 4: from 5; in "
        "the last epoch: zero loss and gradient; mean positive_similarity 0.95; mean nonzero_weights 1.00); "
        "discriminative, shared, intra never idle."
    ) in text
