"""The deprecated module paths of the harness and of the tuner's recipe binding: one warning each, the same objects."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

#: deprecated path -> the module it names
ALIASES = {
    "monai_fast.recipes.runner": "monai_fast.race.runner",
    "monai_fast.recipes.epochs": "monai_fast.race.epochs",
    "monai_fast.recipes.lab": "monai_fast.race.lab",
    "monai_fast.report.compare": "monai_fast.race.compare",
    "monai_fast.distributed.drill": "monai_fast.race.drill",
    "monai_fast.tune.recipe": "monai_fast.recipes.tuning",
}


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "monai_fast" in str(w.message)
    ]


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_module_path_warns_once_and_gives_the_same_objects(old):
    new = importlib.import_module(ALIASES[old])
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
        importlib.import_module(old)  # a second import is the cached module: no second warning
    messages = _ours(caught)
    assert len(messages) == 1, messages
    assert old in messages[0] and ALIASES[old] in messages[0]
    assert alias.__all__ == new.__all__ and new.__all__
    for name in new.__all__:
        assert getattr(alias, name) is getattr(new, name), name


@pytest.mark.parametrize("name", ["default_space", "tune_recipe", "typical_val_shape"])
def test_the_tuners_recipe_binding_warns_and_names_recipes_tuning(name):
    import monai_fast.recipes.tuning as tuning
    import monai_fast.tune as tune

    tune.__dict__.pop(name, None)  # a name already asked for is kept in the module, without a second warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(tune, name)
    messages = _ours(caught)
    assert len(messages) == 1 and "monai_fast.recipes.tuning" in messages[0], messages
    assert got is getattr(tuning, name)
    with pytest.raises(AttributeError):
        tune.no_such_name  # noqa: B018
