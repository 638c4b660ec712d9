"""transformers' own common model tests (ModelTesterMixin, ConfigTester), set up once for both models' modules
(tests/test_transformers_common.py: LoopFormer, tests/test_transformers_common_fprm.py: FPRM).

The test files come from the sdist of the installed transformers release; `bash scripts/fetch_transformers_tests.sh`
extracts them to .venv/transformers-tests/hf_common_tests/ (a module importing this one skips when they are missing).

What both modules share:
- `LoopedModelTestMixin`, put before `ModelTesterMixin` in a test class's bases: the auto-mapping names the common
  tests read, the tester and config tester built from class attributes, `test_config` and `test_model`;
- `skip_precisely` with `PRECISE_SKIPS` (common tests whose own skip message misstates why they do not run here),
  and `restore_common_tests` for a subclass that runs what its parent skips.
"""

import os
import sys
import unittest
import warnings
from typing import ClassVar
from unittest import mock

import pytest

from support import REPO_ROOT

COMMON_TESTS_DIR = os.path.join(REPO_ROOT, ".venv", "transformers-tests")
if not os.path.isfile(os.path.join(COMMON_TESTS_DIR, "hf_common_tests", "test_modeling_common.py")):
    pytest.skip(
        f"transformers common tests not found in {COMMON_TESTS_DIR}: run `bash scripts/fetch_transformers_tests.sh`",
        allow_module_level=True,
    )
pytest.importorskip("parameterized", reason="`parameterized` missing: run `bash scripts/fetch_transformers_tests.sh`")
if COMMON_TESTS_DIR not in sys.path:
    sys.path.insert(0, COMMON_TESTS_DIR)
# transformers registers its own test marks (flash_attn_test, ...) in its conftest, which is not used here.
warnings.filterwarnings("ignore", category=pytest.PytestUnknownMarkWarning)

from hf_common_tests.test_configuration_common import ConfigTester
from hf_common_tests.test_modeling_common import ModelTesterMixin, ids_tensor
from transformers.models.auto import modeling_auto
from transformers.testing_utils import torch_device


class LoopedModelTestMixin:
    """The common part of both models' common-test classes (`class XModelTest(LoopedModelTestMixin, ModelTesterMixin,
    unittest.TestCase)`). A class names:

    - `all_model_classes`, `config_class`;
    - `auto_mapping_names`: {name of a mapping in transformers' `modeling_auto`: {model_type: class name}}. In
      transformers' tree a model is listed there by name and the common tests read those names (a base model is not
      trained, a causal LM or token classifier gets `labels`); `AutoModel.register` does not add them, so they are
      patched in while the class runs;
    - `model_tester_class` and its `model_tester_kwargs` (a variant changes these), `config_tester_kwargs`.
    """

    # a new model: `_init_weights` must cover every weight (the check keys on a copyright year this repo lacks)
    test_can_init_all_missing_weights_before_2023 = True
    auto_mapping_names: ClassVar[dict] = {}
    model_tester_kwargs: ClassVar[dict] = {}
    config_tester_kwargs: ClassVar[dict] = {}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._auto_names = [
            mock.patch.dict(getattr(modeling_auto, mapping), names)
            for mapping, names in cls.auto_mapping_names.items()
        ]
        for patch in cls._auto_names:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._auto_names:
            patch.stop()
        super().tearDownClass()

    def setUp(self):
        self.model_tester = self.model_tester_class(self, **self.model_tester_kwargs)
        self.config_tester = ConfigTester(self, config_class=self.config_class, **self.config_tester_kwargs)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())


# Common tests that skip themselves with a message written for other models, which misstates why they do not run here
# (e.g. "LoopFormerModel does not support SDPA" from the composite-model check): the same skip, saying why. Both
# modules apply them. The RoPE and TP-plan ones are gaps of the models, not conventions: see each reason.
PRECISE_SKIPS = {
    "test_sdpa_can_dispatch_composite_models": "not a composite model (no vision/text sub-configs); SDPA dispatch is checked by "
    "test_sdpa_can_dispatch_non_composite_models and eager against SDPA by test_eager_matches_sdpa_inference_*",
    "test_can_capture_specific_layers_hidden_states": "`hidden_states` and `attentions` are collected by the model's own loop, not by transformers' output-capturing "
    "hooks (`_can_record_outputs`), so single layers cannot be picked; test_hidden_states_output and "
    "test_attention_outputs check what the loop returns",
    "test_capture_outputs_decorator": "outputs are collected by the model's own loop, not through the `@capture_outputs` decorator",
    "test_reverse_loading_mapping": "no weight-name conversion is registered for this model type (transformers' conversion mapping): checkpoints "
    "are saved and loaded under the module names; the authors' layouts are translated by the packages' own "
    "loaders (loopformer_hf/authors/, fprm_hf/authors/)",
    "test_can_load_from_already_mapped_keys": "no weight-name conversion is registered for this model type, so there are no mapped keys to reload",
    "test_resize_position_vector_embeddings": "`resize_position_embeddings` is not implemented: a learned position table keeps `max_position_embeddings` "
    "rows (as GPT-2's), RoPE has no table",
}


def _common_tests(prefixes):
    """The common tests named by `prefixes` (a name, or its parameterized expansions `name_*`)."""
    for name in dir(ModelTesterMixin):
        named = any(name == prefix or name.startswith(prefix + "_") for prefix in prefixes)
        if named and callable(test := getattr(ModelTesterMixin, name)):  # parameterized.expand leaves None there
            yield name, test


def skip_precisely(cls, reasons=PRECISE_SKIPS):
    """Replace each named common test of `cls` (parameterized ones by their prefix) with a skip saying `reason`.
    The mixin copies its tests onto every subclass when it is made: apply this to each class it concerns."""
    for prefix, reason in reasons.items():
        for name, test in _common_tests((prefix,)):
            setattr(cls, name, unittest.skip(reason)(test))


def restore_common_tests(cls, prefixes):
    """The common tests named by `prefixes` run on `cls` as the mixin defines them (its parent skips them)."""
    for name, test in _common_tests(prefixes):
        setattr(cls, name, test)


__all__ = [
    "PRECISE_SKIPS",
    "ConfigTester",
    "LoopedModelTestMixin",
    "ModelTesterMixin",
    "ids_tensor",
    "restore_common_tests",
    "skip_precisely",
    "torch_device",
]
