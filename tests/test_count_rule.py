"""The count rule keeps DiVA's queue at 30 batches in every row that shares DiVA's options, so rows without a queue
task (D+S, D+I of Table 2) got new run folders too. The queue's count changes no bit of such a row's training: what
`figures/README.md` relies on when it reads their moves as the other CPU's, not the rule's."""

from dml_nb.experiments.experiment import run

from test_reliability import TINY


def test_a_diva_row_without_a_queue_task_trains_the_same_whatever_its_queue_count(tmp_path):
    runs = []
    for q in (2, 30):
        method = {"name": "diva", "embedding_dim": 16, "tasks": ["discriminative", "intra"], "queue_batches": q}
        runs.append(
            run(
                {**TINY, "method": method, "train": {**TINY["train"], "epochs": 2}},
                runs_dir=tmp_path,
                progress=False,
                threads=1,
            )
        )
    a, b = runs
    assert a.run_dir != b.run_dir  # another config, another folder
    assert a.metrics == b.metrics
    drop = lambda h: [{k: v for k, v in e.items() if k != "time"} for e in h]
    assert drop(a.history) == drop(b.history)
