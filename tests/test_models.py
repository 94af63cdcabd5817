"""Checks of dml_nb.blocks.models too heavy for the notebook: full-size forwards, ImageNet weight files, and the
two-process all_gather path of MemoryQueue."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from dml_nb.core.base import seed_everything
from dml_nb.blocks.models import (
    Backbone,
    BNInception,
    ResNet50,
    SmallCNN,
    batchnorm_modules,
    build_backbone,
    global_pool,
)
from dml_nb.blocks.heads import EmbeddingModel, MultiHead
from dml_nb.blocks.momentum import MemoryQueue, MomentumEncoder
from dml_nb.data.preprocessing import Preprocessing

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    "An empty torch cache: `pretrained=True` looks in <tmp>/hub/checkpoints."
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    return tmp_path / "hub" / "checkpoints"


def _bn_stats(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


# ResNet50 ------------------------------------------------------------------------------------------------------


def test_resnet50_224_frozen_bn_train_step():
    seed_everything(0)
    model = ResNet50(frozen_bn=True).train()
    assert model.training and not any(bn.training for bn in batchnorm_modules(model))
    stats = _bn_stats(model)
    gamma = model.bn1.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 224, 224)
    feats = model(x)
    assert feats.shape == (2, 2048)
    feats.pow(2).mean().backward()
    opt.step()
    model.train()  # calling train() again must not switch BatchNorm back on
    model(x)
    for k, v in _bn_stats(model).items():
        assert torch.equal(v, stats[k]), k
    assert not torch.equal(model.bn1.weight.detach(), gamma)  # affine parameters still train by default


def test_resnet50_frozen_affine_and_pooling():
    seed_everything(0)
    model = ResNet50(frozen_bn=True, frozen_bn_affine=True, pooling="avg+max").eval()
    assert all(not p.requires_grad for bn in batchnorm_modules(model) for p in bn.parameters())
    assert any(p.requires_grad for p in model.parameters())
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        fmap = model.forward_features(x)
        torch.testing.assert_close(model(x), fmap.mean((2, 3)) + fmap.amax((2, 3)))
        torch.testing.assert_close(global_pool(fmap, "max"), fmap.amax((2, 3)))


def test_resnet50_loads_torchvision_file_and_cache(torch_home):
    from torchvision.models import resnet50

    seed_everything(0)
    ref = resnet50(weights=None).eval()  # laid out like resnet50-0676ba61.pth, classifier included
    torch_home.mkdir(parents=True)
    torch.save(ref.state_dict(), torch_home / "resnet50-0676ba61.pth")
    ours = build_backbone("resnet50", pretrained=True).eval()
    ref.fc = nn.Identity()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))
    by_path = build_backbone("resnet50", pretrained=str(torch_home / "resnet50-0676ba61.pth"))
    torch.testing.assert_close(by_path.conv1.weight, ours.conv1.weight)


def test_pretrained_true_without_file_is_a_fast_clear_error(torch_home):
    for name, fname in [
        ("resnet50", "resnet50-0676ba61.pth"),
        ("bninception", "bn_inception-52deb4733.pth"),
        ("googlenet", "googlenet-1378be20.pth"),
    ]:
        t0 = time.perf_counter()
        with pytest.raises(FileNotFoundError) as e:
            build_backbone(name, pretrained=True)
        assert time.perf_counter() - t0 < 30  # no network attempt, nothing hangs
        msg = str(e.value)
        assert fname in msg and str(torch_home) in msg and "never downloads" in msg


def test_wrong_weight_file_is_refused(tmp_path):
    seed_everything(0)
    torch.save(SmallCNN().state_dict(), tmp_path / "cnn.pth")
    with pytest.raises(ValueError, match="does not match backbone 'bninception'.*missing.*unexpected"):
        build_backbone("bninception", pretrained=tmp_path / "cnn.pth")
    with pytest.raises(TypeError, match="pretrained must be"):
        build_backbone("small_cnn", pretrained=3)


# BN-Inception --------------------------------------------------------------------------------------------------

# (key, shape) pairs of the commonly distributed converted file (pretrainedmodels' bn_inception-52deb4733.pth,
# Caffe layer names), written out by hand from its published layout.
PUBLISHED_BNINCEPTION = {
    "conv1_7x7_s2.weight": (64, 3, 7, 7),
    "conv1_7x7_s2.bias": (64,),
    "conv1_7x7_s2_bn.running_var": (64,),
    "conv2_3x3_reduce.weight": (64, 64, 1, 1),
    "conv2_3x3.weight": (192, 64, 3, 3),
    "inception_3a_1x1.weight": (64, 192, 1, 1),
    "inception_3a_3x3_reduce.weight": (64, 192, 1, 1),
    "inception_3a_3x3.weight": (64, 64, 3, 3),
    "inception_3a_double_3x3_reduce.weight": (64, 192, 1, 1),
    "inception_3a_double_3x3_1.weight": (96, 64, 3, 3),
    "inception_3a_double_3x3_2.weight": (96, 96, 3, 3),
    "inception_3a_pool_proj.weight": (32, 192, 1, 1),
    "inception_3a_pool_proj_bn.weight": (32,),
    "inception_3b_3x3.weight": (96, 64, 3, 3),
    "inception_3b_pool_proj.weight": (64, 256, 1, 1),
    "inception_3c_3x3_reduce.weight": (128, 320, 1, 1),
    "inception_3c_3x3.weight": (160, 128, 3, 3),
    "inception_3c_double_3x3_2.weight": (96, 96, 3, 3),
    "inception_4a_1x1.weight": (224, 576, 1, 1),
    "inception_4b_1x1.weight": (192, 576, 1, 1),
    "inception_4c_double_3x3_2.weight": (160, 160, 3, 3),
    "inception_4d_double_3x3_reduce.weight": (160, 608, 1, 1),
    "inception_4d_3x3.weight": (192, 128, 3, 3),
    "inception_4e_double_3x3_1.weight": (256, 192, 3, 3),
    "inception_4e_double_3x3_2_bn.running_mean": (256,),
    "inception_5a_1x1.weight": (352, 1056, 1, 1),
    "inception_5a_3x3.weight": (320, 192, 3, 3),
    "inception_5a_double_3x3_reduce.weight": (160, 1056, 1, 1),
    "inception_5b_double_3x3_reduce.weight": (192, 1024, 1, 1),
    "inception_5b_double_3x3_2_bn.bias": (224,),
    "inception_5b_pool_proj.weight": (128, 1024, 1, 1),
}
NO_1X1_OR_PROJ = {"3c", "4e"}  # the stride-2 modules: no 1x1 branch and no pool projection


def _published_conv_names():
    names = ["conv1_7x7_s2", "conv2_3x3_reduce", "conv2_3x3"]
    for m in ["3a", "3b", "3c", "4a", "4b", "4c", "4d", "4e", "5a", "5b"]:
        branches = ["3x3_reduce", "3x3", "double_3x3_reduce", "double_3x3_1", "double_3x3_2"]
        if m not in NO_1X1_OR_PROJ:
            branches = ["1x1"] + branches + ["pool_proj"]
        names += [f"inception_{m}_{b}" for b in branches]
    return names


def test_bninception_state_dict_matches_published_layout():
    sd = BNInception().state_dict()
    for k, shape in PUBLISHED_BNINCEPTION.items():
        assert tuple(sd[k].shape) == shape, k
    convs = _published_conv_names()
    expected = {f"{c}.{p}" for c in convs for p in ("weight", "bias")}
    expected |= {f"{c}_bn.{p}" for c in convs for p in ("weight", "bias", "running_mean", "running_var")}
    assert len(convs) == 69
    assert {k for k in sd if not k.endswith("num_batches_tracked")} == expected  # 414 tensors
    n_params = sum(v.numel() for k, v in sd.items() if k.endswith(("weight", "bias")) and "running" not in k)
    assert n_params + 1024 * 1000 + 1000 == 11_295_240  # with the 1000-way classifier: BN-Inception's 11.3M


@pytest.mark.parametrize("size", [227, 224])
def test_bninception_forward_full_size(size):
    seed_everything(0)
    model = BNInception(input_size=size).eval()
    assert model.preprocessing.input_size == size and model.channel_order == "BGR"
    with torch.no_grad():
        fmap = model.forward_features(torch.randn(2, 3, size, size))
    assert fmap.shape == (2, 1024, 7, 7)
    assert model(torch.randn(1, 3, size, size)).shape == (1, 1024)


def test_bninception_loads_published_format(tmp_path, torch_home):
    "The distributed file: no num_batches_tracked, BatchNorm tensors stored as (1, C), a 1000-way last_linear."
    seed_everything(0)
    src = BNInception().eval()
    published = {
        k: (v[None] if "_bn." in k else v) for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")
    }
    assert published["conv1_7x7_s2_bn.weight"].shape == (1, 64)
    published["last_linear.weight"], published["last_linear.bias"] = torch.randn(1000, 1024), torch.randn(1000)
    torch_home.mkdir(parents=True)
    torch.save(published, torch_home / "bn_inception-52deb4733.pth")
    dst = build_backbone("bninception", pretrained=True).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x))
    torch.save(src.state_dict(), tmp_path / "roundtrip.pth")  # our own checkpoint, plain round trip
    again = build_backbone("bninception", pretrained=tmp_path / "roundtrip.pth").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), src(x))
    broken = dict(published)
    broken["inception_4a_1x1.weight"] = torch.randn(10, 576, 1, 1)
    torch.save(broken, tmp_path / "broken.pth")
    with pytest.raises(
        ValueError, match=r"inception_4a_1x1.weight: file \(10, 576, 1, 1\) vs model \(224, 576, 1, 1\)"
    ):
        build_backbone("bninception", pretrained=tmp_path / "broken.pth")


def test_bninception_bn_momentum_option():
    assert BNInception().conv1_7x7_s2_bn.momentum == 0.1
    assert BNInception(bn_momentum=0.9).inception_5b_pool_proj_bn.momentum == 0.9


# GoogLeNet -----------------------------------------------------------------------------------------------------


def test_googlenet_matches_torchvision_with_imagenet_layout(tmp_path):
    from torchvision.models import googlenet

    seed_everything(0)
    ref = googlenet(weights=None, aux_logits=True, init_weights=True, transform_input=True).eval()
    keys = ref.state_dict().keys()
    assert any(k.startswith("aux1.") for k in keys)  # laid out like googlenet-1378be20.pth
    torch.save(ref.state_dict(), tmp_path / "googlenet-1378be20.pth")
    ours = build_backbone("googlenet", pretrained=tmp_path / "googlenet-1378be20.pth").eval()
    assert ours.preprocessing.input_size == 227 and ours.feature_dim == 1024
    ref.fc = nn.Identity()
    x = torch.randn(2, 3, 227, 227)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


# Momentum encoder on a real model, and the distributed queue ---------------------------------------------------


def test_momentum_encoder_on_embedding_model():
    seed_everything(0)
    model = EmbeddingModel(SmallCNN(width=8, feature_dim=32), MultiHead(32, {"discriminative": 8, "dance": 8}))
    key = MomentumEncoder(model, momentum=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(6, 3, 32, 32)
    model.train()
    key.train()
    assert not any(bn.training for bn in batchnorm_modules(key))
    before = {n: p.clone() for n, p in key.encoder.named_parameters()}
    model(x)["dance"].sum().backward()
    opt.step()
    key.update(model)
    q = dict(model.named_parameters())
    for n, p in key.encoder.named_parameters():
        torch.testing.assert_close(p, 0.5 * before[n] + 0.5 * q[n].detach())
    emb = key.embed(x)
    assert emb.shape == (6, 16) and not emb.requires_grad
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(6))


def _gather_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q = MemoryQueue(size=7, dim=2)
        for step in range(3):  # 3 steps x 2 ranks x 2 keys = 12 keys into 7 slots
            keys = torch.full((2, 2), float(100 * step + 10 * rank)) + torch.arange(2.0)[:, None]
            q.enqueue(keys)
        torch.save(q.state_dict(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_memory_queue_all_gather_two_processes(tmp_path):
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_gather_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    qs = []
    for s in states:
        q = MemoryQueue(7, 2)
        q.load_state_dict(s)
        qs.append(q)
    torch.testing.assert_close(qs[0].queue, qs[1].queue)  # every rank holds the same queue
    # enqueue order: per step rank 0's keys then rank 1's: step*100 + rank*10 + i
    order = [100 * s + 10 * r + i for s in range(3) for r in range(2) for i in range(2)]
    expected = torch.tensor(order[-7:], dtype=torch.float32)[:, None].expand(-1, 2)
    torch.testing.assert_close(qs[0].ordered_keys(), expected)
    assert qs[0].is_full and len(qs[0]) == 7
    print(f"2-process gloo gather test: {time.perf_counter() - t0:.1f} s")


# Divide and Conquer's sliced head against the authors' lib/model.py and train.py (golden fixture) -------------------

from golden import load_golden, arr
from dml_nb.blocks.heads import SlicedHead, slice_bounds


def _golden_head(case, **options):
    head = SlicedHead(case["in_dim"], case["dim"], case["num_slices"], **options)
    with torch.no_grad():
        head.linear.weight.copy_(torch.as_tensor(arr(case["weight"]), dtype=torch.float32))
        head.linear.bias.copy_(torch.as_tensor(arr(case["bias"]), dtype=torch.float32))
    return head, torch.as_tensor(arr(case["features"]), dtype=torch.float32)


def _close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(arr(b), dtype=torch.float32), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("i", [0, 1, 3])  # (16 dims, K = 3), (16, 4), (12, 1); case 2 (K = 5) is refused
def test_sliced_head_matches_the_official_model(i):
    g = load_golden("dnc_sliced_embedding")
    case, out = g["inputs"]["cases"][i], g["outputs"]["cases"][i]
    bounds = slice_bounds(case["dim"], case["num_slices"])
    assert [list(range(a, b)) for a, b in bounds] == out["learner_neurons"]  # ceil-sized slices
    head, f = _golden_head(case)
    with torch.no_grad():
        # the code evaluates the concatenation of unit slices (norm sqrt(K)); ours is that, re-normalised
        _close(head(f) * case["num_slices"] ** 0.5, out["forward"])
        _close(head(f), out["train_full_epoch80"])  # the full-embedding phase
        floor = SlicedHead(case["in_dim"], case["dim"], case["num_slices"], train_split="floor")
        floor.load_state_dict(head.state_dict())
        for k in range(case["num_slices"]):
            _close(floor(f, slice=k), out["train_slice_epoch0"][k])


def test_sliced_head_wrong_readings_fail():
    g = load_golden("dnc_sliced_embedding")
    case, out = g["inputs"]["cases"][0], g["outputs"]["cases"][0]  # 16 dims, K = 3
    head, f = _golden_head(case, full_embedding="raw")
    with torch.no_grad():
        with pytest.raises(AssertionError):
            _close(head(f), out["train_full_epoch80"])
        ceil, _ = _golden_head(case)  # ceil: learner 0 trains 6 dims
        assert ceil(f, slice=0).shape[1] == 6 != len(out["train_slice_epoch0"][0][0]) == 5
    # equal slices (K = 4): both splits are the code's
    case4, out4 = g["inputs"]["cases"][1], g["outputs"]["cases"][1]
    head4, f4 = _golden_head(case4)
    with torch.no_grad():
        for k in range(4):
            _close(head4(f4, slice=k), out4["train_slice_epoch0"][k])
    # K = 5 on 16 dims: the code's last learner has no dimensions; dml_nb refuses it
    case5, out5 = g["inputs"]["cases"][2], g["outputs"]["cases"][2]
    assert out5["learner_neurons"][4] == []
    with pytest.raises(ValueError, match="without dimensions"):
        SlicedHead(case5["in_dim"], case5["dim"], 5)


@pytest.mark.parametrize("K", [1, 3, 4, 8, 16])
def test_sliced_head_xavier_init_statistics(K):
    g = load_golden("dnc_sliced_embedding")
    rows = [(x, o) for x, o in zip(g["inputs"]["init"], g["outputs"]["init"]) if x["num_slices"] == K]
    official = np.mean([o["weight_std"] for _, o in rows], axis=0)  # per slice, over 3 seeds
    bias = np.mean([o["bias_std"] for _, o in rows])
    ours = []
    for seed in range(3):
        torch.manual_seed(seed)
        head = SlicedHead(2048, 128, K)
        W = head.linear.weight.detach()
        ours.append([float(W[a:b].std()) for a, b in head.bounds])
        assert abs(float(W.mean())) < 1e-3
        assert float(head.linear.bias.detach().abs().max()) <= 1 / 2048**0.5
    np.testing.assert_allclose(np.mean(ours, axis=0), official, rtol=0.03)
    np.testing.assert_allclose(
        float(torch.stack([SlicedHead(2048, 128, K).linear.bias.detach().std() for _ in range(3)]).mean()),
        bias,
        rtol=0.1,
    )
    torch.manual_seed(0)
    default = SlicedHead(2048, 128, K, init="default").linear.weight.detach()
    assert abs(float(default.std()) - official.mean()) / official.mean() > 0.5  # torch's init: 0.013, not 0.031


# preprocessing is the backbone's: a new backbone needs no edit elsewhere ------------------------------------------


@pytest.mark.parametrize("name,size", [("resnet50", 250), ("googlenet", 227), ("bninception", 224), ("small_cnn", 48)])
def test_an_instance_states_the_preprocessing_its_data_pipeline_uses(name, size):
    from dml_nb.data.datasets import make_transform

    assert build_backbone(name, input_size=size).preprocessing == make_transform(name, size=size).preprocessing


class _ToyBGR(Backbone):
    "A toy backbone with preprocessing of its own: crop 24, test resize 28, its own mean/std, BGR and crop ranges."

    def __init__(self, pretrained=None):
        super().__init__()
        self.conv, self.feature_dim, self.preprocessing = nn.Conv2d(3, 8, 3), 8, self.preprocessing_for(24)
        self._finish(pretrained, "toy_bgr")

    @classmethod
    def preprocessing_for(cls, size=None):
        return Preprocessing(
            size or 24, 28, (0.3, 0.4, 0.5), (0.2, 0.25, 0.3), "BGR", train_scale=(0.5, 1.0), train_ratio=(0.8, 1.25)
        )

    def forward_features(self, x):
        return self.conv(x)


@pytest.fixture
def toy_backbone(monkeypatch):
    "`toy_bgr` registered as a backbone for the test only."
    from dml_nb.core.registry import BACKBONES

    BACKBONES.get("resnet50")  # the package's backbones are registered first
    monkeypatch.setitem(BACKBONES._items, "toy_bgr", _ToyBGR)
    return _ToyBGR


def test_a_new_backbone_brings_its_preprocessing_everywhere(toy_backbone):
    from torchvision.transforms.v2 import functional as TF
    from dml_nb.data.cache import BatchAugment
    from dml_nb.data.datasets import ArrayDataset, make_transform
    from dml_nb.data.build import build_datasets
    from dml_nb.core.config import make_config
    from dml_nb.training.learner import eval_view

    pp = toy_backbone.preprocessing_for()
    train, test = make_transform("toy_bgr", train=True), make_transform("toy_bgr")
    assert train.preprocessing == test.preprocessing == build_backbone("toy_bgr").preprocessing == pp
    assert (tuple(train.transforms[2].size), train.transforms[2].scale, train.transforms[2].ratio) == (
        (24, 24),
        (0.5, 1.0),
        (0.8, 1.25),
    )
    img = (torch.rand(3, 40, 36, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    x = TF.center_crop(TF.resize(img.float() / 255, [28], antialias=True), [24])
    want = ((x - torch.tensor(pp.mean)[:, None, None]) / torch.tensor(pp.std)[:, None, None]).flip(0)
    torch.testing.assert_close(test(img), want)
    # the image cache: the batched augmentation runs the toy's numbers, and its test version comes from the record
    aug = BatchAugment.from_transform(train)
    assert (aug.size, aug.scale, aug.ratio, aug.flip, aug.mean, aug.bgr, aug.preprocessing) == (
        24,
        (0.5, 1.0),
        (0.8, 1.25),
        0.5,
        pp.mean,
        True,
        pp,
    )
    te = aug.test_version()
    assert (te.train_mode, te.size, te.resize) == (False, 24, 28)
    torch.testing.assert_close(te(img), want, atol=1e-4, rtol=1e-4)
    # the test view of a training set
    ds = ArrayDataset(
        np.random.default_rng(0).integers(0, 255, (2, 40, 36, 3), dtype=np.uint8), np.array([0, 1]), transform=train
    )
    assert torch.equal(eval_view(ds)[1][0], test(ds.load(1)))
    # a config naming the backbone gets its transforms, on the PIL path and cached
    raw = {
        "data": {"name": "shapes", "images_per_class": 2, "eval_train": False},
        "model": {"backbone": "toy_bgr"},
        "method": {"name": "baseline", "embedding_dim": 4, "loss": "triplet", "miner": "semihard"},
        "train": {"epochs": 1, "batch_size": 8, "samples_per_class": 2},
    }
    tr, evals = build_datasets(make_config(raw), progress=False)
    assert tr.transform.preprocessing == evals["test"].transform.preprocessing == pp and tr[0][0].shape == (3, 24, 24)
    cached, _ = build_datasets(make_config({**raw, "data": {**raw["data"], "cache": True}}), progress=False)
    assert cached.batch_transform.preprocessing == pp and cached.eval_view().batch_transform.resize == 28


def test_a_transform_without_the_backbone_record_is_not_guessed():
    "Hand-built pipelines with ImageNet's mean were once matched to `resnet50` by that mean; now the error says what to pass."
    from torchvision.transforms import v2
    from dml_nb.data.cache import BatchAugment
    from dml_nb.data.datasets import ArrayDataset
    from dml_nb.training.learner import eval_view

    hand = v2.Compose(
        [
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.RandomResizedCrop(32, antialias=True),
            v2.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    with pytest.raises(ValueError, match=r"make_transform\(<backbone>, train=True\).*preprocessing="):
        BatchAugment.from_transform(hand).test_version()
    ds = ArrayDataset(np.zeros((1, 40, 40, 3), dtype=np.uint8), np.array([0]), transform=hand)
    with pytest.raises(ValueError, match=r"make_transform\(<backbone>, train=True\).*train_eval_ds"):
        eval_view(ds)


def test_a_backbone_without_preprocessing_is_an_error_saying_what_to_add(monkeypatch):
    from dml_nb.core.registry import BACKBONES
    from dml_nb.data.datasets import make_transform

    BACKBONES.get("resnet50")

    class Bare(Backbone):
        pass

    monkeypatch.setitem(BACKBONES._items, "bare", Bare)
    monkeypatch.setitem(BACKBONES._items, "plain_module", nn.Module)
    for name in ("bare", "plain_module"):
        with pytest.raises((NotImplementedError, TypeError), match=r"preprocessing_for\(size\).*data.preset"):
            make_transform(name)
