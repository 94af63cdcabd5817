"""Checks of dml_nb.data.cache: the batched crop/resize against torchvision, the box sampler against torchvision's,
the cache file against the PIL path (same crop boxes, same pixels up to the cache's extra resampling), reuse,
invalidation, loader workers, and the errors for bad input. All on the CPU."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from dml_nb.data.cache import (
    BatchAugment,
    RawItems,
    cache_images,
    center_crop_boxes,
    crop_resize,
    pad_collate,
    random_resized_crop_boxes,
)
from dml_nb.data.datasets import ImageListDataset, load_dataset, make_transform
from dml_nb.data.checks import write_fake_dataset

torch.set_num_threads(min(2, torch.get_num_threads()))


def smooth(h, w, seed):
    low = torch.rand(1, 3, h // 16 + 2, w // 16 + 2, generator=torch.Generator().manual_seed(seed))
    x = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)[0]
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


@pytest.fixture
def jpegs(tmp_path):
    "Five JPEGs of CUB-like sizes (one already below 256 px), as an ImageListDataset with the ResNet50 train transform."
    paths = []
    for i, (h, w) in enumerate([(375, 500), (500, 333), (300, 300), (240, 320), (600, 450)]):
        p = tmp_path / "data" / "images" / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth(h, w, i).permute(1, 2, 0).numpy()).save(p, quality=95)
        paths.append(p)
    return ImageListDataset(paths, [0, 0, 1, 1, 2], make_transform("resnet50", train=True), name="toy", split="train")


@pytest.mark.parametrize("seed", range(2))
def test_crop_resize_matches_torchvision(seed):
    g = torch.Generator().manual_seed(seed)
    img = (torch.rand(3, 70, 110, generator=g) * 255).to(torch.uint8)
    boxes = random_resized_crop_boxes([70] * 12, [110] * 12, generator=g)
    flip = torch.rand(12, generator=g) < 0.5
    for size in (16, 48, 130):
        out = crop_resize(img[None].expand(12, -1, -1, -1), *boxes.T, size, flip)
        for k in range(12):
            ref = TF.resized_crop(img.float(), *boxes[k].tolist(), [size, size], antialias=True)
            assert torch.allclose(out[k], ref.flip(-1) if flip[k] else ref, atol=0.02), (size, k)


def test_box_sampler_matches_torchvision_in_distribution():
    H, W, n = 120, 300, 2000
    ours = random_resized_crop_boxes([H] * 40000, [W] * 40000, generator=torch.Generator().manual_seed(0)).double()
    torch.manual_seed(0)
    tv = torch.tensor(
        [v2.RandomResizedCrop.get_params(torch.zeros(1, H, W), (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(n)]
    ).double()
    for f in (
        lambda b: b[:, 2] * b[:, 3] / (H * W),
        lambda b: b[:, 3] / b[:, 2],
        lambda b: b[:, 1] / (W - b[:, 3] + 1),
        lambda b: (b[:, 2] == H).double(),
    ):
        assert float(f(ours).mean()) == pytest.approx(float(f(tv).mean()), abs=float(4 * f(tv).std() / n**0.5) + 1e-9)
    assert (ours[:, 0] + ours[:, 2] <= H).all() and (ours[:, 1] + ours[:, 3] <= W).all() and (ours[:, :2] >= 0).all()


@pytest.mark.parametrize("preset", ["resnet50", "bninception", "small"])
def test_test_pipeline_on_a_padded_batch_matches_make_transform(preset):
    size = 48
    aug = BatchAugment.from_transform(make_transform(preset, train=False, size=size))
    assert aug == aug.test_version() or not aug.train_mode
    imgs = [
        (torch.rand(3, h, w, generator=torch.Generator().manual_seed(h)) * 255).to(torch.uint8)
        for h, w in [(60, 80), (90, 56), (56, 56)]
    ]
    batch = pad_collate([{"x": im, "y": 1, "index": i} for i, im in enumerate(imgs)])
    out = aug(batch["x"], batch["sizes"])
    for k, im in enumerate(imgs):
        ref = make_transform(preset, train=False, size=size)(im)
        assert (out[k] - ref).abs().max() <= 1e-4 * ref.abs().max(), k


def test_augmentation_is_deterministic_given_the_generator():
    aug = BatchAugment.from_transform(make_transform("resnet50", train=True, size=32))
    x = (torch.rand(4, 3, 50, 60) * 255).to(torch.uint8)
    a = aug(x, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, aug(x, generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(a, aug(x, generator=torch.Generator().manual_seed(6)))


def test_cache_matches_the_pil_path(jpegs):
    cached = cache_images(jpegs, progress=False)
    assert cached.path.parent == jpegs.paths[0].parent / ".dml_nb_cache"
    assert [tuple(cached.load(i).shape[1:]) for i in range(5)] == [
        (256, 341),
        (384, 256),
        (256, 256),
        (240, 320),
        (341, 256),
    ]
    errors = []
    for i in range(len(jpegs)):
        orig, img = TF.pil_to_tensor(jpegs.load(i)), cached.load(i)
        sy, sx = img.shape[1] / orig.shape[1], img.shape[2] / orig.shape[2]
        boxes = random_resized_crop_boxes(
            [orig.shape[1]] * 10, [orig.shape[2]] * 10, generator=torch.Generator().manual_seed(i)
        )
        out = (
            crop_resize(
                img[None].expand(10, -1, -1, -1),
                boxes[:, 0] * sy,
                boxes[:, 1] * sx,
                boxes[:, 2] * sy,
                boxes[:, 3] * sx,
                224,
            )
            / 255
        )
        for k in range(10):
            ref = TF.resized_crop(orig.float() / 255, *boxes[k].tolist(), [224, 224], antialias=True)
            errors.append(((out[k] - ref).abs().mean().item(), (out[k] - ref).abs().max().item()))
    errors = np.array(errors)
    assert errors[:, 0].max() < 0.01 and errors[:, 1].max() < 0.1, errors.max(0)
    # the test transform: the same pixels up to the cache's uint8 rounding
    view = cached.eval_view()
    batch = pad_collate([RawItems(view)[(i, 0)] for i in range(5)])
    out = view.batch_transform(batch["x"], batch["sizes"])
    for i in range(5):
        ref = make_transform("resnet50", train=False)(jpegs.load(i))
        assert (out[i] - ref).abs().max() <= 0.6 / (255 * 0.224)


def test_cache_is_reused_and_follows_changes(jpegs, tmp_path):
    a = cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    stamp = os.stat(a.path).st_mtime_ns
    b = cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    assert b.path == a.path and os.stat(b.path).st_mtime_ns == stamp
    Image.fromarray(smooth(100, 120, 9).permute(1, 2, 0).numpy()).save(jpegs.paths[2], quality=80)  # a file changes
    c = cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    assert c.path != a.path and tuple(c.load(2).shape) == (3, 100, 120)


def test_loader_workers_read_the_memory_map(jpegs, tmp_path):
    cached = cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    cached.load(0)  # the parent has mapped the file: workers must map their own
    loader = torch.utils.data.DataLoader(RawItems(cached), batch_size=5, num_workers=2, collate_fn=pad_collate)
    batch = next(iter(loader))
    for i in range(5):
        h, w = batch["sizes"][i].tolist()
        assert torch.equal(batch["x"][i, :, :h, :w], cached.load(i))
    assert batch["y"].tolist() == list(jpegs.labels)


def test_real_reader_and_label_noise_pass_through(tmp_path):
    root = write_fake_dataset("cub200", tmp_path / "cub", n_classes=4, per_class=3, size=40)
    ds = load_dataset("cub200", root=root, split="train", size=32)
    cached = cache_images(ds, cache_dir=tmp_path / "c", progress=False)
    assert len(cached) == len(ds) and cached.num_classes == ds.num_classes
    ds.labels = ds.labels[::-1].copy()  # set on the source later (label noise): seen through the cache
    assert list(cached.labels) == list(ds.labels)
    x, y = cached[1]
    assert x.shape == (3, 32, 32) and y == ds.labels[1]


def test_embedded_sets_are_used_in_memory():
    ds = load_dataset("shapes", split="train", images_per_class=2)
    cached = cache_images(ds)
    assert cached.path is None and cached.array is ds.images
    assert torch.equal(cached.load(3), ds.load(3))


def test_errors_name_the_problem_and_the_fix(jpegs, tmp_path):
    cached = cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    with open(cached.path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="incomplete or damaged.*to rebuild the cache"):
        cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    index = cached.path.with_name(cached.path.name.replace(".u8", ".idx.npz"))
    index.write_bytes(b"not an index")
    with pytest.raises(ValueError, match="cannot read the image-cache index"):
        cache_images(jpegs, cache_dir=tmp_path / "c", progress=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="cache_dir="):
        cache_images(jpegs, cache_dir=blocker / "sub", progress=False)
    jitter = ImageListDataset(
        jpegs.paths, jpegs.labels, v2.Compose([v2.ToImage(), v2.ColorJitter(0.3), v2.CenterCrop(8)])
    )
    with pytest.raises(ValueError, match="data.cache: false"):
        cache_images(jitter, cache_dir=tmp_path / "c")
    with pytest.raises(TypeError, match="cannot cache"):
        cache_images(type("NoFiles", (), {"transform": make_transform("resnet50")})())
    aug = BatchAugment(32)
    with pytest.raises(TypeError, match="uint8"):
        aug(torch.rand(3, 40, 40))
    with pytest.raises(ValueError, match="scale"):
        BatchAugment(32, scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="at least 224"):
        center_crop_boxes([100], [120], 224)
