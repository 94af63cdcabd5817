"""The JPEG path (`data.decode: jpeg_batch`, dml_nb.data.batches.JpegImages): for the same seeds it gives the PIL path's crop
boxes and flips. Decoded in the loader workers (the CPU's mode) its pixels equal the PIL path's to the bit (both
decode with libjpeg-turbo and crop, resize and normalise with the same torchvision functions, image by image; measured
tolerance: 0), and a run trains identically on both paths. Decoded on the device, a batch is cropped in one batched
pass (resampling weights, two matrix products): equal up to float rounding, within 1/20 of an 8-bit level (measured
on the CPU: at most 1/140). On a GPU (nvJPEG) the decode differs by a few levels: the `gpu` test bounds it and
gpu_check.sh measures it."""

from __future__ import annotations
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from dml_nb.data.batches import (
    JpegDecode,
    JpegImages,
    JpegItems,
    SeededViews,
    jpeg_size,
    random_resized_crop_params,
    to_device,
)
from dml_nb.core.config import ConfigError, make_config
from dml_nb.core.base import seed_everything
from dml_nb.data.datasets import ImageListDataset, make_transform

LEVEL = 1 / 255  # one 8-bit level, as a fraction of a view's value range


def close_to(a: torch.Tensor, ref: torch.Tensor, levels: float = 0.05) -> bool:
    "Whether `a` is within `levels` 8-bit levels of `ref`, in units of ref's value range (the views are normalised)."
    span = float(ref.max() - ref.min())
    return a.shape == ref.shape and float((a - ref).abs().max()) <= levels * LEVEL * span


SIZES = [(375, 500), (500, 375), (333, 500), (500, 281), (41, 900), (900, 41), (60, 60), (224, 224), (17, 23)]


def photo(h: int, w: int, seed: int) -> np.ndarray:
    "A smooth colour field with fine noise: a JPEG decode of it costs and rounds like a photograph's."
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(1, 3, 7, 7, generator=g)
    x = (
        torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic")[0] * 210
        + torch.rand(3, h, w, generator=g) * 45
    )
    return x.clamp(0, 255).byte().permute(1, 2, 0).numpy()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    "JPEGs of CUB's sizes and extreme ones (RGB, one progressive, one grey), a PNG and a CMYK JPEG (decoded by PIL)."
    d = tmp_path_factory.mktemp("jpegs")
    out = []
    for k, (h, w) in enumerate(SIZES):
        p = d / f"{k}.jpg"
        Image.fromarray(photo(h, w, k)).save(p, quality=90, progressive=k == 1)
        out.append(p)
    Image.fromarray(photo(300, 400, 50)).convert("L").save(d / "grey.jpg", quality=85)
    Image.fromarray(photo(120, 160, 51)).save(d / "png.jpg", format="PNG")  # a PNG named .jpg
    Image.fromarray(photo(200, 150, 52)).convert("CMYK").save(d / "cmyk.jpg", quality=90)
    return out + [d / "grey.jpg", d / "png.jpg", d / "cmyk.jpg"]


def dataset(files, train=True, preset="resnet50", size=None):
    return ImageListDataset(files, np.arange(len(files)) % 3, make_transform(preset, train=train, size=size))


def test_header_sizes_and_what_pil_decodes(files):
    for p in files[: len(SIZES)]:
        with Image.open(p) as im:
            assert jpeg_size(p.read_bytes()) == (im.height, im.width)
    assert jpeg_size(files[-3].read_bytes()) == (300, 400)  # grey JPEG: decoded on the device too
    assert jpeg_size(files[-2].read_bytes()) is None and jpeg_size(files[-1].read_bytes()) is None  # PNG, CMYK: PIL


@pytest.mark.parametrize(
    "scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.16, 1.0), (3 / 4, 4 / 3)), ((0.5, 0.9), (0.2, 5.0))]
)
def test_crop_boxes_and_flips_are_the_pil_paths_draws(scale, ratio):
    "Same generator state -> the boxes and flips of the v2 pipeline's RandomResizedCrop and flip (fallbacks included)."
    pre = make_transform("resnet50", train=True).preprocessing
    from dataclasses import replace

    t = replace(pre, train_scale=scale, train_ratio=ratio).transform(train=True)
    jd = JpegDecode.from_transform(t)
    rrc, flip = t.transforms[2], t.transforms[3]
    assert isinstance(rrc, v2.RandomResizedCrop) and isinstance(flip, v2.RandomHorizontalFlip)
    for seed in range(300):
        h, w = SIZES[seed % len(SIZES)]
        seed_everything(seed, cuda=False)
        boxes, flips = jd.draw(h, w, views=2)
        after = torch.rand(1)  # both paths leave the generator in the same state
        seed_everything(seed, cuda=False)
        want = []
        for _ in range(2):
            p = rrc.make_params([torch.empty(3, h, w)])
            want.append([p["top"], p["left"], p["height"], p["width"], bool(torch.rand(1) < flip.p)])
        assert [b + [f] for b, f in zip(boxes.tolist(), flips.tolist())] == want
        assert torch.equal(after, torch.rand(1))
        seed_everything(seed, cuda=False)  # unflipped views (without_flips): the crops' draws only, in a row
        b, f = jd.draw(h, w, views=2, flip=False)
        seed_everything(seed, cuda=False)
        assert b.tolist() == [list(random_resized_crop_params(h, w, scale, ratio)) for _ in range(2)] and not f.any()


@pytest.mark.parametrize(
    "preset, size", [("resnet50", None), ("bninception", None), ("googlenet", 227), ("resnet50", 96)]
)
def test_pixels_equal_the_pil_path(files, preset, size):
    """In the worker and per item: the PIL path's tensors, bit for bit, train and test; batched (as on the device, one
    pass): within 1/20 of an 8-bit level of them."""
    src = dataset(files, train=True, preset=preset, size=size)
    keys = [(k, 1000 + k) for k in range(len(files))] + [(0, 5, False), (4, 6, False)]
    pil = SeededViews(src, views=2)
    ji = JpegImages(src, decode_on="device")
    items, collate = ji.loader_items(2, "cpu")
    assert isinstance(items, JpegItems) and collate is not None
    batch = to_device(collate([items[k] for k in keys]), "cpu", transform=ji.batch_transform)
    worker = JpegImages(src, decode_on="worker").loader_items(2, "cpu")[0]
    for j, k in enumerate(keys):
        ref = pil[k]
        assert close_to(batch["x"][j], ref["x"]) and close_to(batch["extra_views"][0][j], ref["extra_views"][0]), k
        got = worker[k]
        assert torch.equal(got["x"], ref["x"]) and torch.equal(got["extra_views"][0], ref["extra_views"][0]), k
        assert (batch["y"][j].item(), batch["index"][j].item()) == (ref["y"], ref["index"])
    assert not close_to(batch["x"][0].flip(-1), pil[keys[0]]["x"], levels=10)  # the bound tells views apart
    test = JpegImages(dataset(files, train=False, preset=preset, size=size))
    t_items, t_collate = JpegImages(test.source, decode_on="device").loader_items(1, "cpu")  # evaluation, batched
    t_batch = to_device(t_collate([t_items[(i, i)] for i in range(len(files))]), "cpu", transform=test.batch_transform)
    for i in range(len(files)):
        assert close_to(t_batch["x"][i], test.source[i][0]), i
    assert test.eval_view() is test
    ev = JpegImages(src).eval_view()
    for i in range(len(files)):
        assert torch.equal(ev[i][0], test.source[i][0]) and torch.equal(test[i][0], test.source[i][0]), i
    seed_everything(3, cuda=False)
    a = ji[2][0]
    seed_everything(3, cuda=False)
    assert torch.equal(a, src[2][0])  # ds[i]: torch's global RNG, like source[i]


def test_a_run_trains_identically_on_both_paths(tmp_path, monkeypatch):
    """A short run on CUB-format JPEGs: the same losses and metrics on the PIL path and the JPEG path decoded in the
    workers; decoded on the device (one batched pass per batch), the same training logs up to float rounding (measured:
    2e-5 relative). Its evaluation metrics are not compared: the toy images of a class differ by a few levels of
    noise, so rounding moves a neighbour (measured: train recall@1 0.81 against 0.88)."""
    from dml_nb.data.checks import write_fake_dataset
    from dml_nb.experiments.experiment import run

    root = write_fake_dataset("cub200", tmp_path / "cub", n_classes=8, per_class=4, size=40)
    cfg = {
        "data": {"name": "cub200", "root": str(root), "size": 32},
        "model": {"backbone": "small_cnn", "options": {"width": 4, "feature_dim": 16}},
        "method": {"name": "baseline", "embedding_dim": 8, "loss": "triplet", "miner": "semihard"},
        "train": {
            "epochs": 2,
            "batch_size": 16,
            "samples_per_class": 4,
            "batches_per_epoch": 2,
            "lr": 1e-3,
            "device": "cpu",
        },
        "eval": {"every": 1, "metrics": ["recall@1", "nmi"], "save_embeddings": False},
    }
    pil = run(cfg, runs_dir=tmp_path / "pil", progress=False)
    jpeg_cfg = {**cfg, "data": {**cfg["data"], "decode": "jpeg_batch"}}
    worker = run(jpeg_cfg, runs_dir=tmp_path / "worker", progress=False)
    monkeypatch.setattr(JpegImages, "decodes_on_device", lambda self, device: True)  # the GPU's mode, on the CPU
    device = run(jpeg_cfg, runs_dir=tmp_path / "device", progress=False)
    strip = lambda h: [{k: v for k, v in row.items() if k != "time" and not k.startswith("time/")} for row in h]
    assert strip(pil.history) == strip(worker.history)
    assert pil.metrics == worker.metrics
    logs = lambda h: [{k: v for k, v in row.items() if k.split("/")[0] in ("loss", "grad_norm", "grad")} for row in h]
    assert [r.keys() for r in logs(pil.history)] == [r.keys() for r in logs(device.history)]
    for a, b in zip(logs(pil.history), logs(device.history)):
        assert all(abs(a[k] - b[k]) <= 1e-3 * abs(a[k]) for k in a), (a, b)
    assert len(logs(pil.history)) == 2 and all("loss" in r for r in logs(pil.history))


def test_bad_settings_are_clear_errors(files):
    with pytest.raises(ConfigError, match="choose one"):
        make_config({"data": {"name": "cub200", "decode": "jpeg_batch", "cache": True}})
    with pytest.raises(ConfigError, match="data.decode"):
        make_config({"data": {"name": "cub200", "decode": "nvjpeg"}})
    from dml_nb.data.datasets import load_dataset

    with pytest.raises(TypeError, match="data.decode: pil"):
        JpegImages(load_dataset("shapes", split="train", images_per_class=2))
    with pytest.raises(ValueError, match="make_transform"):
        JpegImages(ImageListDataset(files[:2], [0, 1], transform=v2.Compose([v2.PILToTensor()])))
    bad = files[0].parent / "broken.jpg"
    bad.write_bytes(files[0].read_bytes()[:3000])  # the header and part of the scan
    ji = JpegImages(ImageListDataset([bad], [0], make_transform("resnet50", train=True)), decode_on="device")
    items, collate = ji.loader_items(1, "cpu")
    with pytest.raises(OSError, match=r"broken.jpg.*on_unreadable"):  # the PIL path's load names the file
        to_device(collate([items[(0, 1)]]), "cpu", transform=ji.batch_transform)
    ji.batch_transform.fallback = None  # without it: the batch's indices
    with pytest.raises(RuntimeError, match=r"dataset indices \[0\].*check-data"):
        to_device(collate([items[(0, 1)]]), "cpu", transform=ji.batch_transform)


@pytest.mark.gpu
def test_nvjpeg_path_on_the_gpu(files):
    """On a CUDA device: the same boxes; pixels within the decode's difference. Bounds in normalised units (one 8-bit
    level is 1/255/0.225 = 0.017): an NVIDIA H100 (torch 2.11, torchvision 0.26, 2026-11-27) measured a mean of 0.031
    and a maximum of 1.08 against the PIL path (nvJPEG's decode differs from libjpeg-turbo's); a crop drawn from
    another seed, or the view flipped, gives a mean of about 0.8 (measured on the CPU)."""
    from dml_nb.data.batches import nvjpeg_available

    if not nvjpeg_available("cuda"):
        pytest.skip("torchvision has no nvJPEG decode here")
    src = dataset(files, train=True)
    ji = JpegImages(src, decode_on="device")
    items, collate = ji.loader_items(1, "cuda")
    keys = [(k, 2000 + k) for k in range(len(files))]
    batch = to_device(collate([items[k] for k in keys]), "cuda", transform=ji.batch_transform)
    ref = torch.stack([SeededViews(src)[k]["x"] for k in keys])
    diff = (batch["x"].cpu() - ref).abs()
    assert diff.mean() < 0.045 and diff.max() < 1.6, (diff.mean(), diff.max())


FD_CHILD = """
import resource, sys, time
import numpy as np, torch
from dml_nb.data.batches import JpegImages
from dml_nb.data.datasets import ImageListDataset, make_transform
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
files = sys.argv[1:]
src = ImageListDataset(files, np.arange(len(files)) % 3, make_transform("resnet50", train=True))
items, collate = JpegImages(src, decode_on="device").loader_items(1, "cpu")
keys = [(i % len(files), i) for i in range(64 * 12)]
batches = [keys[a : a + 64] for a in range(0, len(keys), 64)]
loader = torch.utils.data.DataLoader(items, batch_sampler=batches, num_workers=4, collate_fn=collate)
for b in loader:
    time.sleep(0.1)  # the workers run ahead: 4 workers x 2 prefetched batches wait in the queue
print("OK", len(batches))
"""


def test_jpeg_batches_pass_workers_in_few_file_descriptors(files):
    """A worker hands each tensor of a batch over through a file descriptor: the JPEG path's batches are one buffer
    (`jpeg_collate`), so 4 workers of batches of 64 stay far below a limit of 256 open files. A list of one tensor per
    image (the earlier collate) needs 512 here and fails ('received 0 items of ancdata'); an NVIDIA H100 machine's 14
    workers of 112 died on the list ('DataLoader worker exited unexpectedly'; its limit was not read)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FD_CHILD, *map(str, files)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK 12" in r.stdout, r.stderr[-2000:]


def test_jpeg_collate_packs_and_unpacks(files):
    "One buffer and (N, 3) shapes; `unpack_jpeg` gives back every image, encoded (1-d) or decoded by PIL (C, H, W)."
    from dml_nb.data.batches import jpeg_collate, unpack_jpeg

    items, _ = JpegImages(dataset(files), decode_on="device").loader_items(1, "cpu")
    its = [items[(k, k)] for k in range(len(files))]
    b = jpeg_collate(its)
    assert isinstance(b["jpeg"], torch.Tensor) and b["jpeg_shapes"].shape == (len(files), 3)
    back = unpack_jpeg(b["jpeg"], b["jpeg_shapes"])
    assert all(torch.equal(x, it["jpeg"]) for x, it in zip(back, its))
    assert {x.dim() for x in back} == {1, 3}  # the PNG and the CMYK file are decoded in the worker
    with pytest.raises(ValueError, match="jpeg_collate"):
        unpack_jpeg(b["jpeg"][:-1], b["jpeg_shapes"])


@pytest.mark.parametrize("how", ["rewritten", "removed"])
def test_on_unreadable_holds_on_the_jpeg_path_for_an_image_that_breaks_mid_run(files, tmp_path, how):
    """An image that stops decoding after the check at the start (rewritten with a broken Huffman table, which the
    header still parses, or removed) follows data.on_unreadable on the JPEG path as on the PIL path: 'error' names the
    file; 'skip' warns and puts a readable image of the same class in its place, and the batch keeps its shape."""
    import shutil
    import warnings

    from dml_nb.data.checks import UnreadableImagesError
    from dml_nb.data.build import tolerate_unreadable

    paths = [shutil.copy(f, tmp_path / f"{k}.jpg") for k, f in enumerate(files[:6])]
    paths = [Path(p) for p in paths]
    labels = [0, 0, 0, 1, 1, 1]

    def batch(mode):
        src = ImageListDataset(paths, labels, make_transform("resnet50", train=True))
        tolerate_unreadable(src, mode, "test set")
        ji = JpegImages(src, decode_on="device")
        items, collate = ji.loader_items(1, "cpu")
        return to_device(collate([items[(k, 10 + k)] for k in range(6)]), "cpu", transform=ji.batch_transform)

    ref = batch("error")["x"]
    broken = paths[1]
    if how == "rewritten":
        data = bytearray(broken.read_bytes())
        at = data.find(b"\xff\xc4")  # the first Huffman table: its lengths become nonsense
        data[at + 5 : at + 25] = b"\xff" * 20
        broken.write_bytes(bytes(data))
        assert jpeg_size(bytes(data)) is not None  # the header still reads: only the decode fails
    else:
        broken.unlink()
    with pytest.raises(UnreadableImagesError, match="1.jpg"):
        batch("error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = batch("skip")["x"]
    assert x.shape == ref.shape and torch.isfinite(x).all()
    assert any("1.jpg" in str(w.message) and "stands in" in str(w.message) for w in caught)
    keep = [0, 2, 3, 4, 5]
    assert torch.equal(x[keep], ref[keep])  # the other images are untouched
