"Dataset readers on tiny trees written in each real on-disk format, embedded sets, label noise."

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from dml_nb.core.registry import DATASETS, SPLITS
from dml_nb.data.datasets import add_label_noise, load_dataset, make_shapes
from dml_nb.data.checks import write_fake_dataset


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    return {
        n: write_fake_dataset(n, base / n, n_classes=8, per_class=3)
        for n in ("cub200", "cars196", "sop", "inshop", "vehicleid")
    }


@pytest.mark.parametrize("name", ["cub200", "cars196", "sop"])
def test_half_class_splits(trees, name):
    tr, te = load_dataset(name, trees[name], "train"), load_dataset(name, trees[name], "test")
    assert (len(tr), len(te)) == (12, 12)
    assert tr.num_classes == te.num_classes == 4
    assert set(tr.class_ids).isdisjoint(te.class_ids)
    assert tr.labels.dtype == np.int64 and sorted(set(tr.labels)) == [0, 1, 2, 3]
    x, y = tr[5]
    assert isinstance(x, torch.Tensor) and x.shape == (3, 224, 224) and y == tr.labels[5]


def test_cub_root_is_folder_or_parent(trees):
    a = load_dataset("cub200", trees["cub200"], "train")
    b = load_dataset("cub200", trees["cub200"] / "CUB_200_2011", "train")
    assert [p.name for p in a.paths] == [p.name for p in b.paths]
    assert list(a.class_ids) == [1, 2, 3, 4]
    # every image's folder is its class
    for p, lab in zip(a.paths, a.labels):
        assert int(p.parent.name.split(".")[0]) == a.class_ids[lab]


def test_cub_without_image_class_labels(trees, tmp_path):
    root = write_fake_dataset("cub200", tmp_path / "c", n_classes=6, per_class=2)
    ref = load_dataset("cub200", root, "test")
    (root / "CUB_200_2011" / "image_class_labels.txt").unlink()
    ds = load_dataset("cub200", root, "test")
    assert list(ds.class_ids) == [4, 5, 6] and (ds.labels == ref.labels).all()


def test_cars_class_ids_come_from_the_mat_not_file_order(trees):
    from scipy.io import loadmat

    ann = loadmat(trees["cars196"] / "cars_annos.mat", squeeze_me=True)["annotations"]
    cls = dict(zip(ann["relative_im_path"], ann["class"]))
    tr = load_dataset("cars196", trees["cars196"], "train", transform=None)
    for p, lab in zip(tr.paths, tr.labels):
        assert cls[f"car_ims/{p.name}"] == tr.class_ids[lab] <= 4
    assert list(tr.class_ids) == [1, 2, 3, 4]
    # file order is not class order in the fake file either, as in the real one
    assert list(ann["class"][:8]) != sorted(ann["class"][:8])


def test_sop_reads_header_and_paths(trees):
    te = load_dataset("sop", trees["sop"], "test", transform=None)
    assert list(te.class_ids) == [5, 6, 7, 8]
    assert all(p.exists() for p in te.paths) and isinstance(te[0][0], Image.Image)


def test_inshop_query_gallery_share_labels(trees):
    r = trees["inshop"]
    tr, q, g = (load_dataset("inshop", r, s) for s in ("train", "query", "gallery"))
    assert (len(tr), len(q), len(g)) == (12, 4, 8)
    assert tr.num_classes == 4 and q.num_classes == g.num_classes == 4
    # the same item gets the same label in query and gallery
    for i in range(len(q)):
        item = q.paths[i].parent.name
        gl = {g.labels[j] for j in range(len(g)) if g.paths[j].parent.name == item}
        assert gl == {q.labels[i]}
    assert len(load_dataset("inshop", r, "test")) == 12


def test_vehicleid_splits(trees):
    r = trees["vehicleid"]
    sizes = {s: len(load_dataset("vehicleid", r, s)) for s in SPLITS["vehicleid"]}
    assert sizes == {"train": 6, "test": 6, "test800": 6, "test1600": 12, "test2400": 18}
    assert load_dataset("vehicleid", r, "test2400").num_classes == 6


def test_counts_come_from_files(tmp_path):
    root = write_fake_dataset("cub200", tmp_path / "cub", n_classes=10, per_class=2)
    assert load_dataset("cub200", root, "train").num_classes == 5


def test_missing_root_names_files_and_env(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="cars_annos.mat"):
        load_dataset("cars196", tmp_path / "nothing")
    monkeypatch.setenv("DML_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"Ebay_train.txt.*DML_DATA"):
        load_dataset("sop")
    monkeypatch.delenv("DML_DATA")
    with pytest.raises(FileNotFoundError, match="DML_DATA is not set"):
        load_dataset("sop")


def test_unknown_name_split_option():
    with pytest.raises(ValueError, match="Valid datasets: cars196, cub200"):
        load_dataset("cars")
    with pytest.raises(ValueError, match="query"):
        load_dataset("inshop", "/x", split="validation")
    with pytest.raises(TypeError, match="images_per_class"):
        load_dataset("shapes", images_per_clas=3)


def test_unreadable_image_named_or_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = write_fake_dataset("sop", tmp_path / "sop", n_classes=4, per_class=3)
    bad = sorted((root / "bicycle_final").glob("*.JPG"))[0]
    bad.write_bytes(b"not a jpeg")
    ds = load_dataset("sop", root, "train")
    with pytest.raises(OSError, match=rf"{bad.name}.*on_unreadable='skip'.*--set data.on_unreadable=skip"):
        [ds[i] for i in range(len(ds))]
    with pytest.raises(ValueError, match=rf"1 of 6 images of sop train cannot be read: .*{bad.name}"):
        load_dataset("sop", root, "train", on_unreadable="error")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = load_dataset("sop", root, "train", on_unreadable="skip")
    assert len(ds) == 5 and sum("skipped 1 unreadable" in str(x.message) and bad.name in str(x.message) for x in w) == 1
    [ds[i] for i in range(len(ds))]
    with pytest.raises(TypeError, match="Valid options: transform, preset, augment, size, on_unreadable"):
        load_dataset("sop", root, "train", skip_unreadable=True)


def test_transform_options(trees):
    r = trees["cub200"]
    assert load_dataset("cub200", r, preset="bninception")[0][0].shape == (3, 227, 227)
    assert load_dataset("cub200", r, size=64)[0][0].shape == (3, 64, 64)
    x1 = load_dataset("cub200", r, "train", augment=False)[0][0]
    x2 = load_dataset("cub200", r, "train", augment=False)[0][0]
    assert torch.equal(x1, x2)  # test transform: deterministic


def test_embedded_sets():
    sh = load_dataset("shapes", split="test", images_per_class=3, size=48)
    assert len(sh) == 180 and sh.num_classes == 60 and sh[0][0].shape == (3, 48, 48)
    dg = load_dataset("digits", split="train")
    assert dg.num_classes == 5 and dg[0][0].shape == (3, 32, 32) and set(dg.class_ids) == {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="between 32 and 64"):
        make_shapes(size=16)
    assert set(DATASETS) == set(SPLITS)


def test_label_noise_protocol():
    y = np.repeat(np.arange(7), [10, 12, 9, 30, 11, 10, 20])
    noisy, flipped = add_label_noise(y, 0.3, seed=4)
    for c, n in zip(range(7), [10, 12, 9, 30, 11, 10, 20]):
        assert flipped[y == c].sum() == round(0.3 * n)
    assert (noisy[flipped] != y[flipped]).all() and (noisy[~flipped] == y[~flipped]).all()
    assert set(noisy[flipped]) == set(range(7))
    again, _ = add_label_noise(y, 0.3, seed=4)
    other, _ = add_label_noise(y, 0.3, seed=5)
    assert (again == noisy).all() and (other != noisy).any()


# each backbone's transforms: the papers' numbers, which make_transform reads from the backbone ------------------

_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_CAFFE = ((0.502, 0.4588, 0.4078), (1 / 255,) * 3)


@pytest.mark.parametrize(
    "preset,size,crop,resize,norm,bgr,scale,ratio",
    [
        ("resnet50", None, 224, 256, _IMAGENET, False, (0.08, 1.0), (3 / 4, 4 / 3)),
        ("resnet50", 250, 250, 286, _IMAGENET, False, (0.08, 1.0), (3 / 4, 4 / 3)),  # 256/224 of the crop, rounded
        ("googlenet", None, 224, 256, _IMAGENET, False, (0.08, 1.0), (3 / 4, 4 / 3)),
        ("googlenet", 227, 227, 259, _IMAGENET, False, (0.08, 1.0), (3 / 4, 4 / 3)),
        ("bninception", None, 227, 256, _CAFFE, True, (0.08, 1.0), (3 / 4, 4 / 3)),
        ("bninception", 224, 224, 256, _CAFFE, True, (0.08, 1.0), (3 / 4, 4 / 3)),
        ("small", 32, 32, 32, ((0.5,) * 3, (0.5,) * 3), False, (0.7, 1.0), (0.9, 1.1)),
        ("small_cnn", 48, 48, 48, ((0.5,) * 3, (0.5,) * 3), False, (0.7, 1.0), (0.9, 1.1)),
    ],
)
def test_the_papers_transform_numbers(preset, size, crop, resize, norm, bgr, scale, ratio):
    from dml_nb.data.datasets import make_transform

    train, test = make_transform(preset, train=True, size=size), make_transform(preset, size=size)
    names = lambda t: [type(o).__name__ for o in t.transforms]
    tail = ["Normalize"] + (["ToBGR"] if bgr else [])
    assert names(train) == ["ToImage", "ToDtype", "RandomResizedCrop", "RandomHorizontalFlip", *tail]
    assert names(test) == ["ToImage", "ToDtype", "Resize", "CenterCrop", *tail]
    assert names(make_transform(preset, train=True, size=size, flip=False)) == [
        "ToImage",
        "ToDtype",
        "RandomResizedCrop",
        *tail,
    ]
    rrc, rs, cc, nm = train.transforms[2], test.transforms[2], test.transforms[3], test.transforms[4]
    assert (tuple(rrc.size), rrc.scale, rrc.ratio, tuple(rs.size), tuple(cc.size)) == (
        (crop,) * 2,
        scale,
        ratio,
        (resize,),
        (crop,) * 2,
    )
    assert (tuple(nm.mean), tuple(nm.std)) == norm and train.transforms[-len(tail)].mean == nm.mean
    assert train.preprocessing == test.preprocessing


def test_unknown_preset_and_missing_size_are_errors():
    from dml_nb.data.datasets import make_transform

    with pytest.raises(ValueError, match="Did you mean 'resnet50'"):
        make_transform("resnet")
    with pytest.raises(ValueError, match="needs size="):
        make_transform("small")
