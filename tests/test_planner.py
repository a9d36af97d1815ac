import pytest
import torch
from monai.data import CacheDataset, Dataset, MetaTensor, SmartCacheDataset
from monai.transforms import Compose, RandGaussianNoised

from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
from monai_fast.data.crop_cache import CropCacheDataset
from monai_fast.data.items import item_bytes
from monai_fast.data.persistent import TrustedPersistentDataset
from monai_fast.data.planner import plan_cache, rank_partition

MIB = 2**20


@pytest.fixture
def chain(tiny_config):
    return Compose(deterministic_transforms(tiny_config) + random_transforms(tiny_config))


def _files(tiny_files):
    return tiny_files[0] + tiny_files[1]


def test_measures_the_cached_part_and_picks_ram(chain, tiny_files):
    files = _files(tiny_files)
    plan = plan_cache(chain, files, "cpu", ram_budget_mib=10 * 2**10)
    assert plan.where == "ram" and plan.first_random == 7  # Load..SpatialPad, before RandCropByPosNegLabeld
    one = Compose(chain.transforms[:7])(dict(files[0]))
    assert plan.bytes_per_item == pytest.approx(item_bytes(one), rel=0.3)
    assert plan.total_bytes == int(plan.bytes_per_item * len(files) * 1.2)
    assert "RAM" in plan.describe()
    ds = plan.build(files, chain)
    assert isinstance(ds, CacheDataset) and len(ds) == len(files)


def test_budgets_move_the_cache_down_the_hierarchy(chain, tiny_files, tiny_config, tmp_path):
    files = _files(tiny_files)
    per = plan_cache(chain, files, "cpu").bytes_per_item
    need = int(per * len(files) * 1.2)
    disk = plan_cache(
        chain, files, "cpu", ram_budget_mib=need / 2 / MIB, disk_budget_mib=10 * need / MIB, cache_dir=tmp_path
    )
    assert disk.where == "disk" and "not in RAM" in disk.describe()
    assert "CropCacheDataset" in disk.describe() and "RandCropByPosNegLabeld after it reads only its patches" in (
        disk.describe()
    )
    crops = disk.build(files, chain)
    assert isinstance(crops, CropCacheDataset) and crops.reads_patches
    assert crops[0][0]["image"].shape[1:] == tuple(tiny_config.patch_size)
    # a chain whose first random transform is no crop keeps whole items on disk
    noisy = Compose([*chain.transforms[:7], RandGaussianNoised("image", prob=1.0), *chain.transforms[7:]])
    whole = plan_cache(
        noisy, files, "cpu", ram_budget_mib=need / 2 / MIB, disk_budget_mib=10 * need / MIB, cache_dir=tmp_path
    )
    assert whole.where == "disk" and "whole items" in whole.describe()
    whole_items = whole.build(files, noisy)
    assert isinstance(whole_items, TrustedPersistentDataset)
    # read back from disk (a second read, and a data set built again as a rerun would), items keep their metadata:
    # the affine and the applied operations that MONAI's Invertd undoes
    computed = whole_items[0][0]["image"]  # the first of the item's crops
    for read in (whole_items[0][0]["image"], whole.build(files, noisy)[0][0]["image"]):
        spacing = read.affine[:3, :3].abs()  # a random flip after the cache turns an axis, not its spacing
        assert isinstance(read, MetaTensor) and torch.equal(spacing, computed.affine[:3, :3].abs())
        assert [op["class"] for op in read.applied_operations] == [op["class"] for op in computed.applied_operations]
    smart = plan_cache(
        chain, files, "cpu", ram_budget_mib=need / 2 / MIB, disk_budget_mib=need / 10 / MIB, cache_dir=tmp_path
    )
    assert smart.where == "smartcache" and 2 <= smart.cache_num < len(files)
    assert isinstance(smart.build(files, chain, replace_rate=0.5), SmartCacheDataset)
    none = plan_cache(chain, files, "cpu", ram_budget_mib=per / 2 / MIB)
    assert none.where == "none" and type(none.build(files, chain)) is Dataset


def test_gpu_is_chosen_only_for_a_cuda_device_within_its_budget(chain, tiny_files, tiny_config):
    files = _files(tiny_files)
    big = 10 * 2**10  # MiB
    assert plan_cache(chain, files, "cpu", gpu_budget_mib=big, ram_budget_mib=big).where == "ram"
    plan = plan_cache(chain, files, "cuda", gpu_budget_mib=big, ram_budget_mib=big)  # a plan; building it needs CUDA
    assert plan.where == "gpu" and "GPU memory" in plan.describe()
    with_indices = Compose(
        deterministic_transforms(tiny_config, precompute_indices=True)
        + random_transforms(tiny_config, precomputed_indices=True)
    )
    plan = plan_cache(with_indices, files, "cuda", gpu_budget_mib=big, ram_budget_mib=big)
    assert plan.tensor_keys == ["image", "label"]  # the 1-D crop-index arrays stay where they are
    tight = plan_cache(chain, files, "cuda", gpu_budget_mib=1000 / MIB, ram_budget_mib=big)
    assert tight.where == "ram" and "not in GPU memory" in tight.describe()


@pytest.mark.gpu
def test_gpu_plan_builds_a_cache_in_gpu_memory(chain, tiny_files):
    files = _files(tiny_files)
    plan = plan_cache(chain, files, "cuda:0")
    assert plan.where == "gpu"
    ds = plan.build(files, chain)
    assert ds[0][0]["image"].device.type == "cuda"


def test_rank_partitions_are_disjoint_and_even():
    data = [{"i": i} for i in range(10)]
    parts = [rank_partition(data, r, 3) for r in range(3)]
    assert len({len(p) for p in parts}) == 1
    seen = [d["i"] for p in parts for d in p]
    assert set(seen) == set(range(10))
    with pytest.raises(ValueError, match="rank"):
        rank_partition(data, 3, 3)


def test_bad_options(chain, tiny_files):
    with pytest.raises(ValueError, match="empty"):
        plan_cache(chain, [], "cpu")
    with pytest.raises(ValueError, match="margin"):
        plan_cache(chain, _files(tiny_files), "cpu", margin=0.5)
    with pytest.raises(ValueError, match="ram_budget_mib"):
        plan_cache(chain, _files(tiny_files), "cpu", ram_budget_mib=-1)


def test_item_bytes_counts_nested_tensors():
    assert (
        item_bytes({"a": torch.zeros(10, dtype=torch.float32), "b": [torch.zeros(2, dtype=torch.int16)], "c": "x"})
        == 44
    )


def test_a_nested_compose_is_planned_over_its_transforms(chain, tiny_files, tmp_path):
    files = _files(tiny_files)
    nested = Compose(
        [Compose(chain.transforms[:3]), *chain.transforms[3:]]
    )  # the loading steps in a chain of their own
    flat = plan_cache(chain, files, "cpu", ram_budget_mib=10 * 2**10)
    plan = plan_cache(nested, files, "cpu", ram_budget_mib=10 * 2**10)
    assert plan.first_random == flat.first_random == 7 and plan.bytes_per_item == flat.bytes_per_item
    cached = plan.build(files, nested)
    assert isinstance(cached, CacheDataset) and torch.is_tensor(cached._cache[0]["image"])  # volumes, not paths


def test_the_crop_tier_is_planned_with_the_crop_indices_it_writes(chain, tiny_files, tmp_path):
    files = _files(tiny_files)
    need = int(plan_cache(chain, files, "cpu").bytes_per_item * len(files) * 1.2)  # the items alone, with margin
    ample = plan_cache(chain, files, "cpu", ram_budget_mib=0, disk_budget_mib=100 * need / MIB, cache_dir=tmp_path)
    assert ample.where == "disk" and "crop indices per item" in ample.describe()
    crops = ample.build(files, chain)
    for i in range(len(crops)):  # every item written, its indices beside it
        crops[i]
    written = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert written > need  # the indices are not small: planning without them would overrun the budget
    tight = plan_cache(chain, files, "cpu", ram_budget_mib=0, disk_budget_mib=need / MIB, cache_dir=tmp_path / "t")
    assert tight.where != "disk" and "crop indices per item" in tight.describe()
