"Fixtures shared by several test modules: the procedural `shapes` sets that the training tests run on."
import pytest

from dml_nb.data import load_dataset


def shapes_sets(images_per_class: int, test_images_per_class: int = 4) -> tuple:
    "shapes train (augmented), the same images with test transforms, and test."
    return (load_dataset("shapes", split="train", images_per_class=images_per_class),
            load_dataset("shapes", split="train", images_per_class=images_per_class, augment=False),
            load_dataset("shapes", split="test", images_per_class=test_images_per_class))


@pytest.fixture(scope="module")
def shapes4():
    "4 images per class in every set."
    return shapes_sets(4)


@pytest.fixture(scope="module")
def shapes8():
    "8 training images per class: k-means into 4 clusters of a 4-per-class set can leave a cluster of scattered singletons."
    return shapes_sets(8)
