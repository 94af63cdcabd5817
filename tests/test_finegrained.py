"The embedded fine-grained set: fixed disjoint class sets, deterministic images, sizes and types, load_dataset."

import numpy as np
import pytest

from dml_nb.data.datasets import load_dataset
from dml_nb.core.config import make_config
from dml_nb.data.finegrained import (
    CLASSES_PER_SPLIT,
    FACTORS,
    factor_grid,
    finegrained_classes,
    make_finegrained,
    render_finegrained,
)


def test_three_class_sets_are_disjoint_and_cover_every_combination():
    sets = {s: finegrained_classes(s) for s in ("train", "test", "pretrain")}
    assert [len(v) for v in sets.values()] == [CLASSES_PER_SPLIT, CLASSES_PER_SPLIT, 3840 - 2 * CLASSES_PER_SPLIT]
    assert set(sets["train"]).isdisjoint(sets["test"])
    assert set(sets["pretrain"]).isdisjoint(set(sets["train"]) | set(sets["test"]))
    assert len(np.unique(np.concatenate(list(sets.values())))) == len(factor_grid()) == 3840
    grid = factor_grid()  # what the sets share is factor values, never combinations
    for i, values in enumerate(FACTORS.values()):
        for s in sets.values():
            assert len(np.unique(grid[s, i])) == len(values)
    np.testing.assert_array_equal(finegrained_classes("train"), sets["train"])  # fixed, no seed involved


def test_images_are_deterministic_and_depend_on_the_seed():
    c = finegrained_classes("test")[0]
    a, b = render_finegrained(c, 5, seed=3), render_finegrained(c, 5, seed=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, render_finegrained(c, 5, seed=4))
    x, y = make_finegrained("train", 3, num_classes=4), make_finegrained("train", 3, num_classes=4)
    np.testing.assert_array_equal(x.images, y.images)


@pytest.mark.parametrize("size", [32, 48])
def test_sizes_dtype_and_factor_ids(size):
    ds = make_finegrained("pretrain", images_per_class=3, size=size, num_classes=7)
    assert ds.images.shape == (21, size, size, 3) and ds.images.dtype == np.uint8
    assert ds.num_classes == 7 and ds.labels.dtype == np.int64 and sorted(set(ds.labels)) == list(range(7))
    np.testing.assert_array_equal(np.sort(ds.class_ids), np.sort(finegrained_classes("pretrain")[:7]))
    grid = factor_grid()[ds.class_ids[ds.labels]]
    np.testing.assert_array_equal(np.stack([ds.shape_ids, ds.texture_ids, ds.palette_ids, ds.part_ids], 1), grid)
    assert ds.images.std() > 20  # not blank


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="between 2 and 100"):
        make_finegrained("test", num_classes=101)
    with pytest.raises(ValueError, match="between 32 and 64"):
        make_finegrained("test", size=16)
    with pytest.raises(ValueError, match="at least 2"):
        make_finegrained("test", images_per_class=1)
    with pytest.raises(ValueError, match="pretrain, test, train"):
        make_finegrained("val")


def test_load_dataset_and_config_know_the_name():
    tr = load_dataset("finegrained", split="train", images_per_class=2, num_classes=3)
    te = load_dataset("finegrained", split="test", images_per_class=2, num_classes=3)
    x, y = tr[0]
    assert x.shape == (3, 32, 32) and x.dtype.is_floating_point and y == tr.labels[0]
    assert set(tr.class_ids).isdisjoint(te.class_ids)
    with pytest.raises(Exception, match="pretrain|split"):
        load_dataset("finegrained", split="pretrain")
    assert make_config({"data": {"name": "finegrained"}}).data.name == "finegrained"


def test_config_images_per_class_reaches_the_finegrained_set():
    "`data.images_per_class` in a config is passed to the embedded fine-grained set (it was once silently ignored)."
    from dml_nb.core.config import make_config
    from dml_nb.data.build import build_datasets

    train, evals = build_datasets(make_config({"data": {"name": "finegrained", "images_per_class": 4}}), progress=False)
    assert len(train) == 100 * 4 and len(evals["test"]) == 100 * 4


def test_novel_family_is_never_shown_to_the_pretraining_pool():
    "`finegrained_novel`: train and test are combinations of the family's shapes and textures, the pool uses none of them."
    from dml_nb.data.finegrained import NOVEL_FAMILY, novel_classes

    sets = {s: novel_classes(s) for s in ("train", "test", "pretrain")}
    assert [len(v) for v in sets.values()] == [CLASSES_PER_SPLIT, CLASSES_PER_SPLIT, 8 * 6 * 8 * 4]
    assert len(np.unique(np.concatenate(list(sets.values())))) == 2 * CLASSES_PER_SPLIT + 8 * 6 * 8 * 4  # disjoint
    grid = factor_grid()
    for f, values in NOVEL_FAMILY.items():
        i, ids = list(FACTORS).index(f), {FACTORS[f].index(v) for v in values}
        assert set(grid[sets["pretrain"], i]).isdisjoint(ids)
        assert set(grid[sets["train"], i]) == ids == set(grid[sets["test"], i])  # every family value, in both splits
    for i, f in enumerate(FACTORS):  # palettes and parts are shared, as colour is between ImageNet and birds
        if f not in NOVEL_FAMILY:
            assert len(np.unique(grid[sets["pretrain"], i])) == len(FACTORS[f])
    np.testing.assert_array_equal(novel_classes("test"), sets["test"])  # fixed, no seed involved
    np.testing.assert_array_equal(finegrained_classes("train")[:3], [3354, 1351, 489])  # finegrained's layout unchanged


def test_finegrained_novel_loads_by_name_and_from_a_config():
    from dml_nb.data.build import build_datasets
    from dml_nb.data.finegrained import novel_classes

    ds = load_dataset("finegrained_novel", split="test", images_per_class=2, num_classes=3)
    assert ds.name == "finegrained_novel" and set(ds.class_ids) == set(novel_classes("test")[:3])
    assert ds[0][0].shape == (3, 32, 32)
    np.testing.assert_array_equal(
        make_finegrained("train", 2, num_classes=2, layout="novel").images,
        load_dataset("finegrained_novel", images_per_class=2, num_classes=2).images,
    )
    train, evals = build_datasets(
        make_config({"data": {"name": "finegrained_novel", "images_per_class": 3}}), progress=False
    )
    assert (
        len(train) == 100 * 3 and len(evals["test"]) == 100 * 3 and set(train.class_ids) == set(novel_classes("train"))
    )
    with pytest.raises(ValueError, match="novel, shared"):
        make_finegrained("train", layout="other")
    with pytest.raises(ValueError, match="finegrained_novel/test must be between 2 and 100"):
        make_finegrained("test", num_classes=101, layout="novel")


def test_premise_layout_evaluates_heldout_images_and_its_own_test_count():
    "Regime v3's data path: the held-out split as the training-class evaluation, the test split's own image count."
    from dml_nb.data.build import build_data

    cfg = make_config(
        {
            "data": {
                "name": "finegrained_premise",
                "images_per_class": 4,
                "test_images_per_class": 6,
                "train_eval_split": "heldout",
            },
            "eval": {"metrics": ["recall@1"]},
        }
    )
    train, evals, _ = build_data(cfg, progress=False)
    assert (train.split, evals["train"].split, evals["test"].split) == ("train", "heldout", "test")
    assert len(train) == 78 * 4 and len(evals["train"]) == 78 * 4 and len(evals["test"]) == 100 * 6
    assert not np.array_equal(train.images, evals["train"].images)  # new images of the same classes
    np.testing.assert_array_equal(train.class_ids, evals["train"].class_ids)
    g = factor_grid()
    train_triples = {tuple(g[c, :3]) for c in train.class_ids}
    assert train_triples.isdisjoint({tuple(g[c, :3]) for c in evals["test"].class_ids})


@pytest.mark.parametrize(
    "data, words",
    [
        ({"name": "shapes", "train_eval_split": "heldout"}, ["data.train_eval_split", "train"]),
        ({"name": "finegrained_premise", "train_eval_split": "test"}, ["data.train_eval_split", "heldout"]),
        ({"name": "cub200", "test_images_per_class": 8}, ["test_images_per_class", "remove it"]),
    ],
)
def test_bad_evaluation_splits_are_named_with_their_fix(data, words):
    from dml_nb.core.params import ConfigError

    with pytest.raises(ConfigError) as e:
        make_config({"data": data})
    assert all(w in str(e.value) for w in words), str(e.value)
