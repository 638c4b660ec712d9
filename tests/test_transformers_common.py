"""transformers' own common model tests (ModelTesterMixin, ConfigTester) run on LoopFormer, set up as for FPRM by
tests/support/common_tester.py (this module skips when `bash scripts/fetch_transformers_tests.sh` has not extracted
them to .venv/transformers-tests/).

Looped-model conventions the common tests are adapted to (through the tester's knobs where there is one):
- `hidden_states` holds the embeddings + the state after each loop step: num_loops + 1 tensors
  (`expected_num_hidden_layers`), not num_hidden_layers + 1;
- `attentions` holds one tensor per (loop step, block): num_loops * num_hidden_layers tensors.
"""

import contextlib
import unittest
import warnings
from typing import ClassVar

import torch
from support.common_tester import (
    LoopedModelTestMixin,
    ModelTesterMixin,
    ids_tensor,
    restore_common_tests,
    skip_precisely,
    torch_device,
)

from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel


class LoopFormerModelTester:
    def __init__(
        self,
        parent,
        batch_size=2,
        seq_length=7,
        is_training=True,
        use_input_mask=True,
        use_labels=True,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_loops=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=37,
        hidden_act="gelu",
        loop_conditioning="shortcut",
        position_embedding_type="learned",
        max_position_embeddings=64,
        frequency_embedding_size=16,
        initializer_range=0.02,
        block_norm_weight=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        scope=None,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers  # k shared blocks
        self.num_blocks = num_hidden_layers
        self.num_loops = num_loops  # L loop steps
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.loop_conditioning = loop_conditioning
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.frequency_embedding_size = frequency_embedding_size
        self.initializer_range = initializer_range
        self.block_norm_weight = block_norm_weight
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.scope = scope
        # hidden_states: embeddings + one state per loop step
        self.expected_num_hidden_layers = num_loops + 1

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = None
        if self.use_input_mask:
            input_mask = torch.tril(torch.ones_like(input_ids).to(torch_device))
        token_labels = None
        if self.use_labels:
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), input_ids, input_mask, token_labels

    def get_config(self):
        return LoopFormerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_blocks,
            num_loops=self.num_loops,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            loop_conditioning=self.loop_conditioning,
            position_embedding_type=self.position_embedding_type,
            max_position_embeddings=self.max_position_embeddings,
            frequency_embedding_size=self.frequency_embedding_size,
            initializer_range=self.initializer_range,
            block_norm_weight=self.block_norm_weight,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )

    def create_and_check_model(self, config, input_ids, input_mask, token_labels):
        model = LoopFormerModel(config=config).to(torch_device).eval()
        with torch.no_grad():
            model(input_ids, attention_mask=input_mask)
            result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_causal_lm(self, config, input_ids, input_mask, token_labels):
        model = LoopFormerForCausalLM(config=config).to(torch_device).eval()
        with torch.no_grad():
            result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        self.parent.assertTrue(torch.isfinite(result.loss))

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}


@contextlib.contextmanager
def _attentions_per_call(tester):
    """The common attention test counts `num_hidden_layers` attention maps; a looped model returns one per
    (loop step, block). Present that count while the test runs; `get_config` keeps the real number of blocks."""
    tester.num_hidden_layers = tester.num_loops * tester.num_blocks
    try:
        yield
    finally:
        tester.num_hidden_layers = tester.num_blocks


class LoopFormerModelTest(LoopedModelTestMixin, ModelTesterMixin, unittest.TestCase):
    all_model_classes = (LoopFormerModel, LoopFormerForCausalLM)
    config_class = LoopFormerConfig
    auto_mapping_names: ClassVar[dict] = {
        "MODEL_MAPPING_NAMES": {"loopformer": "LoopFormerModel"},
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {"loopformer": "LoopFormerForCausalLM"},
    }
    model_tester_class = LoopFormerModelTester
    config_tester_kwargs: ClassVar[dict] = {"hidden_size": 36}

    def test_causal_lm(self):
        self.model_tester.create_and_check_causal_lm(*self.model_tester.prepare_config_and_inputs())

    def test_attention_outputs(self):
        # looped equivalent: num_loops * num_hidden_layers attention maps, each (heads, seq, seq)
        with _attentions_per_call(self.model_tester):
            super().test_attention_outputs()

    def test_bc_cache_name_forward(self):
        """The common test with LoopFormer's cache class (the common one skips any output cache but DynamicCache's
        exact type): the old name `past_key_values` still works, with a deprecation warning."""
        from loopformer_hf import LoopFormerCache
        from loopformer_hf.modeling_loopformer import CACHE_FIELD

        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).to(torch_device).eval()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                old = getattr(model(**inputs, use_cache=True, past_key_values=LoopFormerCache()), CACHE_FIELD)
            if CACHE_FIELD == "cache":  # the old name is deprecated from transformers 5.24 on
                self.assertTrue(any("`past_key_values` is deprecated" in str(w.message) for w in caught))
            new = getattr(model(**inputs, use_cache=True, cache=LoopFormerCache()), CACHE_FIELD)
            self.assertIsInstance(new, LoopFormerCache)
            self.assertEqual(old.get_seq_length(), new.get_seq_length())
            self.assertGreater(new.get_seq_length(), 0)

    @unittest.skip(
        "GenerationTesterMixin is not shipped in the transformers sdist (no tests/generation/); generate is "
        "covered by tests/loopformer/test_cache.py"
    )
    def test_generation_tester_mixin_inheritance(self):
        pass


class LoopFormerBaseLoopModelTest(LoopFormerModelTest):
    """Base-Loop variant (no adaLN, weighted block norms as the reference's Base-Loop), with RoPE, SwiGLU and
    grouped-query attention."""

    model_tester_kwargs: ClassVar[dict] = {
        "loop_conditioning": "none",
        "position_embedding_type": "rope",
        "hidden_act": "swiglu",
        "block_norm_weight": True,
    }


# The eager/SDPA comparisons (25 cases, about a minute) run on the Base-Loop class only: both classes send attention
# through the same interface, and the adaLN modulation around it does not depend on the attention implementation.
EAGER_SDPA = "test_eager_matches_sdpa_inference"
skip_precisely(
    LoopFormerModelTest,
    {EAGER_SDPA: "same attention path as LoopFormerBaseLoopModelTest, where these comparisons run"},
)
restore_common_tests(LoopFormerBaseLoopModelTest, (EAGER_SDPA,))

# transformers' RoPE tests (`rope_parameters`: scaling types, partial rotation) on a model without RoPE
LEARNED_POSITIONS_SKIPS = dict.fromkeys(
    (
        "test_model_rope_with_partial_rotation",
        "test_model_rope_scaling_frequencies",
        "test_model_rope_scaling_from_config",
    ),
    "learned absolute positions (the authors' GPT-2 layout) have no RoPE; LoopFormerBaseLoopModelTest runs these tests "
    "with RoPE",
)

for _cls in (LoopFormerModelTest, LoopFormerBaseLoopModelTest):  # each: the mixin copies its tests onto every subclass
    skip_precisely(_cls)
del _cls  # a module-level TestCase name would be collected again
skip_precisely(LoopFormerModelTest, LEARNED_POSITIONS_SKIPS)
