"Fixtures shared by several test modules: the procedural `shapes` sets that the training tests run on."

import pytest

from dml_nb.data.datasets import load_dataset


def shapes_sets(images_per_class: int, test_images_per_class: int = 4) -> tuple:
    "shapes train (augmented), the same images with test transforms, and test."
    return (
        load_dataset("shapes", split="train", images_per_class=images_per_class),
        load_dataset("shapes", split="train", images_per_class=images_per_class, augment=False),
        load_dataset("shapes", split="test", images_per_class=test_images_per_class),
    )


@pytest.fixture(scope="module")
def shapes4():
    "4 images per class in every set."
    return shapes_sets(4)


@pytest.fixture(scope="module")
def shapes8():
    "8 training images per class: k-means into 4 clusters of a 4-per-class set can leave a cluster of scattered singletons."
    return shapes_sets(8)


@pytest.fixture(autouse=True)
def _process_policy():
    """A notebook's `setup` installs its run policy for the rest of its process (`use_policy`: the kernel is the
    process); under pytest the process is a worker shared by many tests, so each test gets back the policy it found."""
    from dml_nb.experiments import results

    before = results.run_policy()
    yield
    results.use_policy(before)


def _has_faiss() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


HAS_FAISS = _has_faiss()


def pytest_collection_modifyitems(config, items):
    "Tests marked `gpu` skip where torch sees no CUDA device (benchmarks/gpu_check.sh runs them on a GPU)."
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on a GPU machine; benchmarks/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """faiss is optional (the [faiss-cpu] / [faiss-gpu] extras): where it is not installed, a test that reaches a faiss
    back end (a comparison with faiss, or a recipe whose code clusters with faiss) is skipped, naming the extra."""
    outcome = yield
    rep = outcome.get_result()
    if HAS_FAISS or call.excinfo is None:
        return
    from dml_nb.evaluation.faiss_backend import FaissMissingError

    e = call.excinfo.value  # dml_nb's error, or `import faiss` itself failing (pytorch-metric-learning's calculator)
    if isinstance(e, FaissMissingError) or (isinstance(e, ImportError) and e.name == "faiss"):
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, "Skipped: needs faiss (pip install 'dml_nb[faiss-cpu]')")
